// TorchScript round trip: modules scripted and saved by scripts/export_torchscript.py, loaded here with
// torch::jit::load, run forward and backward, values checked against float64 formulas.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>

#include "reference.h"

using posenc::test::max_abs_diff;
using posenc::test::reference_frequencies;
using posenc::test::reference_pe;

namespace {

torch::jit::Module load_fixture(const std::string& name) {
  const char* dir = std::getenv("POSENC_FIXTURES");
  if (dir == nullptr) throw std::runtime_error("POSENC_FIXTURES is not set: run the tests through ctest");
  return torch::jit::load(std::string(dir) + "/" + name + ".pt");
}

at::Tensor parameter(const torch::jit::Module& module, const std::string& name) {
  for (const auto& p : module.named_parameters()) {
    if (p.name == name) return p.value;
  }
  throw std::runtime_error("no parameter " + name);
}

}  // namespace

TEST(TorchScript, SinusoidalForwardAndBackward) {
  auto module = load_fixture("sinusoidal");
  const auto tokens = torch::tensor({{3, 0, 10, 3}, {1, 2, 2, 0}});
  auto x = torch::randn({2, 4, 6}, torch::requires_grad(true));
  const auto outputs = module.forward({tokens, x}).toTuple();
  const auto embedded = outputs->elements()[0].toTensor();
  const auto encoded = outputs->elements()[1].toTensor();

  const auto weight = parameter(module, "embed.weight");
  const auto expected_embedded = weight.detach().index_select(0, tokens.flatten()).view({2, 4, 8}).to(at::kDouble) * 2.0 +
                                 reference_pe(torch::arange(4), reference_frequencies(8, 1e4, 0), "interleaved", 8);
  EXPECT_LT(max_abs_diff(embedded, expected_embedded), 2e-6);
  const auto expected_encoded =
      x.detach().to(at::kDouble) * 0.5 + reference_pe(torch::arange(3, 7), reference_frequencies(6, 1e4, 1), "half", 6);
  EXPECT_LT(max_abs_diff(encoded, expected_encoded), 2e-6);

  const auto grad = torch::randn_like(embedded);
  torch::autograd::backward({embedded, encoded}, {grad, torch::ones_like(encoded)});
  auto expected_grad = torch::zeros({11, 8}).index_add_(0, tokens.flatten(), grad.view({8, 8})) * 2.0;
  expected_grad[0] = 0;  // padding_idx
  EXPECT_LT(max_abs_diff(weight.grad(), expected_grad), 1e-5);
  EXPECT_LT(max_abs_diff(x.grad(), torch::full_like(x, 0.5)), 1e-7);

  // An out-of-vocabulary token raises inside the scripted module, naming op, argument and value.
  try {
    module.forward({torch::tensor({{11}}), x});
    FAIL() << "expected an error";
  } catch (const std::exception& e) {  // the interpreter rethrows the op's c10::Error with its message
    EXPECT_NE(std::string(e.what()).find("posenc.embed_sinusoidal: tokens holds 11"), std::string::npos);
  }
}
