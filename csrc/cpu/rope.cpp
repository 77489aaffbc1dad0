// CPU ops of the rotary family: checks, positions, allocation, dtype dispatch; the loops are in
// cpu/kernels/rope.cpp.
#include "common/positions.h"
#include "common/rope.h"
#include "cpu/kernels/rope.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace posenc {
namespace {

// Multi-axis positions as read, axis by axis ([n_axes, tokens]), reordered token by token ([tokens, n_axes]), so
// that the angle engine finds a token's positions side by side.
std::vector<double> tokens_major(const std::vector<double>& positions, int64_t n_axes) {
  const int64_t tokens = static_cast<int64_t>(positions.size()) / n_axes;
  std::vector<double> out(positions.size());
  for (int64_t a = 0; a < n_axes; ++a) {
    for (int64_t n = 0; n < tokens; ++n) out[n * n_axes + a] = positions[a * tokens + n];
  }
  return out;
}

// Rotates inputs[v] into outputs[v] (the same tensor in place) by the angles of the positions: the shared body
// of rope, rope_backward, rope_ and the qk variants.
void rotate(const char* op, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
            const RopeArgs& args, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
            double attention_scale, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
            const std::optional<at::Tensor>& pair_axis, bool inverse) {
  const auto order = rope_dim_order(args.format);
  const int64_t batch = order[0] < 0 ? 1 : inputs[0].size(order[0]);
  const int64_t seq = inputs[0].size(order[1]);
  check_cu_seqlens_values(op, cu_seqlens, seq);
  const int64_t n_axes = pair_axis ? positions->size(0) : 1;
  const auto axes = pair_axis ? read_pair_axis(op, *pair_axis, n_axes) : std::vector<int32_t>();
  auto pos = read_positions<double>(op, positions, seq, offset, angle_domain(), cu_seqlens);
  if (n_axes > 1) pos = tokens_major(pos, n_axes);
  bool empty = true;
  for (const auto& t : inputs) empty = empty && t.numel() == 0;
  if (empty) return;
  const Frequencies freq(inv_freq);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, inputs[0].scalar_type(), "posenc_rope", [&] {
    std::vector<RotaryView<scalar_t>> views;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].numel() > 0) views.push_back(rotary_view<scalar_t>(inputs[i], outputs[i], args.format));
    }
    cpu::rope_stub<scalar_t>({views.data(), static_cast<int64_t>(views.size()), batch, seq, pos.data(),
                              args.shared_positions, n_axes, pair_axis ? axes.data() : nullptr, freq.data(),
                              freq.size(), freq.max_abs(), attention_scale, inverse, args.layout});
  });
}

at::Tensor rope_cos_sin_cpu_impl(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 c10::string_view layout, c10::string_view format, bool transpose) {
  const auto args = check_rope_cos_sin(op, transpose ? "grad" : "x", x, cos, sin, layout, format);
  auto out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const auto order = rope_dim_order(args.format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "posenc_rope_cos_sin", [&] {
    using opmath = opmath_t<scalar_t>;
    const auto cos_table = cos.to(c10::CppTypeToScalarType<opmath>::value).contiguous();
    const auto sin_table = sin.to(c10::CppTypeToScalarType<opmath>::value).contiguous();
    cpu::rope_tables_stub<scalar_t, opmath>({rotary_view<scalar_t>(x, out, args.format),
                                             order[0] < 0 ? 1 : x.size(order[0]), x.size(order[1]),
                                             cos_table.const_data_ptr<opmath>(), sin_table.const_data_ptr<opmath>(),
                                             args.shared_positions, cos.size(-1), args.layout, transpose});
  });
  return out;
}

at::Tensor rope_cos_sin_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, c10::string_view layout,
                            c10::string_view format) {
  return rope_cos_sin_cpu_impl("rope_cos_sin", x, cos, sin, layout, format, false);
}

at::Tensor rope_cos_sin_backward_cpu(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                                     c10::string_view layout, c10::string_view format) {
  return rope_cos_sin_cpu_impl("rope_cos_sin_backward", grad, cos, sin, layout, format, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope", TORCH_FN(RopeKernels<rotate>::rope));
  m.impl("rope_backward", TORCH_FN(RopeKernels<rotate>::rope_backward));
  m.impl("rope_qk", TORCH_FN(RopeKernels<rotate>::rope_qk));
  m.impl("rope_qk_backward", TORCH_FN(RopeKernels<rotate>::rope_qk_backward));
  m.impl("rope_", TORCH_FN(RopeKernels<rotate>::rope_));
  m.impl("rope_cos_sin", TORCH_FN(rope_cos_sin_cpu));
  m.impl("rope_cos_sin_backward", TORCH_FN(rope_cos_sin_backward_cpu));
}

}  // namespace posenc
