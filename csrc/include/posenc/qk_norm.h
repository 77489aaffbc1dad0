#pragma once
// QK-norm + RoPE: the attention prologue of Qwen3, Gemma 3, OLMo 2 and the other models that RMS-normalize q and k
// per head before rotating them, in one pass over q and k.
#include <posenc/find_op.h>

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace posenc {

// q and k each RMS-normalized, times their weight, then rotated as rope_qk rotates them (every argument after eps
// and norm means what it means there). A weight [head_dim] normalizes each head, [heads * head_dim] all heads of a
// token together (OLMo 2's q_norm and k_norm). norm, the convention: "llama" (Qwen3, Llama: x / rms(x) rounded to
// the input dtype, then times the weight), "gemma" (weight 1 + w, float32 until the norm's output is rounded),
// "olmo2" (float32 until the norm's output is rounded), "fused" (float32 from load to store, one rounding).
// q_scale_beta, q_scale_length, q_scale_shift: q's scale by position, as in rope_qk.
inline std::tuple<at::Tensor, at::Tensor> qk_norm_rope(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
    const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double eps = 1e-6,
    std::string_view norm = "llama", double attention_scale = 1.0, std::string_view layout = "neox",
    std::string_view format = "bshd", int64_t offset = 0, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
    const std::optional<at::Tensor>& pair_axis = std::nullopt, double q_scale_beta = 0.0, int64_t q_scale_length = 1,
    int64_t q_scale_shift = 0) {
  static const auto op = detail::find_op<decltype(qk_norm_rope)>("posenc::qk_norm_rope");
  return op.call(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale, layout, format, offset,
                 cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
}

// The gradients of qk_norm_rope for q, k, q_weight and k_weight, from those of its outputs and its inputs q and k
// (the norm is recomputed). The weights' gradients are summed in an order that no thread count changes.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_backward(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& q_weight, const at::Tensor& k_weight, const std::optional<at::Tensor>& positions,
    const at::Tensor& inv_freq, double eps = 1e-6, std::string_view norm = "llama", double attention_scale = 1.0,
    std::string_view layout = "neox", std::string_view format = "bshd", int64_t offset = 0,
    const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
    const std::optional<at::Tensor>& pair_axis = std::nullopt, double q_scale_beta = 0.0, int64_t q_scale_length = 1,
    int64_t q_scale_shift = 0) {
  static const auto op = detail::find_op<decltype(qk_norm_rope_backward)>("posenc::qk_norm_rope_backward");
  return op.call(grad_q, grad_k, q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale, layout,
                 format, offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
}

// qk_norm_rope in place: q and k overwritten (two distinct tensors, each without overlapping elements).
inline void qk_norm_rope_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                          const at::Tensor& k_weight, const std::optional<at::Tensor>& positions,
                          const at::Tensor& inv_freq, double eps = 1e-6, std::string_view norm = "llama",
                          double attention_scale = 1.0, std::string_view layout = "neox",
                          std::string_view format = "bshd", int64_t offset = 0,
                          const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
                          const std::optional<at::Tensor>& pair_axis = std::nullopt, double q_scale_beta = 0.0,
                          int64_t q_scale_length = 1, int64_t q_scale_shift = 0) {
  static const auto op = detail::find_op<decltype(qk_norm_rope_)>("posenc::qk_norm_rope_");
  op.call(q, k, q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale, layout, format, offset, cu_seqlens,
          pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
}

// qk_norm_rope of a fused QKV projection qkv [B, S, (Hq + 2 Hk) * D] ("bshd"), [S, B, ...] ("sbhd") or [T, ...]
// ("thd"): its q heads, then k's, then v's. Returns (q, k, v) as [..., H, D] tensors in that format: q and k
// normalized and rotated (fresh tensors, or with inplace the views of qkv, rewritten), v a view of qkv, untouched.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_packed(
    const at::Tensor& qkv, int64_t num_q_heads, int64_t num_kv_heads, const at::Tensor& q_weight,
    const at::Tensor& k_weight, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
    double eps = 1e-6, std::string_view norm = "llama", double attention_scale = 1.0, std::string_view layout = "neox",
    std::string_view format = "bshd", int64_t offset = 0, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
    const std::optional<at::Tensor>& pair_axis = std::nullopt, double q_scale_beta = 0.0, int64_t q_scale_length = 1,
    int64_t q_scale_shift = 0, bool inplace = false) {
  TORCH_CHECK_VALUE(format == "bshd" || format == "sbhd" || format == "thd",
                    "posenc.qk_norm_rope_packed: format must be \"bshd\", \"sbhd\" or \"thd\" (a packed projection "
                    "is token-major), got \"", format, "\"");
  const int64_t heads = num_q_heads + 2 * num_kv_heads;
  const int64_t width = qkv.dim() > 0 ? qkv.size(-1) : 0;
  TORCH_CHECK_VALUE(num_q_heads >= 1 && num_kv_heads >= 1 && width % heads == 0,
                    "posenc.qk_norm_rope_packed: qkv's last size ", width, " must be (num_q_heads + 2 * num_kv_heads) "
                    "* head_dim; got num_q_heads=", num_q_heads, ", num_kv_heads=", num_kv_heads);
  const auto parts = qkv.unflatten(-1, {heads, width / heads}).split({num_q_heads, num_kv_heads, num_kv_heads}, -2);
  if (inplace) {
    qk_norm_rope_(parts[0], parts[1], q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale, layout,
                  format, offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
    return {parts[0], parts[1], parts[2]};
  }
  auto [q, k] = qk_norm_rope(parts[0], parts[1], q_weight, k_weight, positions, inv_freq, eps, norm, attention_scale,
                             layout, format, offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length,
                             q_scale_shift);
  return {q, k, parts[2]};
}

}  // namespace posenc
