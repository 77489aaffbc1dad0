// The supported domain of positions and angles from C++: through the C++ API and through TorchScript run by
// the C++ interpreter (functions compiled here with torch::jit::compile, and the scripted RotaryEmbedding
// fixture of scripts/export_torchscript.py). Positions after the offset lie in [-2^53, 2^53]; outside, or
// when the int64 sum overflows, the op raises an error naming itself and the position. Inside, float32
// outputs are within 1e-6 of sin/cos of the float64 angle fl(p * w) for any finite frequency.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "test_helpers.h"

using posenc::test::expect_error;
using posenc::test::max_abs_diff;
using posenc::test::PosencResolver;

namespace {

constexpr int64_t kLimit = int64_t{1} << 53;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
const auto kDouble = torch::TensorOptions().dtype(torch::kDouble);

// Inputs whose output is an encoding [S, 2F] of the positions: [sin || cos] for the sinusoidal family ("half"
// layout, x = 0), [cos || sin] for the rotation of the unit vector (1, 0) of every neox pair.
at::Tensor encode(const std::string& op, const std::optional<at::Tensor>& positions, int64_t seq_len,
                  const at::Tensor& inv_freq, int64_t offset, at::ScalarType dtype) {
  const int64_t pairs = inv_freq.size(0);
  const auto opts = torch::TensorOptions().dtype(dtype);
  if (op == "sinusoidal") return posenc::sinusoidal(*positions, inv_freq, "half", dtype, offset);
  if (op == "add_sinusoidal") return posenc::add_sinusoidal(torch::zeros({seq_len, 2 * pairs}, opts), positions,
                                                            inv_freq, 1.0, "half", offset);
  if (op == "embed_sinusoidal") {
    return posenc::embed_sinusoidal(torch::zeros({seq_len}, torch::kLong), torch::zeros({2, 2 * pairs}, opts),
                                    positions, inv_freq, 1.0, std::nullopt, "half", offset);
  }
  const auto x = torch::cat({torch::ones({1, seq_len, 1, pairs}, opts), torch::zeros({1, seq_len, 1, pairs}, opts)}, -1);
  if (op == "rope") return posenc::rope(x, positions, inv_freq, 1.0, "neox", "bshd", offset)[0].select(1, 0);
  if (op == "rope_qk") {
    return std::get<1>(posenc::rope_qk(x, x, positions, inv_freq, 1.0, "neox", "bshd", offset))[0].select(1, 0);
  }
  auto out = x.clone();
  posenc::rope_(out, positions, inv_freq, 1.0, "neox", "bshd", offset);
  return out[0].select(1, 0);
}

at::Tensor expected_encoding(const std::string& op, const at::Tensor& absolute, const at::Tensor& inv_freq) {
  const auto angle = absolute.to(at::kDouble).unsqueeze(1) * inv_freq.unsqueeze(0);
  if (op.find("sinusoidal") != std::string::npos) return torch::cat({angle.sin(), angle.cos()}, -1);
  return torch::cat({angle.cos(), angle.sin()}, -1);
}

const std::vector<std::string> kPositionOps = {"sinusoidal", "add_sinusoidal", "embed_sinusoidal",
                                               "rope",       "rope_qk",        "rope_"};

TEST(Domain, PositionsOutsideTwoPow53AreAnErrorInEveryOp) {
  const auto inv_freq = torch::tensor({1.0, 0.01}, kDouble);
  struct Case {
    const char* what;
    std::optional<at::Tensor> positions;
    int64_t offset;
  };
  const std::vector<Case> cases = {
      {"2^53 + 1", torch::tensor({int64_t{0}, kLimit + 1}), 0},
      {"-2^53 - 1", torch::tensor({-kLimit - 1}), 0},
      {"offset passes the edge", torch::tensor({kLimit - 1}), 2},
      {"absent positions pass the edge", std::nullopt, kLimit - 2},
      {"absent positions overflow int64", std::nullopt, kInt64Max - 1},
      {"int64 sum wraps to 5", torch::tensor({kInt64Min + 5}), kInt64Min},
      {"int64 sum wraps to -2", torch::tensor({kInt64Max}), kInt64Max},
      {"float64 2^53 + 2", torch::tensor({static_cast<double>(kLimit) + 2.0}, kDouble), 0},
  };
  for (const auto& op : kPositionOps) {
    for (const auto& c : cases) {
      if (!c.positions && op == "sinusoidal") continue;
      if (c.positions && c.positions->is_floating_point() && op.find("rope") == 0) continue;
      for (const auto dtype : {at::kFloat, at::kDouble}) {
        expect_error([&] { encode(op, c.positions, 4, inv_freq, c.offset, dtype); }, op, "position",
                     op + ", " + c.what);
      }
    }
  }
}

TEST(Domain, TheEdgeIsInside) {
  const auto inv_freq = torch::tensor({1.0, 0.1}, kDouble);
  for (const auto& op : kPositionOps) {
    const auto given = torch::tensor({-kLimit, kLimit - 5, kLimit});
    EXPECT_LT(max_abs_diff(encode(op, given, 3, inv_freq, 0, at::kDouble), expected_encoding(op, given, inv_freq)),
              1e-12)
        << op;
    if (op == "sinusoidal") continue;
    // Absent positions offset + arange(4) end exactly at 2^53.
    const auto absent = torch::arange(kLimit - 3, kLimit + 1);
    EXPECT_LT(max_abs_diff(encode(op, std::nullopt, 4, inv_freq, kLimit - 3, at::kDouble),
                           expected_encoding(op, absent, inv_freq)),
              1e-12)
        << op;
  }
}

TEST(Domain, Float32IsWithin1e6OfTheFloat64AngleForAnyAngle) {
  // p = 1 puts the angles at 2^20 ... 2^60 exactly; positions next to 2^53 push them further.
  const auto inv_freq = torch::tensor({std::ldexp(1.0, 20), std::ldexp(1.0, 30), std::ldexp(1.0, 40),
                                       std::ldexp(1.0, 50), std::ldexp(1.0, 56), std::ldexp(1.0, 60), 1.0, 0.1, -7.5},
                                      kDouble);
  const auto positions = torch::tensor({int64_t{1}, int64_t{3}, kLimit - 1, kLimit, -kLimit, int64_t{1000003}});
  for (const auto& op : kPositionOps) {
    const auto out = encode(op, positions, positions.size(0), inv_freq, 0, at::kFloat);
    EXPECT_LE(max_abs_diff(out, expected_encoding(op, positions, inv_freq)), 1e-6) << op;
  }
}

TEST(Domain, NanAndInfPositionsGiveNan) {
  const auto inv_freq = torch::tensor({1.0, 0.5}, kDouble);
  const double inf = std::numeric_limits<double>::infinity();
  const auto positions = torch::tensor({std::nan(""), inf, -inf}, kDouble);
  for (const std::string op : {"sinusoidal", "add_sinusoidal", "embed_sinusoidal"}) {
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      EXPECT_TRUE(encode(op, positions, 3, inv_freq, 3, dtype).isnan().all().item<bool>()) << op;
    }
  }
}

