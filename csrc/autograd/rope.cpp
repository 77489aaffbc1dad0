// Autograd of the rotary family. A rotation is linear in x, so its gradient is the transposed map:
// rope <-> rope_backward (rotation by -angle), rope_cos_sin <-> rope_cos_sin_backward. Each op's backward
// is its partner op, so double backward works. Only positions, frequencies, pair_axis (or the cos/sin tables)
// and scalars are saved, never x; with learned frequencies (inv_freq requiring grad: rope, rope_qk and their
// backward ops), the outputs too. A call with nothing to record (grad mode off, or nothing requiring grad) goes
// straight below autograd, as PyTorch's VariableType kernels do.
#include <posenc/rope.h>

#include "autograd/angles.h"
#include "autograd/kernels.h"
#include "common/rope.h"
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

void check_constant(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(!t.requires_grad(), "posenc.", op, ": ", arg,
              " is not differentiable (only the rotated tensors are); detach it");
}

// The rotation's outputs, saved after the angles' tensors where inv_freq requires grad (saved as outputs: no
// reference cycle), and read back from ctx->get_saved_variables().
void save_rotation(AutogradContext* ctx, const Angles& angles, const std::vector<at::Tensor>& outputs = {}) {
  std::vector<at::Tensor> saved;
  angles.save(ctx, saved);
  if (angles.inv_freq.requires_grad()) saved.insert(saved.end(), outputs.begin(), outputs.end());
  ctx->save_for_backward(saved);
}

std::vector<at::Tensor> saved_outputs(const variable_list& saved) {
  return {saved.begin() + Angles::kTensors, saved.end()};
}

// The gradient of a rotation with respect to inv_freq (learned frequencies), from its output `out` and that output's
// gradient `grad`, both in the rotation's format. Pair i of token t turns by angle p_t * w_i (p_t the position of
// the pair's axis), and d out / d angle = (-out2, out1) for a forward rotation, the opposite for an inverse one, so
// d loss / d w_i = sum over tokens of p_t * sum over batch rows and heads of (out1 grad2 - out2 grad1) (negated
// for the inverse). Formed in float64 from ATen ops, in a fixed order for a given input, so that it runs on every
// device and is differentiable again (double backward); it is returned in inv_freq's dtype.
at::Tensor inv_freq_grad(const Angles& a, const at::Tensor& out, const at::Tensor& grad, bool inverse) {
  constexpr const char* op = "rope";
  const auto format = parse_rope_format(op, a.format);
  const int64_t pairs = a.inv_freq.size(0);
  // [B, S, H, D] views (thd: one row of T tokens)
  const auto as_bshd = [&](const at::Tensor& t) {
    const auto order = rope_dim_order(format);
    return format == RopeFormat::THD ? t.unsqueeze(0) : t.permute({order[0], order[1], order[2], order[3]});
  };
  const auto halves = [&](const at::Tensor& t) {
    const auto x = as_bshd(t).to(at::kDouble);
    return parse_rope_layout(op, a.layout) == RopeLayout::Neox
               ? std::pair{x.narrow(-1, 0, pairs), x.narrow(-1, pairs, pairs)}
               : std::pair{x.slice(-1, 0, 2 * pairs, 2), x.slice(-1, 1, 2 * pairs, 2)};
  };
  const auto [out1, out2] = halves(out);
  const auto [grad1, grad2] = halves(grad);
  auto per_angle = (out1 * grad2 - out2 * grad1).sum(2);  // [B, S, pairs]
  if (inverse) per_angle = per_angle.neg();
  const int64_t seq = per_angle.size(1);
  const auto f64 = per_angle.options();
  // Each token's position of each pair's axis, [1 or B, S, 1 or pairs], offset included.
  at::Tensor position;
  if (a.pair_axis) {  // [n_axes, S], [n_axes, B, S] or [n_axes, T]
    const auto per_pair = a.positions->to(at::kDouble).index_select(0, a.pair_axis->to(at::kLong));
    position = (per_pair.dim() == 2 ? per_pair.t().unsqueeze(0) : per_pair.permute({1, 2, 0}));
  } else if (a.positions) {  // [S] or [B, S]
    position = (a.positions->dim() == 1 ? a.positions->unsqueeze(0) : *a.positions).to(at::kDouble).unsqueeze(-1);
  } else if (a.cu_seqlens) {  // packed, restarting at each sequence: t - start of its sequence
    const auto bounds = a.cu_seqlens->to(at::kLong);
    const auto tokens = at::arange(seq, bounds.options());
    const auto sequence = at::searchsorted(bounds, tokens, /*out_int32=*/false, /*right=*/true) - 1;
    position = (tokens - bounds.index_select(0, sequence)).to(at::kDouble).view({1, seq, 1});
  } else {
    position = at::arange(seq, f64).view({1, seq, 1});
  }
  position = position + static_cast<double>(a.offset);
  return (per_angle * position).sum(at::IntArrayRef{0, 1}).to(a.inv_freq.scalar_type());
}

