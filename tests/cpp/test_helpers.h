#pragma once
// Checks shared by the C++ tests (reference.h, bias_reference.h and rope_reference.h hold the float64 references).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/frontend/resolver.h>

#include <cctype>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>

namespace posenc::test {

// TorchScript compiled and run by the C++ interpreter: the default resolver knows only `torch` (aten); this one adds
// `posenc` for the posenc:: ops.
struct PosencResolver : torch::jit::Resolver {
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction& graph,
                                                         const torch::jit::SourceRange& loc) override {
    if (name == "posenc") return std::make_shared<torch::jit::BuiltinModule>("posenc");
    return torch::jit::nativeResolver()->resolveValue(name, graph, loc);
  }
  torch::jit::TypePtr resolveType(const std::string& name, const torch::jit::SourceRange& loc) override {
    return nullptr;
  }
};

inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// call() must throw a c10::Error whose text (what(): the message, then the backtrace) contains `fragment`; or, as
// expect_error<std::exception>, any exception whose what() does (TorchScript's interpreter rethrows an op's c10::Error
// as a std::exception, keeping its message).
template <typename Exception = c10::Error, typename Call>
void expect_error(Call&& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning: " << fragment;
  } catch (const Exception& e) {
    if constexpr (std::is_base_of_v<c10::Error, Exception>) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what_without_backtrace();
    } else {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  }
}

// The message names "posenc.<op>" (not a longer op name that starts with it) and contains `word`.
inline bool names(const std::string& message, const std::string& op, const std::string& word) {
  const std::string tag = "posenc." + op;
  for (auto at = message.find(tag); at != std::string::npos; at = message.find(tag, at + 1)) {
    const auto next = at + tag.size();
    const bool ends = next == message.size() || !(std::isalnum(message[next]) || message[next] == '_');
    if (ends) return message.find(word) != std::string::npos;
  }
  return false;
}

// call() must throw an error naming posenc.<op> and containing `word`; `what` says which case failed.
inline void expect_error(const std::function<void()>& call, const std::string& op, const std::string& word,
                         const std::string& what) {
  try {
    call();
    ADD_FAILURE() << what << ": expected an error naming posenc." << op;
  } catch (const std::exception& e) {  // c10::Error from the API; the interpreter rethrows it as std::exception
    EXPECT_TRUE(names(e.what(), op, word)) << what << ": " << e.what();
  }
}

}  // namespace posenc::test
