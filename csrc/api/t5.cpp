#include <posenc/t5.h>

#include "common/find_op.h"

#include <ATen/ops/randn.h>

namespace posenc {

at::Tensor relative_position_bucket(const at::Tensor& relative_position, bool bidirectional, int64_t num_buckets,
                                    int64_t max_distance) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, bool, int64_t, int64_t)>(
      "posenc::relative_position_bucket");
  return op.call(relative_position, bidirectional, num_buckets, max_distance);
}

at::Tensor t5_bias_symint(const at::Tensor& weight, c10::SymInt q_len, c10::SymInt k_len, bool bidirectional,
                          int64_t num_buckets, int64_t max_distance, c10::SymInt q_offset) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, c10::SymInt, c10::SymInt, bool, int64_t, int64_t,
                                            c10::SymInt)>("posenc::t5_bias");
  return op.call(weight, std::move(q_len), std::move(k_len), bidirectional, num_buckets, max_distance,
                 std::move(q_offset));
}

at::Tensor t5_bias(const at::Tensor& weight, int64_t q_len, int64_t k_len, bool bidirectional, int64_t num_buckets,
                   int64_t max_distance, int64_t q_offset) {
  return t5_bias_symint(weight, c10::SymInt(q_len), c10::SymInt(k_len), bidirectional, num_buckets, max_distance,
                        c10::SymInt(q_offset));
}

at::Tensor t5_bias_backward_symint(const at::Tensor& grad, bool bidirectional, int64_t num_buckets,
                                   int64_t max_distance, c10::SymInt q_offset) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, bool, int64_t, int64_t, c10::SymInt)>(
      "posenc::t5_bias_backward");
  return op.call(grad, bidirectional, num_buckets, max_distance, std::move(q_offset));
}

at::Tensor t5_bias_backward(const at::Tensor& grad, bool bidirectional, int64_t num_buckets, int64_t max_distance,
                            int64_t q_offset) {
  return t5_bias_backward_symint(grad, bidirectional, num_buckets, max_distance, c10::SymInt(q_offset));
}

namespace nn {

T5RelativeBiasImpl::T5RelativeBiasImpl(int64_t num_heads, int64_t num_buckets, int64_t max_distance,
                                       bool bidirectional)
    : num_buckets_(num_buckets), max_distance_(max_distance), bidirectional_(bidirectional) {
  TORCH_CHECK(num_heads > 0, "posenc.nn.T5RelativeBias: num_heads must be positive, got ", num_heads);
  TORCH_CHECK(num_buckets > 0, "posenc.nn.T5RelativeBias: num_buckets must be positive, got ", num_buckets);
  weight_ = register_parameter("weight", at::randn({num_buckets, num_heads}));
}

at::Tensor T5RelativeBiasImpl::forward(int64_t q_len, int64_t k_len, int64_t q_offset) {
  return t5_bias(weight_, q_len, k_len, bidirectional_, num_buckets_, max_distance_, q_offset);
}

}  // namespace nn
}  // namespace posenc
