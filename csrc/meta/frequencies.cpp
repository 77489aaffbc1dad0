// Meta kernel of rope_inv_freq_for_length, the one configuration op with a tensor input that torch.compile and
// torch.export trace: its checks, and the shape of its result whatever the length.
#include "config/rope_scaling.h"

#include <torch/library.h>

namespace posenc {

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  m.impl("rope_inv_freq_for_length", TORCH_FN(rope_inv_freq_for_length_kernel<true>));
}

}  // namespace posenc
