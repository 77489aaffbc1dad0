#pragma once
// The QK-norm + RoPE family (qk_norm_rope, its backward and in-place form): checks shared by the CPU, CUDA and Meta
// kernels (metadata only, SymInt-aware), and its op layer, one template over the device. The rotation is the rotary
// family's (common/rope.h): positions, offsets, cu_seqlens and pair_axis mean the same and are read the same way.
#include "common/rope.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace posenc {

inline QkNorm parse_qk_norm(const char* op, std::string_view norm) {
  if (norm == "llama") return QkNorm::Llama;
  if (norm == "gemma") return QkNorm::Gemma;
  if (norm == "olmo2") return QkNorm::Olmo2;
  if (norm == "fused") return QkNorm::Fused;
  TORCH_CHECK(false, "posenc.", op, ": norm must be \"llama\", \"gemma\", \"olmo2\" or \"fused\", got \"", norm, "\"");
}

// A norm weight of x: [head_dim] normalizes each head, [heads * head_dim] all heads of a token together (OLMo 2).
// Returns the channels normalized together.
inline c10::SymInt check_norm_weight(const char* op, const char* arg, const at::Tensor& weight, const at::Tensor& x,
                                     RopeFormat format) {
  check_floating(op, arg, weight);
  check_same_device(op, arg, weight, x);
  const auto sizes = rope_sizes(x, format);
  const auto& head_dim = sizes[3];
  const auto all_heads = sizes[2] * head_dim;
  TORCH_CHECK(weight.dim() == 1 && (weight.sym_size(0) == head_dim || weight.sym_size(0) == all_heads), "posenc.",
              op, ": ", arg, " has shape ", weight.sym_sizes(), " but needs [", head_dim, "] (each head) or [",
              all_heads, "] (all heads of a token) for an input of shape ", x.sym_sizes());
  return weight.sym_size(0);
}

struct QkNormArgs {
  RopeArgs rope;
  QkNorm convention;
  QScale q_scale;
};

// Every check of qk_norm_rope (inputs = {q, k}) and its backward (inputs = {grad_q, grad_k, q, k}), the query scale's
// included.
inline QkNormArgs check_qk_norm_rope(const char* op,
                                     std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs,
                                     const at::Tensor& q_weight, const at::Tensor& k_weight,
                                     const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                     double eps, std::string_view norm, std::string_view layout,
                                     std::string_view format, const std::optional<at::Tensor>& cu_seqlens,
                                     const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
                                     int64_t q_scale_length, int64_t q_scale_shift) {
  const auto convention = parse_qk_norm(op, norm);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "posenc.", op, ": eps must be finite and >= 0, got ", eps);
  const auto [args, q_scale] = check_rope_qk(op, inputs, positions, inv_freq, layout, format, cu_seqlens, pair_axis,
                                              q_scale_beta, q_scale_length, q_scale_shift);
  const auto* q = (inputs.end() - 2)->second;
  const auto* k = (inputs.end() - 1)->second;
  if (inputs.size() == 4) {  // the gradients have the shapes of q and k
    for (int i = 0; i < 2; ++i) {
      const auto& [name, grad] = inputs.begin()[i];
      const auto& [input_name, input] = inputs.begin()[i + 2];
      TORCH_CHECK(grad->sym_sizes().equals(input->sym_sizes()), "posenc.", op, ": ", name, " has shape ",
                  grad->sym_sizes(), " but ", input_name, " has shape ", input->sym_sizes());
    }
  }
  check_norm_weight(op, "q_weight", q_weight, *q, args.format);
  check_norm_weight(op, "k_weight", k_weight, *k, args.format);
  return {args, convention, q_scale};
}

// The ops of the QK-norm + RoPE family on one device, over the rotary family's device (RopeOps' Device: Guard,
// empty and rotate, whose Rotation carries the norms).
template <typename Device>
struct QkNormOps {
  // The norm of x as the kernels take it: the weight in maths precision (1 + w for gemma, added there as Gemma adds
  // it), and in the backward the forward's input and a zeroed weight gradient.
  static RotationNorm norm_of(const at::Tensor& weight, const at::Tensor& x, double eps, QkNorm convention,
                              const at::Tensor& input = at::Tensor()) {
    const auto opmath = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const auto w = Device::converted(weight, opmath, convention == QkNorm::Gemma ? 1.0 : 0.0);
    const auto grad = input.defined() ? Device::zeros(weight.size(0), w.options()) : at::Tensor();
    return {w, weight.size(0), eps, convention, input, grad};
  }

