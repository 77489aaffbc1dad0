#pragma once
// Typed handles to posenc ops: the C++ API and the autograd kernels call ops through these.
#include <ATen/core/dispatch/Dispatcher.h>

namespace posenc {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace posenc
