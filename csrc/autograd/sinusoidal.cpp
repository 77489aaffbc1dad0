// Autograd of the sinusoidal family: torch::autograd::Functions at the Autograd key that call the
// forward ops below autograd and the backward ops through the dispatcher. As in PyTorch's generated
// VariableType kernels, a call with nothing to record (grad mode off, or no input requiring grad) goes
// straight below autograd: building a node and its saved values would be half the cost of a small call.
#include <posenc/embedding.h>
#include <posenc/sinusoidal.h>

#include "autograd/kernels.h"
#include "families.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace posenc {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_not_differentiable(const char* op, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq) {
  TORCH_CHECK(!(positions && positions->requires_grad()) && !inv_freq.requires_grad(), "posenc.", op,
              ": positions and inv_freq are not differentiable; detach them (they require grad here)");
}

// Positions and frequencies are constants of the encoding: the table has no parameters to train.
at::Tensor sinusoidal_autograd(const at::Tensor& positions, const at::Tensor& inv_freq, c10::string_view layout,
                               std::optional<at::ScalarType> dtype, int64_t offset,
                               const std::optional<at::Tensor>& pair_axis) {
  check_not_differentiable("sinusoidal", positions, inv_freq);
  at::AutoDispatchBelowADInplaceOrView guard;
  return sinusoidal(positions, inv_freq, layout, dtype, offset, pair_axis);
}

// d(x * x_scale + PE)/dx = x_scale: the scale is saved, and inv_freq where the backward calls this op (x_scale != 1).
struct AddSinusoidal : public torch::autograd::Function<AddSinusoidal> {
  static constexpr const char* kOp = "posenc::add_sinusoidal";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& positions,
                            const at::Tensor& inv_freq, double x_scale, c10::string_view layout, int64_t offset,
                            const std::optional<at::Tensor>& pair_axis, int64_t num_prefix_tokens) {
    check_not_differentiable("add_sinusoidal", positions, inv_freq);
    if (x_scale != 1.0) ctx->save_for_backward({inv_freq});
    ctx->saved_data["x_scale"] = x_scale;
    at::AutoDispatchBelowADInplaceOrView guard;
    return add_sinusoidal(x, positions, inv_freq, x_scale, layout, offset, pair_axis, num_prefix_tokens);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const double x_scale = ctx->saved_data["x_scale"].toDouble();
    const auto& grad = grad_outputs[0];
    // x_scale = 1 (an encoding added to x as it is): the gradient passes through, no copy. Otherwise grad * x_scale,
    // by this op with every token a prefix token (none encoded): the bits of ATen's mul (x_scale rounded to the
    // compute type, each product rounded once) in 0.77-0.87x its time on [8, 2048, 1024] (AVX2 build). A strided grad
    // (an expanded sum's) or a symbolic S (num_prefix_tokens is an int) goes to mul.
    const auto seq = grad.sym_size(-2).maybe_as_int();
    const auto grad_x = x_scale == 1.0                     ? grad
                        : seq.has_value() && grad.is_contiguous()
                            ? add_sinusoidal(grad, std::nullopt, ctx->get_saved_variables()[0], x_scale, "interleaved",
                                             0, std::nullopt, *seq)
                            : grad.mul(x_scale);
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto add_sinusoidal_autograd = POSENC_AUTOGRAD(AddSinusoidal);

// d/d token_weight: the rows of grad scattered back to their tokens, times token_scale.
struct EmbedSinusoidal : public torch::autograd::Function<EmbedSinusoidal> {
  static constexpr const char* kOp = "posenc::embed_sinusoidal";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& token_weight,
                            const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double token_scale,
                            std::optional<int64_t> padding_idx, c10::string_view layout, int64_t offset) {
    check_not_differentiable("embed_sinusoidal", positions, inv_freq);
    ctx->save_for_backward({tokens});
    ctx->saved_data["vocab"] = token_weight.sym_size(0);
    ctx->saved_data["token_scale"] = token_scale;
    ctx->saved_data["padding_idx"] = padding_idx;
    at::AutoDispatchBelowADInplaceOrView guard;
    return embed_sinusoidal(tokens, token_weight, positions, inv_freq, token_scale, padding_idx, layout, offset);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto tokens = ctx->get_saved_variables()[0];
    const auto grad_weight = embedding_backward_symint(grad_outputs[0], tokens, ctx->saved_data["vocab"].toSymInt(),
                                                       ctx->saved_data["token_scale"].toDouble(),
                                                       ctx->saved_data["padding_idx"].toOptional<int64_t>());
    return {at::Tensor(), grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto embed_sinusoidal_autograd = POSENC_AUTOGRAD(EmbedSinusoidal);

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) { POSENC_SINUSOIDAL_OPS(POSENC_IMPL_SUFFIXED, _autograd) }

}  // namespace posenc