TEST(Domain, LearnedRowsOutsideTheTableAreAnError) {
  const auto weight = torch::randn({8, 4});
  expect_error([&] { posenc::learned(weight, torch::tensor({8})); }, "learned", "position", "row L_max");
  expect_error([&] { posenc::learned(weight, torch::tensor({kInt64Min + 5}), kInt64Min); }, "learned", "position",
               "int64 sum wraps to 5");
  expect_error([&] { posenc::add_learned(torch::randn({1, 3, 4}), weight, std::nullopt, kInt64Max); }, "add_learned",
               "position", "absent positions overflow");
  expect_error([&] {
    posenc::embed_learned(torch::zeros({1, 2}, torch::kLong), torch::randn({3, 4}), weight, torch::tensor({kInt64Max, int64_t{0}}),
                          1.0, std::nullopt, kInt64Max);
  }, "embed_learned", "position", "int64 sum wraps to -2");
}

TEST(Domain, InPlaceOpsRefuseOverlappingMemory) {
  const auto buffer = torch::randn({64});
  const auto before = buffer.clone();
  const auto inv_freq = torch::tensor({1.0, 0.5}, kDouble);
  // A token stride of 2 under a head_dim of 4, and heads stacked on one another: no size-1 broadcast.
  expect_error([&] { posenc::rope_(buffer.as_strided({1, 4, 1, 4}, {64, 2, 4, 1}), std::nullopt, inv_freq); },
               "rope_", "x", "token stride 2");
  expect_error([&] { posenc::rope_(buffer.as_strided({1, 2, 2, 4}, {64, 16, 3, 1}), std::nullopt, inv_freq); },
               "rope_", "x", "overlapping heads");
  expect_error([&] { posenc::add_alibi_(buffer.as_strided({1, 2, 3, 4}, {64, 16, 2, 1}), posenc::alibi_slopes(2)); },
               "add_alibi_", "scores", "overlapping query rows");
  EXPECT_TRUE(torch::equal(buffer, before));
  // Non-overlapping strides in an unusual order still work, and equal the functional op.
  auto view = buffer.as_strided({2, 3, 2, 4}, {1, 16, 8, 2});
  const auto expected = posenc::rope(view, std::nullopt, inv_freq);
  posenc::rope_(view, std::nullopt, inv_freq);
  EXPECT_TRUE(torch::allclose(view, expected, 1e-6, 1e-6));
}

