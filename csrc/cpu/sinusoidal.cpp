// The sinusoidal family on the CPU: how positions are read and the kernel called under the op layer of
// common/sinusoidal.h; the loops are in cpu/kernels/additive.cpp.
#include "common/positions.h"
#include "common/sinusoidal.h"
#include "cpu/device.h"
#include "cpu/kernels/additive.h"

#include <torch/library.h>

#include <vector>

namespace posenc {
namespace {

struct CpuSinusoidal : CpuDevice {

  static HostPositions<double> read_positions(const char* op, const std::optional<at::Tensor>& positions,
                                              int64_t count, int64_t offset) {
    return read_host_positions<double>(op, positions, count, offset, angle_domain());
  }

  static constexpr auto check_indices = &check_indices_in_range;

  // out = in * scale + PE(positions): the encodings of `pos` ([P], shared by rows / P leading indices) added
  // to out's rows.
  template <typename scalar_t>
  static void encode(const at::Tensor& in, const at::Tensor& ids, const at::Tensor& out,
                     const HostPositions<double>& pos, const at::Tensor& inv_freq, SinusoidalLayout layout,
                     double scale) {
    const Frequencies freq(inv_freq);
    const int64_t width = out.size(-1);
    const RowInput<scalar_t> rows{in.defined() ? in.const_data_ptr<scalar_t>() : nullptr,
                                  ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr};
    cpu::sinusoidal_stub<scalar_t>({rows, out.mutable_data_ptr<scalar_t>(), out.numel() / width, width, pos.data(),
                                    pos.first, pos.count, freq.data(), freq.size(), freq.max_abs(), layout, scale});
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  SinusoidalOps<CpuSinusoidal>::register_kernels(m);
}

}  // namespace posenc
