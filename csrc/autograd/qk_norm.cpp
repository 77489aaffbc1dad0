// Autograd of the QK-norm + RoPE family. The forward saves q, k and the weights (the norm is recomputed in the
// backward, which costs less than storing it); qk_norm_rope_backward returns the gradients of all four. The backward
// is not itself differentiated: a second derivative of the norm is refused with an error, never silently zero.
#include <posenc/qk_norm.h>

#include "autograd/angles.h"
#include "autograd/kernels.h"
#include "families.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

namespace posenc {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_inv_freq_constant(const char* op, const at::Tensor& inv_freq) {
  TORCH_CHECK(!inv_freq.requires_grad(), "posenc.", op, ": inv_freq is not differentiable here; learned frequencies "
              "train through rope or rope_qk (detach it)");
}

// Everything but q and k, as saved for the backward.
struct NormRope {
  at::Tensor q_weight;
  at::Tensor k_weight;
  double eps;
  std::string norm;
  Angles angles;

  // q and k: the forward's inputs (copies of them in place).
  void save(const char* op, AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k) const {
    check_inv_freq_constant(op, angles.inv_freq);
    std::vector<at::Tensor> saved{q, k, q_weight, k_weight};
    angles.save(ctx, saved);
    ctx->save_for_backward(saved);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["norm"] = norm;
  }

  // The gradients of q, k, q_weight and k_weight, then none for the other ten arguments.
  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    const auto s = ctx->get_saved_variables();
    const auto grad_q = grads[0].defined() ? grads[0] : at::zeros_like(s[0]);
    const auto grad_k = grads[1].defined() ? grads[1] : at::zeros_like(s[1]);
    const auto a = Angles::load(ctx, s, 4);  // saved after q, k and the weights
    const auto [gq, gk, gqw, gkw] = qk_norm_rope_backward(
        grad_q, grad_k, s[0], s[1], s[2], s[3], a.positions, a.inv_freq, ctx->saved_data["eps"].toDouble(),
        ctx->saved_data["norm"].toStringRef(), a.attention_scale, a.layout, a.format, a.offset, a.cu_seqlens,
        a.pair_axis, a.q_scale_beta, a.q_scale_length, a.q_scale_shift);
    variable_list out(17);  // q, k and the weights, then the thirteen arguments without a gradient
    out[0] = gq;
    out[1] = gk;
    out[2] = gqw;
    out[3] = gkw;
    return out;
  }
};

// qk_norm_rope (kInPlace = false) and qk_norm_rope_, whose inputs are copied before they are overwritten (the backward
// needs them), and marked dirty, which rebases q's and k's history onto this node.
template <bool kInPlace>
struct QkNormRope : public torch::autograd::Function<QkNormRope<kInPlace>> {
  static constexpr const char* kOp = "posenc::qk_norm_rope";

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& q_weight, const at::Tensor& k_weight,
                               const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double eps,
                               c10::string_view norm, double attention_scale, c10::string_view layout,
                               c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                               const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
                               int64_t q_scale_length, int64_t q_scale_shift) {
    const NormRope args{q_weight, k_weight, eps, std::string(norm),
                        {positions, inv_freq, attention_scale, std::string(layout), std::string(format), offset,
                         cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift}};
    at::AutoDispatchBelowADInplaceOrView guard;
    if constexpr (kInPlace) {
      args.save("qk_norm_rope_", ctx, q.clone(), k.clone());
      ctx->mark_dirty({q, k});
      qk_norm_rope_(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale, layout, format, offset,
                    cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
      return {q, k};
    } else {
      args.save("qk_norm_rope", ctx, q, k);
      const auto [q_out, k_out] =
          qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale, layout, format,
                       offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
      return {q_out, k_out};
    }
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) { return NormRope::backward(ctx, grads); }
};
constexpr auto qk_norm_rope_autograd = POSENC_AUTOGRAD(QkNormRope<false>);

void qk_norm_rope__autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                            const at::Tensor& k_weight, const std::optional<at::Tensor>& positions,
                            const at::Tensor& inv_freq, double eps, c10::string_view norm, double attention_scale,
                            c10::string_view layout, c10::string_view format, int64_t offset,
                            const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis,
                            double q_scale_beta, int64_t q_scale_length, int64_t q_scale_shift) {
  if (!torch::autograd::compute_requires_grad(q, k, q_weight, k_weight, inv_freq)) {
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      qk_norm_rope_(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale, layout, format, offset,
                    cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
    }
    torch::autograd::impl::bump_version(q);  // a tensor saved for another backward is now stale
    torch::autograd::impl::bump_version(k);
    return;
  }
  QkNormRope<true>::apply(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale, layout, format,
                           offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_backward_autograd(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& q_weight, const at::Tensor& k_weight, const std::optional<at::Tensor>& positions,
    const at::Tensor& inv_freq, double eps, c10::string_view norm, double attention_scale, c10::string_view layout,
    c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& pair_axis, double q_scale_beta, int64_t q_scale_length, int64_t q_scale_shift) {
  if (at::GradMode::is_enabled()) {
    check_inv_freq_constant("qk_norm_rope_backward", inv_freq);
    TORCH_CHECK(!torch::autograd::compute_requires_grad(grad_q, grad_k, q, k, q_weight, k_weight),
                "posenc.qk_norm_rope_backward: a second derivative of qk_norm_rope is not supported (its backward is "
                "not differentiable); differentiate once, or without create_graph=True");
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return qk_norm_rope_backward(grad_q, grad_k, q, k, q_weight, k_weight, positions, inv_freq, eps, norm,
                               attention_scale, layout, format, offset, cu_seqlens, pair_axis, q_scale_beta,
                               q_scale_length, q_scale_shift);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) { POSENC_QK_NORM_OPS(POSENC_IMPL_SUFFIXED, _autograd) }

}  // namespace posenc
