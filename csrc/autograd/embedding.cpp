// Autograd kernel of embedding_backward: its own derivative is not implemented, so a double backward
// through an embedding op stops here with an error instead of silently returning zeros.
#include <posenc/embedding.h>

#include "families.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

namespace posenc {
namespace {

at::Tensor embedding_backward_autograd(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_rows,
                                       double scale, std::optional<int64_t> padding_idx) {
  TORCH_CHECK(!(at::GradMode::is_enabled() && grad.requires_grad()),
              "posenc.embedding_backward: double backward through an embedding op is not supported");
  at::AutoDispatchBelowADInplaceOrView guard;
  return embedding_backward_symint(grad, indices, std::move(num_rows), scale, padding_idx);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) { POSENC_EMBEDDING_OPS(POSENC_IMPL_SUFFIXED, _autograd) }

}  // namespace posenc
