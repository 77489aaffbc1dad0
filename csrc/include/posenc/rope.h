#pragma once
// Rotary position embeddings.
#include <posenc/frequencies.h>

#include <posenc/find_op.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>

namespace posenc {

// x rotated by angle(p, i) = p * inv_freq[i], cos and sin scaled by attention_scale. layout: "neox"
// pairs (x_i, x_{i+r/2}), "gptj" pairs (x_2i, x_2i+1); r = 2 * len(inv_freq) <= head_dim, the other
// channels pass through. format: "bshd", "bhsd", "sbhd" or "thd" (packed; cu_seqlens restarts positions per
// sequence). positions: none (offset + arange), [S] (or [T]) or [B, S], int64 or int32; offset is added to
// them too. Any strides; the result is a fresh tensor, contiguous in x's format.
// Multi-axis positions (images, video, multimodal text): pair_axis [r / 2] (int64 or int32) gives the axis of
// each frequency pair, positions carry a leading axis dimension ([n_axes, S], [n_axes, B, S] or [n_axes, T]),
// and angle(i) = positions[pair_axis[i], ...] * inv_freq[i] (see posenc::frequencies::mrope / multiaxis).
inline at::Tensor rope(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                       double attention_scale = 1.0, std::string_view layout = "neox", std::string_view format = "bshd",
                       int64_t offset = 0, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
                       const std::optional<at::Tensor>& pair_axis = std::nullopt) {
  static const auto op = detail::find_op<decltype(rope)>("posenc::rope");
  return op.call(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
}

// The gradient of rope: grad rotated by -angle (times attention_scale).
inline at::Tensor rope_backward(const at::Tensor& grad, const std::optional<at::Tensor>& positions,
                                const at::Tensor& inv_freq, double attention_scale = 1.0,
                                std::string_view layout = "neox", std::string_view format = "bshd", int64_t offset = 0,
                                const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
                                const std::optional<at::Tensor>& pair_axis = std::nullopt) {
  static const auto op = detail::find_op<decltype(rope_backward)>("posenc::rope_backward");
  return op.call(grad, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
}

// q and k rotated in one pass (the angles are formed once for both); their head counts may differ. q_scale_beta
// (Llama 4's attention temperature, Ministral 3's llama_4_scaling_beta): q, and only q, also times
// 1 + q_scale_beta * log(1 + floor((p + q_scale_shift) / q_scale_length)) at its position p (q fully rotated, one
// position per token).
inline std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k,
                                                  const std::optional<at::Tensor>& positions,
                                                  const at::Tensor& inv_freq, double attention_scale = 1.0,
                                                  std::string_view layout = "neox", std::string_view format = "bshd",
                                                  int64_t offset = 0,
                                                  const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
                                                  const std::optional<at::Tensor>& pair_axis = std::nullopt,
                                                  double q_scale_beta = 0.0, int64_t q_scale_length = 1,
                                                  int64_t q_scale_shift = 0) {
  static const auto op = detail::find_op<decltype(rope_qk)>("posenc::rope_qk");
  return op.call(q, k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis,
                 q_scale_beta, q_scale_length, q_scale_shift);
}

inline std::tuple<at::Tensor, at::Tensor> rope_qk_backward(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const std::optional<at::Tensor>& positions,
    const at::Tensor& inv_freq, double attention_scale = 1.0, std::string_view layout = "neox",
    std::string_view format = "bshd", int64_t offset = 0, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
    const std::optional<at::Tensor>& pair_axis = std::nullopt, double q_scale_beta = 0.0, int64_t q_scale_length = 1,
    int64_t q_scale_shift = 0) {
  static const auto op = detail::find_op<decltype(rope_qk_backward)>("posenc::rope_qk_backward");
  return op.call(grad_q, grad_k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis,
                 q_scale_beta, q_scale_length, q_scale_shift);
}

// rope in place, for inference paths (x's own strides are kept).
inline void rope_(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                  double attention_scale = 1.0, std::string_view layout = "neox", std::string_view format = "bshd",
                  int64_t offset = 0, const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
                  const std::optional<at::Tensor>& pair_axis = std::nullopt) {
  static const auto op = detail::find_op<decltype(rope_)>("posenc::rope_");
  op.call(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
}

// One decoding step's attention prologue in one pass: q rotated in place as rope_qk rotates it, k rotated and v
// copied into their caches (k and v unchanged). cache_format: "bhsd" [B, H_kv, S_max, D] (Hugging Face's
// StaticCache), "bshd" [B, S_max, H_kv, D] or "shd" [S_max, H_kv, D] (one pool of slots for every token). Token
// (b, s) goes to slot cache_positions[b, s] (or [s]; [T] for thd), or without it to its rotary position (integer
// positions plus offset). Slots are checked to lie in [0, S_max), one token per slot of a cache row. Inference only.
inline void rope_qk_cache_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const std::optional<at::Tensor>& positions,
                           const at::Tensor& inv_freq, const std::optional<at::Tensor>& cache_positions = std::nullopt,
                           std::string_view cache_format = "bhsd", double attention_scale = 1.0,
                           std::string_view layout = "neox", std::string_view format = "bshd", int64_t offset = 0,
                           const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
                           const std::optional<at::Tensor>& pair_axis = std::nullopt, double q_scale_beta = 0.0,
                           int64_t q_scale_length = 1, int64_t q_scale_shift = 0) {
  static const auto op = detail::find_op<decltype(rope_qk_cache_)>("posenc::rope_qk_cache_");
  op.call(q, k, v, k_cache, v_cache, positions, inv_freq, cache_positions, cache_format, attention_scale, layout,
          format, offset, cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
}

// Hugging Face's apply_rotary_pos_emb for one tensor: x * cos + rotate(x) * sin with explicit tables
// [S, r] or [B or 1, S, r] ([T, r] for thd), r <= head_dim; the other channels pass through.
inline at::Tensor rope_cos_sin(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               std::string_view layout = "neox", std::string_view format = "bshd") {
  static const auto op = detail::find_op<decltype(rope_cos_sin)>("posenc::rope_cos_sin");
  return op.call(x, cos, sin, layout, format);
}

inline at::Tensor rope_cos_sin_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                                        std::string_view layout = "neox", std::string_view format = "bshd") {
  static const auto op = detail::find_op<decltype(rope_cos_sin_backward)>("posenc::rope_cos_sin_backward");
  return op.call(grad, cos, sin, layout, format);
}

// Context parallelism, dual-chunk (zigzag) split: the sequence is cut into 2 * cp_size chunks and rank r
// holds chunks r and 2 * cp_size - 1 - r. Returns the positions of its tokens, which are also their
// indices in the full sequence: rope(x.index_select(seq_dim, p), p) equals rope(x) at those tokens.
// The ops posenc::zigzag_positions and posenc::zigzag_positions_varlen call these two functions.
at::Tensor zigzag_positions(int64_t seq_len, int64_t cp_size, int64_t cp_rank,
                            at::TensorOptions options = at::TensorOptions().dtype(at::kLong));

// The same per packed sequence: (positions within their sequences, indices into the packed tokens,
// this rank's cu_seqlens). Every sequence length must divide by 2 * cp_size.
std::tuple<at::Tensor, at::Tensor, at::Tensor> zigzag_positions_varlen(const at::Tensor& cu_seqlens, int64_t cp_size,
                                                                       int64_t cp_rank);

namespace nn {

// Rotates q and k (rope_qk). Frequencies are float64 members, not registered buffers, so
// module->to(torch::kBFloat16) leaves them exact; they follow q's device. "dynamic" and "longrope"
// pick their frequencies from the sequence length of each call (max position + 1).
class RotaryEmbeddingImpl : public torch::nn::Module {
 public:
  explicit RotaryEmbeddingImpl(int64_t head_dim, std::optional<int64_t> rotary_dim = std::nullopt,
                               double base = 10000.0, std::string layout = "neox",
                               frequencies::RopeScaling scaling = {}, std::string format = "bshd");
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                             const std::optional<at::Tensor>& positions = std::nullopt,
                                             int64_t offset = 0,
                                             const std::optional<at::Tensor>& cu_seqlens = std::nullopt);
  // The frequencies used for a sequence of seq_len tokens (max position + 1).
  at::Tensor inv_freq(std::optional<int64_t> seq_len = std::nullopt) const;
  // The frequencies forward uses for this call, on q's device: "dynamic" and "longrope" form them there from the
  // call's length (without a host read), the other types return the module's (moved to q's device once).
  at::Tensor inv_freq_for(const at::Tensor& q, const std::optional<at::Tensor>& positions = std::nullopt,
                          int64_t offset = 0, const std::optional<at::Tensor>& cu_seqlens = std::nullopt);
  double attention_scale() const { return attention_scale_; }
  int64_t rotary_dim() const { return rotary_dim_; }
  const std::string& layout() const { return layout_; }
  const std::string& format() const { return format_; }

 private:
  bool per_call_scaling() const;
  at::Tensor seq_len_of(const at::Tensor& q, const std::optional<at::Tensor>& positions, int64_t offset,
                        const std::optional<at::Tensor>& cu_seqlens) const;

  int64_t head_dim_;
  int64_t rotary_dim_;
  double base_;
  std::string layout_;
  frequencies::RopeScaling scaling_;
  std::string format_;
  at::Tensor inv_freq_;  // the frequencies of seq_len <= max_position_embeddings (LongRoPE: the short ones)
  double attention_scale_;
};
TORCH_MODULE(RotaryEmbedding);

// RMS-normalizes q and k, scales them by their weights and rotates them, in one op (qk_norm_rope): the attention
// prologue of Qwen3, Gemma 3 and OLMo 2. The weights are parameters "q_weight" [q_norm_dim] and "k_weight"
// [k_norm_dim] (Hugging Face's q_norm.weight and k_norm.weight): head_dim (the default) normalizes each head,
// heads * head_dim all heads of a token (OLMo 2). They start at one, or zero for norm "gemma" (scale 1 + w). norm:
// the rounding convention, "llama", "gemma", "olmo2" or "fused" (posenc::qk_norm_rope). The rotary arguments are
// RotaryEmbedding's, which the module holds as its submodule "rotary". Python: posenc.nn.QKNormRotaryEmbedding,
// with the same state dict.
class QKNormRotaryEmbeddingImpl : public torch::nn::Module {
 public:
  explicit QKNormRotaryEmbeddingImpl(int64_t head_dim, std::optional<int64_t> rotary_dim = std::nullopt,
                                     double base = 10000.0, std::string layout = "neox",
                                     frequencies::RopeScaling scaling = {}, std::string format = "bshd",
                                     double eps = 1e-6, std::string norm = "llama",
                                     std::optional<int64_t> q_norm_dim = std::nullopt,
                                     std::optional<int64_t> k_norm_dim = std::nullopt);
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                             const std::optional<at::Tensor>& positions = std::nullopt,
                                             int64_t offset = 0,
                                             const std::optional<at::Tensor>& cu_seqlens = std::nullopt);
  void reset_parameters();

  RotaryEmbedding rotary{nullptr};
  at::Tensor q_weight;
  at::Tensor k_weight;
  double eps;
  std::string norm;
};
TORCH_MODULE(QKNormRotaryEmbedding);

}  // namespace nn
}  // namespace posenc
