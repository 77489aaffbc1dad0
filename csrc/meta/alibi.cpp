// Meta kernels of ALiBi: the same checks and output metadata as CPU, no data read.
#include "common/alibi.h"
#include "families.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace posenc {
namespace {

at::Tensor alibi_bias_meta(const at::Tensor& slopes, c10::SymInt q_len, c10::SymInt k_len, c10::string_view mode,
                           int64_t head_offset, std::optional<c10::SymInt> num_heads,
                           std::optional<at::ScalarType> dtype) {
  const auto shape = check_alibi_bias(slopes, q_len, k_len, mode, head_offset, num_heads, dtype);
  return at::empty_symint({shape.batch, shape.num_heads, q_len, k_len}, slopes.options().dtype(shape.dtype));
}

at::Tensor add_alibi_meta(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode,
                          int64_t head_offset) {
  check_alibi_scores("add_alibi", "scores", scores, slopes, mode, head_offset);
  return at::empty_symint(scores.sym_sizes(), scores.options());
}

void add_alibi__meta(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode, int64_t head_offset) {
  check_add_alibi_inplace(scores, slopes, mode, head_offset);
}

at::Tensor alibi_backward_meta(const at::Tensor& grad, const at::Tensor& slopes, c10::string_view mode,
                               int64_t head_offset) {
  check_alibi_scores("alibi_backward", "grad", grad, slopes, mode, head_offset);
  return at::empty_symint(slopes.sym_sizes(), slopes.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) { POSENC_ALIBI_OPS(POSENC_IMPL_SUFFIXED, _meta) }

}  // namespace posenc
