// Meta kernel of embedding_backward.
#include "common/embedding.h"
#include "families.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace posenc {
namespace {

at::Tensor embedding_backward_meta(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_rows,
                                   double scale, std::optional<int64_t> padding_idx) {
  check_embedding_backward(grad, indices, num_rows, padding_idx);
  return at::empty_symint({num_rows, grad.sym_size(-1)}, grad.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) { POSENC_EMBEDDING_OPS(POSENC_IMPL_SUFFIXED, _meta) }

}  // namespace posenc
