// The sinusoidal family on the GPU: how positions are read and the kernel launched under the op layer of
// common/sinusoidal.h; the shared angle engine, the additive kernel of cuda/additive.cuh.
#include "common/sinusoidal.h"
#include "cuda/additive.cuh"
#include "cuda/positions.cuh"

#include <torch/library.h>

namespace posenc::cuda {
namespace {

struct CudaSinusoidal : CudaDevice {

  static DevicePositions read_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                        int64_t offset) {
    return {angle_positions(op, positions, count, offset), count, offset};
  }

  static constexpr auto check_indices = &check_device_indices_in_range;

  // out = in * scale + PE(positions): P positions shared by the out.numel() / width / P leading indices.
  template <typename scalar_t>
  static void encode(const at::Tensor& in, const at::Tensor& ids, const at::Tensor& out, const DevicePositions& pos,
                     const at::Tensor& inv_freq, SinusoidalLayout layout, double scale) {
    const auto freq = inv_freq.to(at::kDouble).contiguous();
    const SinusoidalEncoding<opmath_t<scalar_t>> encoding{
        pos.values.defined() ? pos.values.const_data_ptr<double>() : nullptr, pos.offset,
        freq.const_data_ptr<double>(), freq.numel(), layout};
    launch_additive(additive_rows<scalar_t>(in, ids, out, pos.count, 2 * freq.numel()), scale, encoding, true);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  SinusoidalOps<CudaSinusoidal>::register_kernels(m);
}

}  // namespace posenc::cuda
