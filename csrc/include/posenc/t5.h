#pragma once
// T5 relative position bias.
#include <posenc/find_op.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace posenc {

// T5's bucket (int64, same shape) of integer relative positions key_pos - query_pos, identical to Hugging
// Face's T5Attention._relative_position_bucket, including its float32 rounding at bucket edges.
inline at::Tensor relative_position_bucket(const at::Tensor& relative_position, bool bidirectional = true,
                                           int64_t num_buckets = 32, int64_t max_distance = 128) {
  static const auto op = detail::find_op<decltype(relative_position_bucket)>("posenc::relative_position_bucket");
  return op.call(relative_position, bidirectional, num_buckets, max_distance);
}

// bias[0, h, i, j] = weight[bucket(j - (i + q_offset)), h] for weight [num_buckets, H]: [1, H, q_len, k_len].
// q_offset is the cache length when decoding. Differentiable w.r.t. weight (deterministic backward).
inline at::Tensor t5_bias_symint(const at::Tensor& weight, c10::SymInt q_len, c10::SymInt k_len, bool bidirectional,
                                 int64_t num_buckets, int64_t max_distance, c10::SymInt q_offset = 0) {
  static const auto op = detail::find_op<decltype(t5_bias_symint)>("posenc::t5_bias");
  return op.call(weight, std::move(q_len), std::move(k_len), bidirectional, num_buckets, max_distance,
                 std::move(q_offset));
}
inline at::Tensor t5_bias(const at::Tensor& weight, int64_t q_len, int64_t k_len, bool bidirectional,
                          int64_t num_buckets, int64_t max_distance, int64_t q_offset = 0) {
  return t5_bias_symint(weight, c10::SymInt(q_len), c10::SymInt(k_len), bidirectional, num_buckets, max_distance,
                        c10::SymInt(q_offset));
}

// The gradient [num_buckets, H] w.r.t. weight of a bias whose output gradient is grad [1, H, Q, K]: bitwise
// the same for any thread count.
inline at::Tensor t5_bias_backward_symint(const at::Tensor& grad, bool bidirectional, int64_t num_buckets,
                                          int64_t max_distance, c10::SymInt q_offset = 0) {
  static const auto op = detail::find_op<decltype(t5_bias_backward_symint)>("posenc::t5_bias_backward");
  return op.call(grad, bidirectional, num_buckets, max_distance, std::move(q_offset));
}
inline at::Tensor t5_bias_backward(const at::Tensor& grad, bool bidirectional, int64_t num_buckets,
                                   int64_t max_distance, int64_t q_offset = 0) {
  return t5_bias_backward_symint(grad, bidirectional, num_buckets, max_distance, c10::SymInt(q_offset));
}

namespace nn {

// The learned bucket table of a T5 attention layer: parameter "weight" [num_buckets, num_heads], the layout
// of Hugging Face's relative_attention_bias.weight (a state dict loads as is), initialised N(0, 1) like the
// nn.Embedding it replaces. forward gives the bias [1, num_heads, q_len, k_len] to add to the scores.
class T5RelativeBiasImpl : public torch::nn::Module {
 public:
  explicit T5RelativeBiasImpl(int64_t num_heads, int64_t num_buckets = 32, int64_t max_distance = 128,
                              bool bidirectional = true);
  at::Tensor forward(int64_t q_len, int64_t k_len, int64_t q_offset = 0);
  const at::Tensor& weight() const { return weight_; }

 private:
  at::Tensor weight_;
  int64_t num_buckets_, max_distance_;
  bool bidirectional_;
};
TORCH_MODULE(T5RelativeBias);

}  // namespace nn
}  // namespace posenc
