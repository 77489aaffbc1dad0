#pragma once
// The Autograd kernels that every family's ops share, derived from the op's signature instead of written per op.
#include <posenc/find_op.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>

#include <optional>
#include <tuple>
#include <type_traits>

namespace posenc {

inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const std::optional<at::Tensor>& t) { return t && requires_grad(*t); }
template <typename T>
bool requires_grad(const T&) {
  return false;
}

// The Autograd kernel of an op whose torch::autograd::Function is Fn, with the op's arguments after the context in
// Fn::forward and the op's name in Fn::kOp: Fn::apply when grad mode is on and a tensor argument requires grad, else
// the op below autograd with nothing recorded, as PyTorch's VariableType kernels do.
template <typename Fn, typename Forward = decltype(&Fn::forward)>
struct AutogradKernel;

template <typename Fn, typename Result, typename... Args>
struct AutogradKernel<Fn, Result (*)(torch::autograd::AutogradContext*, Args...)> {
  // A Function of two outputs returns them as a list of tensors; the op, as a pair.
  static constexpr bool kPair = std::is_same_v<Result, torch::autograd::variable_list>;
  using Returned = std::conditional_t<kPair, std::tuple<at::Tensor, at::Tensor>, Result>;

  static Returned kernel(Args... args) {
    if (!at::GradMode::is_enabled() || !(requires_grad(args) || ...)) {
      static const auto op = detail::find_op<Returned(Args...)>(Fn::kOp);
      at::AutoDispatchBelowADInplaceOrView guard;
      return op.call(args...);
    }
    if constexpr (kPair) {
      const auto out = Fn::apply(args...);
      return {out[0], out[1]};
    } else {
      return Fn::apply(args...);
    }
  }
};

// The Autograd kernel of an op whose outputs are integers (positions, buckets): nothing to differentiate, so the op
// runs below autograd, with the signature of its C++ API function.
template <typename Signature, Signature* op>
struct BelowAutograd;

template <typename Result, typename... Args, Result (*op)(Args...)>
struct BelowAutograd<Result(Args...), op> {
  static Result kernel(Args... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return op(args...);
  }
};

// `constexpr auto add_learned_autograd = POSENC_AUTOGRAD(AddLearned);`,
// `constexpr auto make_positions_autograd = POSENC_BELOW_AUTOGRAD(make_positions);`.
#define POSENC_AUTOGRAD(Fn) (&::posenc::AutogradKernel<Fn>::kernel)
#define POSENC_BELOW_AUTOGRAD(op) (&::posenc::BelowAutograd<decltype(::posenc::op), &::posenc::op>::kernel)

}  // namespace posenc
