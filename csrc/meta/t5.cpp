// Meta kernels of the T5 relative bias: the same checks and output metadata as CPU, no data read.
#include "common/t5.h"
#include "families.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace posenc {
namespace {

at::Tensor relative_position_bucket_meta(const at::Tensor& relative_position, bool bidirectional, int64_t num_buckets,
                                         int64_t max_distance) {
  check_relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance);
  return at::empty_symint(relative_position.sym_sizes(), relative_position.options().dtype(at::kLong));
}

at::Tensor t5_bias_meta(const at::Tensor& weight, c10::SymInt q_len, c10::SymInt k_len, bool bidirectional,
                        int64_t num_buckets, int64_t max_distance, c10::SymInt q_offset) {
  check_t5_bias(weight, q_len, k_len, bidirectional, num_buckets, max_distance);
  return at::empty_symint({1, weight.sym_size(1), q_len, k_len}, weight.options());
}

at::Tensor t5_bias_backward_meta(const at::Tensor& grad, bool bidirectional, int64_t num_buckets, int64_t max_distance,
                                 c10::SymInt q_offset) {
  check_t5_bias_backward(grad, bidirectional, num_buckets, max_distance);
  return at::empty_symint({num_buckets, grad.sym_size(1)}, grad.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) { POSENC_T5_OPS(POSENC_IMPL_SUFFIXED, _meta) }

}  // namespace posenc
