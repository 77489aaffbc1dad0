// The learned family on the GPU: how table rows are read and the kernels launched under the op layer of
// common/learned.h; table rows added by the additive kernel of cuda/additive.cuh, make_positions and
// positions_from_mask as ATen scans. Resampled tables (resample_learned): a small kernel writes each axis's
// weights (portable/resample.h, float64) as a dense [out, in] matrix with each output's run and each input's
// run of outputs; the table kernel sums taps in float64 per output element, and the adjoint first sums grad over
// its leading dimensions (one thread per element, in order), then gathers each input element from the outputs
// that read it: no atomics, the same bits for any launch, the CPU's sums in the CPU's order.
#include "common/learned.h"
#include "cuda/additive.cuh"
#include "cuda/positions.cuh"
#include "cuda/utils.cuh"
#include "portable/resample.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace posenc::cuda {
namespace {

// One axis's weights in device memory: weights [out, in] (zero outside each run), run[o] = (first, count) of the
// inputs output o reads, users[i] = [lo, hi) of the outputs that read input i.
struct AxisWeights {
  const double* weights;
  const int64_t* run;
  const int64_t* users;
};

__global__ void axis_weights_kernel(ResampleAxis axis, double* weights, int64_t* run, int64_t* users) {
  const int64_t n = axis.out > axis.in ? axis.out : axis.in;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    if (t < axis.out) {
      double* row = weights + t * axis.in;
      for (int64_t i = 0; i < axis.in; ++i) row[i] = 0;
      int64_t count = 0;
      const int64_t first = portable::resample_taps(axis, t, &count, nullptr);
      portable::resample_taps(axis, t, &count, row + first);
      run[2 * t] = first;
      run[2 * t + 1] = count;
    }
    if (t < axis.in) portable::resample_adjoint_range(axis, t, users + 2 * t, users + 2 * t + 1);
  }
}

// Both axes' weights, in one buffer of the device (no host copy, nothing to synchronize).
struct GridWeights {
  at::Tensor weights;
  at::Tensor indices;
  AxisWeights height;
  AxisWeights width;

  GridWeights(const ResampleGrid& grid, const at::Device& device) {
    const auto& h = grid.height;
    const auto& w = grid.width;
    weights = at::empty({h.out * h.in + w.out * w.in}, at::TensorOptions(at::kDouble).device(device));
    indices = at::empty({2 * (h.out + h.in + w.out + w.in)}, at::TensorOptions(at::kLong).device(device));
    double* wh = weights.mutable_data_ptr<double>();
    double* ww = wh + h.out * h.in;
    int64_t* ih = indices.mutable_data_ptr<int64_t>();
    int64_t* iw = ih + 2 * (h.out + h.in);
    for (const auto& [axis, m, idx] : {std::tuple{h, wh, ih}, std::tuple{w, ww, iw}}) {
      const int64_t n = std::max(axis.out, axis.in);
      axis_weights_kernel<<<grid_size(n, kThreads), kThreads, 0, current_stream()>>>(axis, m, idx,
                                                                                     idx + 2 * axis.out);
      POSENC_CUDA_LAUNCH_CHECK();
    }
    height = {wh, ih, ih + 2 * h.out};
    width = {ww, iw, iw + 2 * w.out};
  }
};

// out[r, d], r < P + H * W: the prefix rows copied, grid rows the float64 sum over their taps, rounded once.
template <typename scalar_t>
__global__ void resample_table_kernel(const scalar_t* table, scalar_t* out, int64_t width, ResampleGrid grid,
                                      AxisWeights rows, AxisWeights cols) {
  const int64_t prefix = grid.prefix;
  const int64_t out_cols = grid.width.out;
  const int64_t in_rows = grid.height.in;
  const int64_t in_cols = grid.width.in;
  const int64_t total = (prefix + grid.height.out * out_cols) * width;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = e / width;
    const int64_t d = e % width;
    if (r < prefix) {
      out[e] = table[e];
      continue;
    }
    const int64_t h = (r - prefix) / out_cols;
    const int64_t w = (r - prefix) % out_cols;
    const int64_t fh = rows.run[2 * h];
    const int64_t nh = rows.run[2 * h + 1];
    const int64_t fw = cols.run[2 * w];
    const int64_t nw = cols.run[2 * w + 1];
    double acc = 0;  // along the rows first, then the columns: the CPU's order
    for (int64_t l = 0; l < nw; ++l) {
      const int64_t j = fw + l;
      const scalar_t* src = table + (prefix + j) * width + d;
      double along = 0;
      for (int64_t k = 0; k < nh; ++k) {
        const int64_t i = fh + k;
        along += rows.weights[h * in_rows + i] * static_cast<double>(portable::to_opmath(src[i * in_cols * width]));
      }
      acc += cols.weights[w * in_cols + j] * along;
    }
    out[e] = portable::round_from_double<scalar_t>(acc);
  }
}

// sum[s, d] = the sum over the leading blocks b of grad[b, s, d], in block order (float64).
template <typename scalar_t>
__global__ void sum_blocks_kernel(const scalar_t* grad, int64_t leads, int64_t block, double* sum) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < block;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    double acc = 0;
    for (int64_t b = 0; b < leads; ++b) acc += static_cast<double>(portable::to_opmath(grad[b * block + e]));
    sum[e] = acc;
  }
}

