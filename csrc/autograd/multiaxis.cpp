// Autograd of mrope_positions: integer outputs, nothing to differentiate.
#include <posenc/multiaxis.h>

#include "autograd/kernels.h"
#include "families.h"

#include <torch/library.h>

namespace posenc {
namespace {

constexpr auto mrope_positions_autograd = POSENC_BELOW_AUTOGRAD(mrope_positions);

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) { POSENC_MULTIAXIS_OPS(POSENC_IMPL_SUFFIXED, _autograd) }

}  // namespace posenc
