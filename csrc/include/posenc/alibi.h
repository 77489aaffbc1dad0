#pragma once
// ALiBi: linear attention biases.
#include <posenc/find_op.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <utility>
#include <string>
#include <string_view>

namespace posenc {

// The slopes of the ALiBi paper and BLOOM for any head count: with n = 2^floor(log2 num_heads),
// m_k = 2^(-8k/n) for k = 1..n, then 2^(-4(2j-1)/n) for j = 1..num_heads-n (every other slope of the
// 2n-head series). Computed in float64, returned as `dtype`; the op posenc::alibi_slopes (Python's
// posenc.functional.alibi_slopes) calls this function.
at::Tensor alibi_slopes(int64_t num_heads, at::ScalarType dtype = at::kFloat);

// The bias [B or 1, num_heads, q_len, k_len] of slopes [H] or [B, H] (heads head_offset + h), bottom-right
// aligned: d = i + (k_len - q_len) - j; "causal" gives -m * d, "symmetric" -m * |d|. num_heads defaults to
// every head from head_offset on, dtype to that of slopes. Differentiable w.r.t. slopes.
inline at::Tensor alibi_bias_symint(const at::Tensor& slopes, c10::SymInt q_len, c10::SymInt k_len,
                                    std::string_view mode = "causal", int64_t head_offset = 0,
                                    std::optional<c10::SymInt> num_heads = std::nullopt,
                                    std::optional<at::ScalarType> dtype = std::nullopt) {
  static const auto op = detail::find_op<decltype(alibi_bias_symint)>("posenc::alibi_bias");
  return op.call(slopes, std::move(q_len), std::move(k_len), mode, head_offset, std::move(num_heads), dtype);
}
inline at::Tensor alibi_bias(const at::Tensor& slopes, int64_t q_len, int64_t k_len, std::string_view mode = "causal",
                             int64_t head_offset = 0, std::optional<int64_t> num_heads = std::nullopt,
                             std::optional<at::ScalarType> dtype = std::nullopt) {
  return alibi_bias_symint(slopes, c10::SymInt(q_len), c10::SymInt(k_len), mode, head_offset,
                           num_heads ? std::optional<c10::SymInt>(*num_heads) : std::nullopt, dtype);
}

// scores [B, H, Q, K] + the bias of heads [head_offset, head_offset + H), in one pass; differentiable
// w.r.t. scores and slopes.
inline at::Tensor add_alibi(const at::Tensor& scores, const at::Tensor& slopes, std::string_view mode = "causal",
                            int64_t head_offset = 0) {
  static const auto op = detail::find_op<decltype(add_alibi)>("posenc::add_alibi");
  return op.call(scores, slopes, mode, head_offset);
}

// The same, in place (inference: it records no autograd).
inline void add_alibi_(const at::Tensor& scores, const at::Tensor& slopes, std::string_view mode = "causal",
                       int64_t head_offset = 0) {
  static const auto op = detail::find_op<decltype(add_alibi_)>("posenc::add_alibi_");
  op.call(scores, slopes, mode, head_offset);
}

// The gradient w.r.t. slopes of a bias whose output gradient is grad [B, H, Q, K]: shape and dtype of slopes,
// zero outside heads [head_offset, head_offset + H). Deterministic for any thread count.
inline at::Tensor alibi_backward(const at::Tensor& grad, const at::Tensor& slopes, std::string_view mode = "causal",
                                 int64_t head_offset = 0) {
  static const auto op = detail::find_op<decltype(alibi_backward)>("posenc::alibi_backward");
  return op.call(grad, slopes, mode, head_offset);
}

namespace nn {

// Adds ALiBi to attention scores [B, num_local_heads, Q, K]. Slopes cover all num_heads (global) heads; this
// module's heads are [head_offset, head_offset + num_local_heads) (a tensor-parallel shard). Fixed slopes are
// float32 and no registered buffer, so module->to(torch::kHalf) cannot round them; learnable slopes are a
// parameter "slopes" (float32 at construction, converted like any parameter).
class ALiBiImpl : public torch::nn::Module {
 public:
  explicit ALiBiImpl(int64_t num_heads, std::string mode = "causal", bool learnable = false, int64_t head_offset = 0,
                     std::optional<int64_t> num_local_heads = std::nullopt);
  at::Tensor forward(const at::Tensor& scores);
  // The bias alone, [1, num_local_heads, q_len, k_len] in `dtype` (default: that of the slopes).
  at::Tensor bias(int64_t q_len, int64_t k_len, std::optional<at::ScalarType> dtype = std::nullopt);
  const at::Tensor& slopes() const { return slopes_; }

 private:
  at::Tensor slopes_;
  std::string mode_;
  bool learnable_;
  int64_t head_offset_;
  int64_t num_local_heads_;
};
TORCH_MODULE(ALiBi);

}  // namespace nn
}  // namespace posenc