// rope (kInverse = false) and rope_backward (kInverse = true).
template <bool kInverse>
struct Rope : public torch::autograd::Function<Rope<kInverse>> {
  static constexpr const char* kOp = kInverse ? "posenc::rope_backward" : "posenc::rope";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& positions,
                            const at::Tensor& inv_freq, double attention_scale, c10::string_view layout,
                            c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                            const std::optional<at::Tensor>& pair_axis) {
    const Angles angles{positions, inv_freq, attention_scale, std::string(layout), std::string(format), offset,
                        cu_seqlens, pair_axis};
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = angles.rotate(x, kInverse);
    }
    save_rotation(ctx, angles, {out});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto angles = Angles::load(ctx, saved);
    const auto grad_x = angles.rotate(grads[0], !kInverse);
    const auto out = saved_outputs(saved);
    const auto grad_w = out.empty() ? at::Tensor() : inv_freq_grad(angles, out[0], grads[0], kInverse);
    return {grad_x, at::Tensor(), grad_w, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto rope_autograd = POSENC_AUTOGRAD(Rope<false>);
constexpr auto rope_backward_autograd = POSENC_AUTOGRAD(Rope<true>);

// rope_qk and rope_qk_backward: one pass over both tensors each way.
template <bool kInverse>
struct RopeQK : public torch::autograd::Function<RopeQK<kInverse>> {
  static constexpr const char* kOp = kInverse ? "posenc::rope_qk_backward" : "posenc::rope_qk";

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                               double attention_scale, c10::string_view layout, c10::string_view format,
                               int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                               const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
                               int64_t q_scale_length, int64_t q_scale_shift) {
    const Angles angles{positions,  inv_freq,     attention_scale, std::string(layout), std::string(format),
                        offset,     cu_seqlens,   pair_axis,       q_scale_beta,        q_scale_length,
                        q_scale_shift};
    at::Tensor q_out, k_out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(q_out, k_out) = rotate(angles, q, k, kInverse);
    }
    save_rotation(ctx, angles, {q_out, k_out});
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto angles = Angles::load(ctx, saved);
    const auto [grad_q, grad_k] = rotate(angles, grads[0], grads[1], !kInverse);
    variable_list out(13);  // q, k, positions, inv_freq, then nine arguments without a gradient
    out[0] = grad_q;
    out[1] = grad_k;
    const auto outputs = saved_outputs(saved);
    if (!outputs.empty()) {
      // q's query scale (a factor of q's output, constant in the angle) is part of q's output already
      out[3] = inv_freq_grad(angles, outputs[0], grads[0], kInverse) +
               inv_freq_grad(angles, outputs[1], grads[1], kInverse);
    }
    return out;
  }

  static std::tuple<at::Tensor, at::Tensor> rotate(const Angles& a, const at::Tensor& q, const at::Tensor& k,
                                                   bool inverse) {
    return inverse ? rope_qk_backward(q, k, a.positions, a.inv_freq, a.attention_scale, a.layout, a.format, a.offset,
                                      a.cu_seqlens, a.pair_axis, a.q_scale_beta, a.q_scale_length, a.q_scale_shift)
                   : rope_qk(q, k, a.positions, a.inv_freq, a.attention_scale, a.layout, a.format, a.offset,
                             a.cu_seqlens, a.pair_axis, a.q_scale_beta, a.q_scale_length, a.q_scale_shift);
  }
};
constexpr auto rope_qk_autograd = POSENC_AUTOGRAD(RopeQK<false>);
constexpr auto rope_qk_backward_autograd = POSENC_AUTOGRAD(RopeQK<true>);