// TorchScript run by the C++ interpreter: the same checks through ops called from a script compiled here.
std::shared_ptr<torch::jit::CompilationUnit> compile(const std::string& source) {
  auto unit = std::make_shared<torch::jit::CompilationUnit>();
  unit->define(std::nullopt, source, std::make_shared<PosencResolver>(), nullptr);
  return unit;
}

const char* kScript = R"JIT(
def rope(x: Tensor, positions: Optional[Tensor], inv_freq: Tensor, offset: int):
    return posenc.rope(x, positions, inv_freq, 1.0, "neox", "bshd", offset)

def rope_inplace(x: Tensor, positions: Optional[Tensor], inv_freq: Tensor, offset: int):
    posenc.rope_(x, positions, inv_freq, 1.0, "neox", "bshd", offset)
    return x

def add_sinusoidal(x: Tensor, positions: Optional[Tensor], inv_freq: Tensor, offset: int):
    return posenc.add_sinusoidal(x, positions, inv_freq, 1.0, "half", offset)

def sinusoidal(positions: Tensor, inv_freq: Tensor, offset: int):
    return posenc.sinusoidal(positions, inv_freq, "half", None, offset)

def add_learned(x: Tensor, weight: Tensor, offset: int):
    return posenc.add_learned(x, weight, None, offset)
)JIT";

TEST(Domain, TorchScriptInCppRefusesPositionsOutsideTheDomain) {
  const auto unit = compile(kScript);
  const auto inv_freq = torch::tensor({1.0, 0.5}, kDouble);
  const auto x = torch::randn({1, 3, 1, 4});
  const at::Tensor wraps = torch::tensor({kInt64Min + 5, int64_t{0}, int64_t{1}});
  expect_error([&] { unit->run_method("rope", x, torch::tensor({0, 1, 2}), inv_freq, kLimit - 1); }, "rope",
               "position", "script rope, offset passes the edge");
  expect_error([&] { unit->run_method("rope", x, wraps, inv_freq, kInt64Min); }, "rope", "position",
               "script rope, int64 sum wraps to 5");
  expect_error([&] { unit->run_method("rope_inplace", x.clone(), torch::IValue(), inv_freq, kInt64Max - 1); },
               "rope_", "position", "script rope_, absent positions overflow");
  expect_error([&] { unit->run_method("add_sinusoidal", torch::zeros({3, 4}), torch::IValue(), inv_freq, kLimit); },
               "add_sinusoidal", "position", "script add_sinusoidal, absent positions pass the edge");
  expect_error([&] {
    unit->run_method("sinusoidal", torch::tensor({static_cast<double>(kLimit) + 2.0}, kDouble), inv_freq, 0);
  }, "sinusoidal", "position", "script sinusoidal, float64 2^53 + 2");
  expect_error([&] { unit->run_method("add_learned", torch::randn({1, 3, 4}), torch::randn({8, 4}), kInt64Max); },
               "add_learned", "position", "script add_learned, absent positions overflow");
}

