// Autograd of ALiBi: torch::autograd::Functions at the Autograd key that call the forward ops below
// autograd and alibi_backward through the dispatcher. The bias is linear in the slopes, so alibi_backward
// is linear in its gradient and its own derivative is a bias again: double backward works. A call with
// nothing to record goes straight below autograd, as PyTorch's VariableType kernels do.
#include <posenc/alibi.h>

#include "autograd/kernels.h"
#include "families.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

namespace posenc {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void save_alibi_config(AutogradContext* ctx, c10::string_view mode, int64_t head_offset) {
  ctx->saved_data["mode"] = std::string(mode);
  ctx->saved_data["head_offset"] = head_offset;
}

// The slopes are saved for their shape and dtype only (a few numbers); the bias itself is never kept.
at::Tensor slopes_gradient(AutogradContext* ctx, const at::Tensor& grad) {
  const auto slopes = ctx->get_saved_variables()[0];
  return alibi_backward(grad, slopes, ctx->saved_data["mode"].toStringRef(), ctx->saved_data["head_offset"].toInt());
}

struct AlibiBias : public torch::autograd::Function<AlibiBias> {
  static constexpr const char* kOp = "posenc::alibi_bias";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& slopes, c10::SymInt q_len, c10::SymInt k_len,
                            c10::string_view mode, int64_t head_offset, std::optional<c10::SymInt> num_heads,
                            std::optional<at::ScalarType> dtype) {
    ctx->save_for_backward({slopes});
    save_alibi_config(ctx, mode, head_offset);
    at::AutoDispatchBelowADInplaceOrView guard;
    return alibi_bias_symint(slopes, std::move(q_len), std::move(k_len), mode, head_offset, std::move(num_heads),
                             dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return {slopes_gradient(ctx, grad_outputs[0]), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};
constexpr auto alibi_bias_autograd = POSENC_AUTOGRAD(AlibiBias);

// d/d scores is the identity; d/d slopes is computed only when the slopes are trained.
struct AddAlibi : public torch::autograd::Function<AddAlibi> {
  static constexpr const char* kOp = "posenc::add_alibi";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& scores, const at::Tensor& slopes,
                            c10::string_view mode, int64_t head_offset) {
    ctx->save_for_backward({slopes});
    save_alibi_config(ctx, mode, head_offset);
    at::AutoDispatchBelowADInplaceOrView guard;
    return add_alibi(scores, slopes, mode, head_offset);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto& grad = grad_outputs[0];
    return {grad, ctx->needs_input_grad(1) ? slopes_gradient(ctx, grad) : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto add_alibi_autograd = POSENC_AUTOGRAD(AddAlibi);

// alibi_backward(grad) = sum over (i, j) of grad * (-d): its derivative along grad, applied to a slope
// gradient gg, is alibi_bias(gg) broadcast to grad's shape. It does not depend on the slopes' values.
struct AlibiBackward : public torch::autograd::Function<AlibiBackward> {
  static constexpr const char* kOp = "posenc::alibi_backward";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& slopes,
                            c10::string_view mode, int64_t head_offset) {
    save_alibi_config(ctx, mode, head_offset);
    ctx->saved_data["grad_sizes"] = grad.sym_sizes().vec();
    ctx->saved_data["grad_dtype"] = grad.scalar_type();
    at::AutoDispatchBelowADInplaceOrView guard;
    return alibi_backward(grad, slopes, mode, head_offset);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto sizes = ctx->saved_data["grad_sizes"].toSymIntVector();
    const auto bias = alibi_bias_symint(grad_outputs[0], sizes[2], sizes[3], ctx->saved_data["mode"].toStringRef(),
                                        ctx->saved_data["head_offset"].toInt(), sizes[1],
                                        ctx->saved_data["grad_dtype"].toScalarType());
    return {bias.expand_symint(sizes), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto alibi_backward_autograd = POSENC_AUTOGRAD(AlibiBackward);

// The in-place op is for inference: it refuses to run where autograd would need to see it, and bumps the
// version counter so that a tensor saved for some other backward is detected as modified.
void add_alibi__autograd(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode,
                         int64_t head_offset) {
  TORCH_CHECK(!(at::GradMode::is_enabled() && (scores.requires_grad() || slopes.requires_grad())),
              "posenc.add_alibi_: the in-place op records no autograd, but scores or slopes require grad; "
              "use add_alibi");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    add_alibi_(scores, slopes, mode, head_offset);
  }
  torch::autograd::impl::bump_version(scores);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) { POSENC_ALIBI_OPS(POSENC_IMPL_SUFFIXED, _autograd) }

}  // namespace posenc
