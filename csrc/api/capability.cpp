#include <posenc/posenc.h>

#include "cpu/dispatch.h"

#include <torch/library.h>

namespace posenc {

std::string cpu_capability() { return cpu::capability_name(cpu::capability()); }

}  // namespace posenc

// An op, so that Python (posenc.cpu_capability()) and TorchScript can ask too; it takes no tensor, so its
// kernel sits at a key the dispatcher reaches without one.
TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  m.impl("cpu_capability", TORCH_FN(posenc::cpu_capability));
}
