// The sinusoidal family on the GPU: how positions are read and the kernel launched under the op layer of
// common/sinusoidal.h; the shared angle engine, the additive kernel of cuda/additive.cuh.
#include "common/sinusoidal.h"
#include "cuda/additive.cuh"
#include "cuda/positions.cuh"

#include <torch/library.h>

namespace posenc::cuda {
namespace {

// "half_per_axis"'s channel codes from pair_axis on the device (no host read, so graph capture works too): pair i
// of the run [first, end) on one axis puts its sine at channel first + i and its cosine end - first channels later.
__global__ void half_per_axis_codes_kernel(const int32_t* pair_axis, int64_t pairs, int32_t* codes) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  int64_t first = i;
  while (first > 0 && pair_axis[first - 1] == pair_axis[i]) --first;
  int64_t end = i + 1;
  while (end < pairs && pair_axis[end] == pair_axis[i]) ++end;
  codes[first + i] = static_cast<int32_t>(2 * i);
  codes[end + i] = static_cast<int32_t>(2 * i + 1);
}

struct CudaSinusoidal : CudaDevice {

  // Positions as the kernel reads them, with the offset it adds to s where they are absent.
  struct Positions {
    DeviceAxisPositions axes;
    int64_t offset;
  };

  static Positions read_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                  int64_t offset, const std::optional<at::Tensor>& pair_axis) {
    return {axis_positions(op, positions, count, offset, angle_domain(), pair_axis), offset};
  }

  static constexpr auto check_indices = &check_device_indices_in_range;

  // out = in * scale + PE(positions) over the rows of `rows`.
  template <typename scalar_t>
  static void encode(const at::Tensor& in, const at::Tensor& ids, const at::Tensor& out, const Positions& pos,
                     const at::Tensor& inv_freq, SinusoidalLayout layout, double scale, const EncodedRows& rows) {
    const auto freq = inv_freq.to(at::kDouble).contiguous();
    const int64_t pairs = freq.numel();
    at::Tensor codes;
    if (layout == SinusoidalLayout::HalfPerAxis && pos.axes.pair_axis.defined()) {
      codes = at::empty({2 * pairs}, pos.axes.pair_axis.options());
      half_per_axis_codes_kernel<<<ceil_div(pairs, int64_t{kThreads}), kThreads, 0, current_stream()>>>(
          pos.axes.pair_axis.const_data_ptr<int32_t>(), pairs, codes.mutable_data_ptr<int32_t>());
      POSENC_CUDA_LAUNCH_CHECK();
    }
    // "half_per_axis" on one axis is "half".
    const auto kernel_layout = layout == SinusoidalLayout::HalfPerAxis && !codes.defined() ? SinusoidalLayout::Half : layout;
    const SinusoidalEncoding<opmath_t<scalar_t>> encoding{
        pos.axes.values.defined() ? pos.axes.values.const_data_ptr<double>() : nullptr,
        pos.offset,
        freq.const_data_ptr<double>(),
        pairs,
        kernel_layout,
        rows.sequence,
        pos.axes.n_axes,
        pos.axes.pair_axis.defined() ? pos.axes.pair_axis.const_data_ptr<int32_t>() : nullptr,
        codes.defined() ? codes.const_data_ptr<int32_t>() : nullptr};
    launch_additive(additive_rows<scalar_t>(in, ids, out, rows.num_positions, 2 * pairs), scale, encoding, true);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  SinusoidalOps<CudaSinusoidal>::register_kernels(m);
}

}  // namespace posenc::cuda