// rope_ rewrites x; marking it dirty rebases x's history onto this node (and bumps its version), so
// in-place rotation of a non-leaf tensor still trains.
struct RopeInplace : public torch::autograd::Function<RopeInplace> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& positions,
                            const at::Tensor& inv_freq, double attention_scale, c10::string_view layout,
                            c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                            const std::optional<at::Tensor>& pair_axis) {
    TORCH_CHECK(!inv_freq.requires_grad(), "posenc.rope_: inv_freq is not differentiable in place; learned "
                "frequencies train through rope or rope_qk (detach it here)");
    const Angles angles{positions, inv_freq, attention_scale, std::string(layout), std::string(format), offset,
                        cu_seqlens, pair_axis};
    save_rotation(ctx, angles);
    ctx->mark_dirty({x});
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      rope_(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
    }
    return x;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto grad_x = Angles::load(ctx, ctx->get_saved_variables()).rotate(grads[0], true);
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// rope_cos_sin (kTranspose = false) and rope_cos_sin_backward (kTranspose = true); the tables are saved.
template <bool kTranspose>
struct RopeCosSin : public torch::autograd::Function<RopeCosSin<kTranspose>> {
  static constexpr const char* kOp = kTranspose ? "posenc::rope_cos_sin_backward" : "posenc::rope_cos_sin";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            c10::string_view layout, c10::string_view format) {
    const char* op = kTranspose ? "rope_cos_sin_backward" : "rope_cos_sin";
    check_constant(op, "cos", cos);
    check_constant(op, "sin", sin);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["layout"] = std::string(layout);
    ctx->saved_data["format"] = std::string(format);
    at::AutoDispatchBelowADInplaceOrView guard;
    return apply_tables(x, cos, sin, layout, format, kTranspose);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto grad_x = apply_tables(grads[0], saved[0], saved[1], ctx->saved_data["layout"].toStringRef(),
                                     ctx->saved_data["format"].toStringRef(), !kTranspose);
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

  static at::Tensor apply_tables(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 std::string_view layout, std::string_view format, bool transpose) {
    return transpose ? rope_cos_sin_backward(x, cos, sin, layout, format) : rope_cos_sin(x, cos, sin, layout, format);
  }
};
constexpr auto rope_cos_sin_autograd = POSENC_AUTOGRAD(RopeCosSin<false>);
constexpr auto rope_cos_sin_backward_autograd = POSENC_AUTOGRAD(RopeCosSin<true>);

void rope__autograd(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                    double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
                    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis) {
  if (!torch::autograd::compute_requires_grad(x, inv_freq)) {
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      rope_(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
    }
    torch::autograd::impl::bump_version(x);  // a tensor saved for another backward is now stale
    return;
  }
  RopeInplace::apply(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
}

// Decoding writes caches that no backward could read again: train with rope_qk.
constexpr char kRopeQkCache[] = "rope_qk_cache_";
constexpr auto rope_qk_cache__autograd = POSENC_INFERENCE_ONLY(rope_qk_cache_, kRopeQkCache);

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) {
  POSENC_ROPE_OPS(POSENC_IMPL_SUFFIXED, _autograd)
  POSENC_KV_CACHE_OPS(POSENC_IMPL_SUFFIXED, _autograd)
}

}  // namespace posenc
