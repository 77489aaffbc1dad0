// ALiBi on the GPU, under the op layer of common/alibi.h: the shared bias formula (portable/alibi.h).
//
// Forward (alibi_bias, add_alibi, add_alibi_): a thread writes V consecutive keys of one row (b, h, i),
// V = 16 bytes / element size where rows are contiguous, whole vectors and aligned, else 1 with any strides;
// in place, each element is read and written by the same thread. The slope gradient (alibi_backward) is
// summed as the CPU sums it, so the GPU gives the CPU's bits: each row's sum_j grad * d_j in float64 (for a
// unit-stride row, 16 interleaved partial sums, lane l taking j = l mod 16, added in lane order, then the
// tail; one sequential sum otherwise), then each slope adds its rows' sums in row order.
#include "common/alibi.h"
#include "cuda/geometry.h"
#include "cuda/utils.cuh"
#include "portable/alibi.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace posenc::cuda {
namespace {

using portable::alibi_batch;
using portable::alibi_bias;
using portable::alibi_distance0;
using portable::alibi_head;
using portable::alibi_row_offset;
using portable::from_opmath;
using portable::to_opmath;

// The slope of row n in maths precision: slopes (float64) [B or 1, total_heads], head_offset applied.
struct Slopes {
  const double* values;
  bool per_batch;
  int64_t total_heads;
  int64_t head_offset;

  template <typename opmath>
  __device__ opmath of_row(const AlibiRows& rows, int64_t n) const {
    const int64_t b = per_batch ? alibi_batch(rows, n) : 0;
    return static_cast<opmath>(values[b * total_heads + head_offset + alibi_head(rows, n)]);
  }
};

template <AlibiMode kMode, int V, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    alibi_kernel(const scalar_t* in, AlibiRows in_rows, scalar_t* out, AlibiRows out_rows, int64_t num_rows,
                 int64_t chunks, Slopes slopes) {
  using opmath = opmath_t<scalar_t>;
  const int64_t work = num_rows * chunks;
  for (int64_t w = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); w < work;
       w += geometry::stride_step(gridDim.x, blockDim.x)) {
    const auto [n, j0] = geometry::row_piece(w, chunks, V);
    const opmath slope = slopes.of_row<opmath>(out_rows, n);
    const auto d0 = static_cast<opmath>(alibi_distance0(out_rows, n));
    scalar_t* dst = out + alibi_row_offset(out_rows, n);
    const scalar_t* src = in == nullptr ? nullptr : in + alibi_row_offset(in_rows, n);
    if constexpr (V == 1) {
      const opmath bias = alibi_bias<kMode>(slope, d0 - static_cast<opmath>(j0));
      dst[j0 * out_rows.stride_j] =
          from_opmath<scalar_t>(src == nullptr ? bias : to_opmath(src[j0 * in_rows.stride_j]) + bias);
    } else {
      Vec<scalar_t, V> x;
      if (src != nullptr) x = load_vec<V>(src + j0);
      Vec<scalar_t, V> y;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const opmath bias = alibi_bias<kMode>(slope, d0 - static_cast<opmath>(j0 + k));
        y.v[k] = from_opmath<scalar_t>(src == nullptr ? bias : to_opmath(x.v[k]) + bias);
      }
      store_vec<V>(dst + j0, y);
    }
  }
}

constexpr int kLanes = geometry::kAlibiLanes;  // the CPU's interleaved partial sums of a unit-stride row

// -sum_j grad[n, j] * d_j (|d_j| symmetric) of every row n, in float64, in the CPU's order. Unit stride: a
// row is 16 threads (its lanes), 16 rows a block; lane l sums j = l, l + 16, ... below the last whole group
// of 16, lane 0 then adds the lanes in order and the tail. Other strides: one thread sums a row in j order.
template <AlibiMode kMode, bool kUnit, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    alibi_row_sums_kernel(const scalar_t* grad, AlibiRows rows, int64_t num_rows, double* row_sums) {
  __shared__ double lanes[kThreads];
  const auto weight = [&](double distance0, int64_t j) {
    const double d = distance0 - static_cast<double>(j);
    return kMode == AlibiMode::Symmetric ? fabs(d) : d;
  };
  const int64_t k_len = rows.k_len;
  if constexpr (kUnit) {
    constexpr int kRowsPerBlock = geometry::kAlibiRowsPerBlock;
    const auto [lane, slot] = geometry::alibi_lane(threadIdx.x);
    const int64_t whole = geometry::alibi_whole(k_len);
    for (int64_t first = geometry::stride_first(blockIdx.x, kRowsPerBlock, 0); first < num_rows;
         first += geometry::stride_step(gridDim.x, kRowsPerBlock)) {
      const int64_t n = first + slot;
      double sum = 0.0;
      double distance0 = 0.0;
      const scalar_t* row = grad;
      if (n < num_rows) {
        row = grad + alibi_row_offset(rows, n);
        distance0 = static_cast<double>(alibi_distance0(rows, n));
        for (int64_t j = lane; j < whole; j += kLanes) {
          sum += static_cast<double>(to_opmath(row[j])) * weight(distance0, j);
        }
      }
      lanes[threadIdx.x] = sum;
      __syncthreads();
      if (lane == 0 && n < num_rows) {
        double tail = 0.0;
        for (int64_t j = whole; j < k_len; ++j) tail += static_cast<double>(to_opmath(row[j])) * weight(distance0, j);
        double total = 0.0;
        for (int l = 0; l < kLanes; ++l) total += lanes[threadIdx.x + l];
        row_sums[n] = -(total + tail);
      }
      __syncthreads();
    }
  } else {
    for (int64_t n = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); n < num_rows;
         n += geometry::stride_step(gridDim.x, blockDim.x)) {
      const scalar_t* row = grad + alibi_row_offset(rows, n);
      const auto distance0 = static_cast<double>(alibi_distance0(rows, n));
      double tail = 0.0;
      for (int64_t j = 0; j < k_len; ++j) {
        tail += static_cast<double>(to_opmath(row[j * rows.stride_j])) * weight(distance0, j);
      }
      row_sums[n] = -(0.0 + tail);  // the CPU's sum of its (here empty) lanes, then the tail
    }
  }
}

