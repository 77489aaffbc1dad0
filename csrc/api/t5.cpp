#include <posenc/t5.h>

#include <ATen/ops/randn.h>

namespace posenc {
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
