#pragma once
// The typed handle of a posenc op in the dispatcher. The C++ API calls each op with the signature of its own
// declaration (find_op<decltype(add_learned)>), and the dispatcher checks that signature against the op's
// schema when the handle is made: a C++ function whose argument types drift from the schema throws on its
// first call instead of reading its arguments wrongly.
#include <ATen/core/dispatch/Dispatcher.h>

namespace posenc::detail {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace posenc::detail