// out[r, d], r < P + Hs * Ws: the prefix rows of sum rounded, grid rows gathered from the outputs reading them.
template <typename scalar_t>
__global__ void resample_adjoint_kernel(const double* sum, scalar_t* out, int64_t width, ResampleGrid grid,
                                        AxisWeights rows, AxisWeights cols) {
  const int64_t prefix = grid.prefix;
  const int64_t out_cols = grid.width.out;
  const int64_t in_rows = grid.height.in;
  const int64_t in_cols = grid.width.in;
  const int64_t total = (prefix + in_rows * in_cols) * width;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = e / width;
    const int64_t d = e % width;
    if (r < prefix) {
      out[e] = portable::round_from_double<scalar_t>(sum[e]);
      continue;
    }
    const int64_t i = (r - prefix) / in_cols;
    const int64_t j = (r - prefix) % in_cols;
    double acc = 0;  // over the output rows first, then the columns: the CPU's order
    for (int64_t w = cols.users[2 * j]; w < cols.users[2 * j + 1]; ++w) {
      const double* src = sum + (prefix + w) * width + d;
      double along = 0;
      for (int64_t h = rows.users[2 * i]; h < rows.users[2 * i + 1]; ++h) {
        along += rows.weights[h * in_rows + i] * src[h * out_cols * width];
      }
      acc += cols.weights[w * in_cols + j] * along;
    }
    out[e] = portable::round_from_double<scalar_t>(acc);
  }
}

struct CudaLearned : CudaDevice {

  static DevicePositions read_table_rows(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                         int64_t offset, const PositionDomain& domain) {
    return {table_rows(op, positions, count, offset, domain), count, offset};
  }

  static constexpr auto check_indices = &check_device_indices_in_range;

  // out = in * scale + table[rows[p] (or offset + p)]: the rows read by P positions, shared by the
  // out.numel() / width / P leading indices.
  template <typename scalar_t>
  static void add_rows(const at::Tensor& in, const at::Tensor& ids, const at::Tensor& out, const at::Tensor& table,
                       const DevicePositions& rows, double scale) {
    const int64_t width = out.size(-1);
    const scalar_t* table_data = table.const_data_ptr<scalar_t>();
    const TableEncoding<scalar_t> encoding{table_data,
                                           rows.values.defined() ? rows.values.const_data_ptr<int64_t>() : nullptr,
                                           rows.offset, table.size(0), width};
    launch_additive(additive_rows<scalar_t>(in, ids, out, rows.count, width), scale, encoding, aligned(table_data));
  }

  template <typename scalar_t>
  static void resample(const at::Tensor& table, const at::Tensor& out, const ResampleGrid& grid) {
    const GridWeights weights(grid, table.device());
    resample_table_kernel<scalar_t><<<grid_size(out.numel(), kThreads), kThreads, 0, current_stream()>>>(
        table.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), out.size(1), grid, weights.height,
        weights.width);
    POSENC_CUDA_LAUNCH_CHECK();
  }

  // The table resampled into a temporary, then its rows added as add_rows adds a table's.
  template <typename scalar_t>
  static void add_resampled(const at::Tensor& in, const at::Tensor& out, const at::Tensor& table,
                            const ResampleGrid& grid) {
    const int64_t tokens = portable::resampled_tokens(grid);
    const auto resampled = at::empty({tokens, table.size(1)}, table.options());
    resample<scalar_t>(table, resampled, grid);
    add_rows<scalar_t>(in, {}, out, resampled, DevicePositions({}, tokens, 0), 1.0);
  }

  template <typename scalar_t>
  static void resample_adjoint(const at::Tensor& grad, const at::Tensor& out, const ResampleGrid& grid) {
    const GridWeights weights(grid, grad.device());
    const int64_t block = grad.size(-2) * grad.size(-1);
    auto sum = at::empty({block}, grad.options().dtype(at::kDouble));
    sum_blocks_kernel<scalar_t><<<grid_size(block, kThreads), kThreads, 0, current_stream()>>>(
        grad.const_data_ptr<scalar_t>(), grad.numel() / block, block, sum.mutable_data_ptr<double>());
    POSENC_CUDA_LAUNCH_CHECK();
    resample_adjoint_kernel<scalar_t><<<grid_size(out.numel(), kThreads), kThreads, 0, current_stream()>>>(
        sum.const_data_ptr<double>(), out.mutable_data_ptr<scalar_t>(), out.size(1), grid, weights.height,
        weights.width);
    POSENC_CUDA_LAUNCH_CHECK();
  }

  // Each row of a [..., S] mask is scanned along S (the CPU's count, as an ATen scan).
  static at::Tensor count_positions(const at::Tensor& is_real, int64_t first, int64_t pad) {
    // first + (real entries up to and including this one) - 1
    const auto numbered = at::add(at::cumsum(is_real, -1, at::kLong), first - 1);
    return at::where(is_real, numbered, pad).contiguous();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  LearnedOps<CudaLearned>::register_kernels(m);
}

}  // namespace posenc::cuda