  static std::tuple<at::Tensor, at::Tensor> qk_norm_rope(
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
      const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double eps, c10::string_view norm,
      double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
      const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
      int64_t q_scale_length, int64_t q_scale_shift) {
    constexpr const char* op = "qk_norm_rope";
    const auto args = check_qk_norm_rope(op, {{"q", &q}, {"k", &k}}, q_weight, k_weight, positions, inv_freq, eps,
                                         norm, layout, format, cu_seqlens, pair_axis, q_scale_beta,
                                         q_scale_length, q_scale_shift);
    auto q_out = Device::empty(q.sizes(), q.options());
    auto k_out = Device::empty(k.sizes(), k.options());
    const std::vector<RotationNorm> norms{norm_of(q_weight, q, eps, args.convention),
                                          norm_of(k_weight, k, eps, args.convention)};
    RopeOps<Device>::rotate(op, {q, k}, {q_out, k_out}, args.rope, positions, inv_freq, attention_scale, offset,
                            cu_seqlens, pair_axis, false, &norms, args.q_scale);
    return {q_out, k_out};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_backward(
      const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q, const at::Tensor& k,
      const at::Tensor& q_weight, const at::Tensor& k_weight, const std::optional<at::Tensor>& positions,
      const at::Tensor& inv_freq, double eps, c10::string_view norm, double attention_scale, c10::string_view layout,
      c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
      const std::optional<at::Tensor>& pair_axis, double q_scale_beta, int64_t q_scale_length,
      int64_t q_scale_shift) {
    constexpr const char* op = "qk_norm_rope_backward";
    const auto args =
        check_qk_norm_rope(op, {{"grad_q", &grad_q}, {"grad_k", &grad_k}, {"q", &q}, {"k", &k}}, q_weight, k_weight,
                           positions, inv_freq, eps, norm, layout, format, cu_seqlens, pair_axis, q_scale_beta,
                           q_scale_length, q_scale_shift);
    auto grad_q_in = Device::empty(q.sizes(), q.options());
    auto grad_k_in = Device::empty(k.sizes(), k.options());
    const std::vector<RotationNorm> norms{norm_of(q_weight, q, eps, args.convention, q),
                                          norm_of(k_weight, k, eps, args.convention, k)};
    RopeOps<Device>::rotate(op, {grad_q, grad_k}, {grad_q_in, grad_k_in}, args.rope, positions, inv_freq,
                            attention_scale, offset, cu_seqlens, pair_axis, true, &norms, args.q_scale);
    return {grad_q_in, grad_k_in, Device::converted(norms[0].weight_grad, q_weight.scalar_type(), 0),
            Device::converted(norms[1].weight_grad, k_weight.scalar_type(), 0)};
  }

  static void qk_norm_rope_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                            const at::Tensor& k_weight, const std::optional<at::Tensor>& positions,
                            const at::Tensor& inv_freq, double eps, c10::string_view norm, double attention_scale,
                            c10::string_view layout, c10::string_view format, int64_t offset,
                            const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis,
                            double q_scale_beta, int64_t q_scale_length, int64_t q_scale_shift) {
    constexpr const char* op = "qk_norm_rope_";
    const auto args = check_qk_norm_rope(op, {{"q", &q}, {"k", &k}}, q_weight, k_weight, positions, inv_freq, eps,
                                         norm, layout, format, cu_seqlens, pair_axis, q_scale_beta,
                                         q_scale_length, q_scale_shift);
    check_no_internal_overlap(op, "q", q, "normalize and rotate copies with posenc.qk_norm_rope");
    check_no_internal_overlap(op, "k", k, "normalize and rotate copies with posenc.qk_norm_rope");
    // Each token's q rows are stored before its k rows are read: they must not share an element.
    check_no_shared_elements(op, "q", q, "k", k, rope_dim_order(args.rope.format)[2],
                             "normalize and rotate copies with posenc.qk_norm_rope");
    const std::vector<RotationNorm> norms{norm_of(q_weight, q, eps, args.convention),
                                          norm_of(k_weight, k, eps, args.convention)};
    RopeOps<Device>::rotate(op, {q, k}, {q, k}, args.rope, positions, inv_freq, attention_scale, offset, cu_seqlens,
                            pair_axis, false, &norms, args.q_scale);
  }

  static void register_kernels(torch::Library& m) { POSENC_QK_NORM_OPS(POSENC_IMPL_MEMBER, QkNormOps) }
};

}  // namespace posenc
