// Autograd of the rotary family. A rotation is linear in x, so its gradient is the transposed map:
// rope <-> rope_backward (rotation by -angle), rope_cos_sin <-> rope_cos_sin_backward. Each op's backward
// is its partner op, so double backward works. Only positions, frequencies, pair_axis (or the cos/sin tables)
// and scalars are saved, never x. A call with nothing to record (grad mode off, or nothing requiring grad) goes
// straight below autograd, as PyTorch's VariableType kernels do.
#include <posenc/rope.h>

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

void check_constant(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(!t.requires_grad(), "posenc.", op, ": ", arg,
              " is not differentiable (only the rotated tensors are); detach it");
}

std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Everything a rotation by angles needs besides the rotated tensors.
struct Angles {
  std::optional<at::Tensor> positions;
  at::Tensor inv_freq;
  double attention_scale;
  std::string layout;
  std::string format;
  int64_t offset;
  std::optional<at::Tensor> cu_seqlens;
  std::optional<at::Tensor> pair_axis;
  double q_scale_beta = 0.0;  // rope_qk's query scale
  int64_t q_scale_length = 1;
  int64_t q_scale_shift = 0;

  void save(AutogradContext* ctx) const {
    ctx->save_for_backward({positions.value_or(at::Tensor()), inv_freq, cu_seqlens.value_or(at::Tensor()),
                            pair_axis.value_or(at::Tensor())});
    ctx->saved_data["attention_scale"] = attention_scale;
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["format"] = format;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["q_scale_beta"] = q_scale_beta;
    ctx->saved_data["q_scale_length"] = q_scale_length;
    ctx->saved_data["q_scale_shift"] = q_scale_shift;
  }

  static Angles load(AutogradContext* ctx) {
    const auto saved = ctx->get_saved_variables();
    return {optional_of(saved[0]),
            saved[1],
            ctx->saved_data["attention_scale"].toDouble(),
            ctx->saved_data["layout"].toStringRef(),
            ctx->saved_data["format"].toStringRef(),
            ctx->saved_data["offset"].toInt(),
            optional_of(saved[2]),
            optional_of(saved[3]),
            ctx->saved_data["q_scale_beta"].toDouble(),
            ctx->saved_data["q_scale_length"].toInt(),
            ctx->saved_data["q_scale_shift"].toInt()};
  }

  at::Tensor rotate(const at::Tensor& x, bool inverse) const {
    return inverse
               ? rope_backward(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis)
               : rope(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
  }
};

// rope (kInverse = false) and rope_backward (kInverse = true).
template <bool kInverse>
struct Rope : public torch::autograd::Function<Rope<kInverse>> {
  static constexpr const char* kOp = kInverse ? "posenc::rope_backward" : "posenc::rope";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& positions,
                            const at::Tensor& inv_freq, double attention_scale, c10::string_view layout,
                            c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                            const std::optional<at::Tensor>& pair_axis) {
    check_constant(kInverse ? "rope_backward" : "rope", "inv_freq", inv_freq);
    const Angles angles{positions, inv_freq, attention_scale, std::string(layout), std::string(format), offset,
                        cu_seqlens, pair_axis};
    angles.save(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;
    return angles.rotate(x, kInverse);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto grad_x = Angles::load(ctx).rotate(grads[0], !kInverse);
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
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
    check_constant(kInverse ? "rope_qk_backward" : "rope_qk", "inv_freq", inv_freq);
    const Angles angles{positions,  inv_freq,     attention_scale, std::string(layout), std::string(format),
                        offset,     cu_seqlens,   pair_axis,       q_scale_beta,        q_scale_length,
                        q_scale_shift};
    angles.save(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto [q_out, k_out] = rotate(angles, q, k, kInverse);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto [grad_q, grad_k] = rotate(Angles::load(ctx), grads[0], grads[1], !kInverse);
    variable_list out(13);  // q, k, then the eleven arguments without a gradient
    out[0] = grad_q;
    out[1] = grad_k;
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
    check_constant("rope_", "inv_freq", inv_freq);
    const Angles angles{positions, inv_freq, attention_scale, std::string(layout), std::string(format), offset,
                        cu_seqlens, pair_axis};
    angles.save(ctx);
    ctx->mark_dirty({x});
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      rope_(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
    }
    return x;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto grad_x = Angles::load(ctx).rotate(grads[0], true);
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