TEST(Domain, TorchScriptInCppIsWithin1e6OfTheFloat64Angle) {
  const auto unit = compile(kScript);
  const auto inv_freq = torch::tensor({std::ldexp(1.0, 40), std::ldexp(1.0, 56), std::ldexp(1.0, 60), 1.0}, kDouble);
  const auto positions = torch::tensor({int64_t{1}, int64_t{5}, kLimit - 1, kLimit});
  const auto x = torch::cat({torch::ones({1, 4, 1, 4}), torch::zeros({1, 4, 1, 4})}, -1);
  const auto rotated = unit->run_method("rope", x, positions, inv_freq, 0).toTensor()[0].select(1, 0);
  EXPECT_LE(max_abs_diff(rotated, expected_encoding("rope", positions, inv_freq)), 1e-6);
  const auto added = unit->run_method("add_sinusoidal", torch::zeros({4, 8}), positions, inv_freq, 0).toTensor();
  EXPECT_LE(max_abs_diff(added, expected_encoding("add_sinusoidal", positions, inv_freq)), 1e-6);
}

TEST(Domain, ScriptedRotaryModuleFromCppRefusesPositionsOutsideTheDomain) {
  const char* dir = std::getenv("POSENC_FIXTURES");
  ASSERT_NE(dir, nullptr) << "POSENC_FIXTURES is not set: run the tests through ctest";
  auto module = torch::jit::load(std::string(dir) + "/rope.pt");
  const auto q = torch::randn({1, 2, 4, 8});
  const auto k = torch::randn({1, 2, 2, 8});
  const auto packed = torch::randn({3, 3, 8});
  const auto cu_seqlens = torch::tensor({0, 3}, torch::kInt);
  // The fixture adds an offset of 2 to these positions: 2^53 - 1 + 2 is outside.
  const auto positions = torch::tensor({{int64_t{0}, kLimit - 1}});
  expect_error([&] { module.forward({q, k, positions, packed, cu_seqlens}); }, "rope_qk", "position",
               "scripted RotaryEmbedding");
}

}  // namespace

// The CUDA ops' check switches exist in every build: the C++ functions and the ops posenc_cuda::* (what Python's
// posenc.cuda and TorchScript call) read and set the same state; without a GPU that has run a check, check_errors()
// has nothing to wait for or raise.
TEST(Domain, CudaCheckSwitchesAreOneStateInEveryBuild) {
  const bool before = posenc::cuda::sync_checks();
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("posenc_cuda::sync_checks", "");
  const auto sync_checks = op.typed<bool()>();
  const auto set = c10::Dispatcher::singleton().findSchemaOrThrow("posenc_cuda::set_sync_checks", "").typed<void(bool)>();
  for (const bool enabled : {true, false}) {
    posenc::cuda::set_sync_checks(enabled);
    EXPECT_EQ(sync_checks.call(), enabled);
    set.call(!enabled);
    EXPECT_EQ(posenc::cuda::sync_checks(), !enabled);
  }
  posenc::cuda::set_sync_checks(before);
  if (!torch::cuda::is_available()) EXPECT_NO_THROW(posenc::cuda::check_errors());
}
