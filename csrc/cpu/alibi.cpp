// ALiBi on the CPU: the kernels called under the op layer of common/alibi.h; the loops are in
// cpu/kernels/alibi.cpp.
#include "common/alibi.h"
#include "cpu/device.h"
#include "cpu/kernels/alibi.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <vector>

namespace posenc {
namespace {

// The slopes a call uses, [B or 1][num_heads] in maths precision, head_offset applied: read in their own dtype, as
// float64 widens them, where an ATen conversion to float64 cost a small call more than the rest of the op layer.
template <typename opmath>
std::vector<opmath> local_slopes(const at::Tensor& slopes, int64_t head_offset, int64_t num_heads) {
  const int64_t batch = slopes.dim() == 2 ? slopes.size(0) : 1;
  const int64_t row_stride = slopes.dim() == 2 ? slopes.stride(0) : 0;
  const int64_t stride = slopes.stride(-1);
  std::vector<opmath> out(batch * num_heads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, slopes.scalar_type(), "posenc_alibi_slopes", [&] {
    const scalar_t* m = slopes.const_data_ptr<scalar_t>();
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const double slope = static_cast<double>(m[b * row_stride + (head_offset + h) * stride]);
        out[b * num_heads + h] = static_cast<opmath>(slope);
      }
    }
  });
  return out;
}

struct CpuAlibi : CpuDevice {

  template <typename scalar_t>
  static void add_bias(const at::Tensor& in, const at::Tensor& out, const at::Tensor& slopes, AlibiMode mode,
                       int64_t head_offset) {
    const auto m = local_slopes<opmath_t<scalar_t>>(slopes, head_offset, out.size(1));
    cpu::alibi_stub<scalar_t>({in.defined() ? in.const_data_ptr<scalar_t>() : nullptr,
                               in.defined() ? alibi_rows(in) : alibi_rows(out), out.mutable_data_ptr<scalar_t>(),
                               alibi_rows(out), out.numel() / out.size(3), m.data(), slopes.dim() == 2, mode});
  }

  template <typename scalar_t>
  static void slope_grad(const at::Tensor& grad, AlibiMode mode, const at::Tensor& slopes, int64_t head_offset,
                         const at::Tensor& acc) {
    cpu::alibi_backward_stub<scalar_t>({grad.const_data_ptr<scalar_t>(), alibi_rows(grad),
                                        grad.numel() / grad.size(3), mode, slopes.dim() == 2, slopes.size(-1),
                                        head_offset, acc.mutable_data_ptr<double>()});
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  AlibiOps<CpuAlibi>::register_kernels(m);
}

}  // namespace posenc