// slope_grad[b?, head_offset + h] = sum of the row sums of (b?, h) in increasing row order, from 0.
__global__ void alibi_slope_sums_kernel(const double* row_sums, AlibiRows rows, int64_t batch, bool per_batch,
                                        int64_t total_heads, int64_t head_offset, double* slope_grad) {
  const int64_t heads = rows.heads;
  const int64_t entries = (per_batch ? batch : 1) * heads;
  for (int64_t e = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); e < entries;
       e += geometry::stride_step(gridDim.x, blockDim.x)) {
    const auto [b_slope, h, batches] = geometry::alibi_slope_rows(e, heads, batch, per_batch);
    double sum = 0.0;
    for (int64_t b = batches.begin; b < batches.end; ++b) {
      const double* run = row_sums + (b * heads + h) * rows.q_len;
      for (int64_t i = 0; i < rows.q_len; ++i) sum += run[i];
    }
    slope_grad[b_slope * total_heads + head_offset + h] = sum;
  }
}

struct CudaAlibi : CudaDevice {

  // Writes every row of `out` as in + bias (in undefined: the bias alone); out may be in.
  template <typename scalar_t>
  static void add_bias(const at::Tensor& in, const at::Tensor& out, const at::Tensor& slopes, AlibiMode mode,
                       int64_t head_offset) {
    const auto slope_values = slopes.to(at::kDouble).contiguous();
    const Slopes local{slope_values.const_data_ptr<double>(), slopes.dim() == 2, slopes.size(-1), head_offset};
    const int64_t num_rows = out.numel() / out.size(3);
    constexpr int V = kMaxVec<scalar_t>;
    const auto out_rows = alibi_rows(out);
    const auto in_rows = in.defined() ? alibi_rows(in) : out_rows;
    const scalar_t* src = in.defined() ? in.const_data_ptr<scalar_t>() : nullptr;
    const bool vectorized = geometry::alibi_vectorizable(out.const_data_ptr(), out_rows, V) &&
                            (src == nullptr || geometry::alibi_vectorizable(src, in_rows, V));
    const auto plan = geometry::rows_launch(num_rows, out_rows.k_len, vectorized, V, multiprocessors());
    const auto chunks = plan.chunks;
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned int>(plan.blocks), kThreads, 0, current_stream()>>>(src, in_rows, dst, out_rows,
                                                                                       num_rows, chunks, local);
      POSENC_CUDA_LAUNCH_CHECK();
    };
    if (mode == AlibiMode::Symmetric) {
      vectorized ? launch(alibi_kernel<AlibiMode::Symmetric, V, scalar_t>)
                 : launch(alibi_kernel<AlibiMode::Symmetric, 1, scalar_t>);
    } else {
      vectorized ? launch(alibi_kernel<AlibiMode::Causal, V, scalar_t>)
                 : launch(alibi_kernel<AlibiMode::Causal, 1, scalar_t>);
    }
  }

  // acc[b?, head_offset + h] = -sum_{i, j} grad[b, h, i, j] * d_ij: each row's sum, then each slope's rows in order.
  template <typename scalar_t>
  static void slope_grad(const at::Tensor& grad, AlibiMode mode, const at::Tensor& slopes, int64_t head_offset,
                         const at::Tensor& acc) {
    const auto rows = alibi_rows(grad);
    const int64_t num_rows = grad.numel() / grad.size(3);
    auto row_sums = at::empty({num_rows}, grad.options().dtype(at::kDouble));
    const scalar_t* data = grad.const_data_ptr<scalar_t>();
    double* sums = row_sums.mutable_data_ptr<double>();
    const bool unit = rows.stride_j == 1;
    const auto blocks = static_cast<unsigned int>(geometry::alibi_row_sums_blocks(num_rows, unit, multiprocessors()));
    auto launch = [&](auto kernel) {
      kernel<<<blocks, kThreads, 0, current_stream()>>>(data, rows, num_rows, sums);
      POSENC_CUDA_LAUNCH_CHECK();
    };
    if (mode == AlibiMode::Symmetric) {
      unit ? launch(alibi_row_sums_kernel<AlibiMode::Symmetric, true, scalar_t>)
           : launch(alibi_row_sums_kernel<AlibiMode::Symmetric, false, scalar_t>);
    } else {
      unit ? launch(alibi_row_sums_kernel<AlibiMode::Causal, true, scalar_t>)
           : launch(alibi_row_sums_kernel<AlibiMode::Causal, false, scalar_t>);
    }
    const bool per_batch = slopes.dim() == 2;
    const int64_t entries = (per_batch ? grad.size(0) : 1) * rows.heads;
    const auto slope_blocks = static_cast<unsigned int>(geometry::grid_size(entries, kThreads, multiprocessors()));
    alibi_slope_sums_kernel<<<slope_blocks, kThreads, 0, current_stream()>>>(
        row_sums.const_data_ptr<double>(), rows, grad.size(0), per_batch, slopes.size(-1), head_offset,
        acc.mutable_data_ptr<double>());
    POSENC_CUDA_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  AlibiOps<CudaAlibi>::register_kernels(m);
}

}  // namespace posenc::cuda
