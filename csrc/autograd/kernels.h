#pragma once
// The Autograd kernels that every family's ops share, derived from the op's signature instead of written per op.
#include <posenc/find_op.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>

#include <optional>
#include <string>
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

// The Autograd kernel of an in-place op without a backward (decoding's cache writes), with the signature of its C++
// API function and its name: refused, naming the op, when autograd would have to record it (grad mode on and a tensor
// argument requiring grad); else the op below autograd, after which every tensor its schema marks as written
// (Tensor(a!)) gets a new version, as PyTorch's in-place ops give theirs: a tensor saved for a backward is then stale.
template <typename Signature, Signature* op, const char* kName>
struct InferenceOnly;

template <typename... Args, void (*op)(Args...), const char* kName>
struct InferenceOnly<void(Args...), op, kName> {
  static void kernel(Args... args) {
    TORCH_CHECK(!at::GradMode::is_enabled() || !(requires_grad(args) || ...), "posenc.", kName,
                ": a tensor requires grad, but the op has no backward; call it under torch.no_grad() or "
                "torch.inference_mode()");
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op(args...);
    }
    static const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow(
        (std::string("posenc::") + kName).c_str(), "").schema();
    size_t i = 0;
    (bump_if_written(schema, i++, args), ...);
  }

  template <typename T>
  static void bump_if_written(const c10::FunctionSchema& schema, size_t i, const T& arg) {
    if constexpr (std::is_same_v<T, at::Tensor>) {
      if (schema.is_mutable({c10::SchemaArgType::input, i})) torch::autograd::impl::bump_version(arg);
    }
  }
};

// `constexpr auto add_learned_autograd = POSENC_AUTOGRAD(AddLearned);`,
// `constexpr auto make_positions_autograd = POSENC_BELOW_AUTOGRAD(make_positions);`.
#define POSENC_AUTOGRAD(Fn) (&::posenc::AutogradKernel<Fn>::kernel)
#define POSENC_BELOW_AUTOGRAD(op) (&::posenc::BelowAutograd<decltype(::posenc::op), &::posenc::op>::kernel)
// `constexpr char kRopeQkCache[] = "rope_qk_cache_";`
// `constexpr auto rope_qk_cache__autograd = POSENC_INFERENCE_ONLY(rope_qk_cache_, kRopeQkCache);`
#define POSENC_INFERENCE_ONLY(op, name) \
  (&::posenc::InferenceOnly<decltype(::posenc::op), &::posenc::op, name>::kernel)

}  // namespace posenc
