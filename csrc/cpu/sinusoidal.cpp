// The sinusoidal family on the CPU: how positions are read and the kernel called under the op layer of
// common/sinusoidal.h; the loops are in cpu/kernels/additive.cpp.
#include "common/positions.h"
#include "common/sinusoidal.h"
#include "cpu/device.h"
#include "cpu/encoding_tables.h"
#include "cpu/kernels/additive.h"

#include <torch/library.h>

namespace posenc {
namespace {

struct CpuSinusoidal : CpuDevice {

  static AxisPositions read_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                      int64_t offset, const std::optional<at::Tensor>& pair_axis) {
    return read_axis_positions(op, positions, count, offset, angle_domain(), pair_axis);
  }

  static constexpr auto check_indices = &check_indices_in_range;

  // out = in * scale + PE(positions) over the rows of `rows`.
  template <typename scalar_t>
  static void encode(const at::Tensor& in, const at::Tensor& ids, const at::Tensor& out, const AxisPositions& pos,
                     const at::Tensor& inv_freq, SinusoidalLayout layout, double scale, const EncodedRows& rows) {
    const Frequencies freq(inv_freq);
    const int64_t width = out.size(-1);
    const RowInput<scalar_t> input{in.defined() ? in.const_data_ptr<scalar_t>() : nullptr,
                                   ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr};
    using opmath = opmath_t<scalar_t>;
    const at::Tensor table = cpu::kept_encodings(c10::CppTypeToScalarType<opmath>::value, layout, freq, pos);
    cpu::sinusoidal_stub<scalar_t>({input, out.mutable_data_ptr<scalar_t>(), out.numel() / width, width,
                                    pos.values.data(), pos.values.first, rows.num_positions, rows.sequence,
                                    pos.n_axes, pos.axes(), freq.data(), freq.size(), freq.max_abs(), layout, scale,
                                    table.defined() ? table.const_data_ptr<opmath>() : nullptr});
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  SinusoidalOps<CpuSinusoidal>::register_kernels(m);
}

}  // namespace posenc
