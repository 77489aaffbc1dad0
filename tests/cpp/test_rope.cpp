// The rotary family from plain C++: values against float64 formulas written here, autograd through the
// dispatcher, frequencies of every scaling type, the module, context parallelism and bad input.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <optional>
#include <string>

#include "rope_reference.h"
#include "test_helpers.h"

namespace {

using posenc::test::expect_error;
using posenc::test::reference_rope;
using posenc::frequencies::RopeScaling;

// A RopeScaling of `rope_type` with `factor` and, where given, the original context; the other keys unset.
RopeScaling scaling_of(const std::string& rope_type, double factor, std::optional<double> original = std::nullopt) {
  RopeScaling scaling;
  scaling.rope_type = rope_type;
  scaling.factor = factor;
  scaling.original_max_position_embeddings = original;
  return scaling;
}

// LongRoPE over 4 pairs: short factors 1 to 2.5, long factors 3 to 6, switching past `original` positions.
RopeScaling longrope_scaling(int64_t original, int64_t max_positions) {
  RopeScaling scaling;
  scaling.rope_type = "longrope";
  scaling.original_max_position_embeddings = original;
  scaling.max_position_embeddings = max_positions;
  scaling.short_factor = {1.0, 1.5, 2.0, 2.5};
  scaling.long_factor = {3.0, 4.0, 5.0, 6.0};
  return scaling;
}

const auto kDouble = torch::TensorOptions().dtype(torch::kDouble);

TEST(Rope, MatchesTheFormulaForBothLayoutsWithPartialRotation) {
  torch::manual_seed(0);
  const auto x = torch::randn({2, 5, 3, 10}, kDouble);
  const auto inv_freq = posenc::frequencies::rope(6).inv_freq;
  for (const std::string layout : {"neox", "gptj"}) {
    const auto positions = torch::arange(7, 12, torch::kLong);
    const auto expected = reference_rope(x, positions, inv_freq, layout, 0.5);
    EXPECT_TRUE(torch::allclose(posenc::rope(x, std::nullopt, inv_freq, 0.5, layout, "bshd", 7), expected));
    EXPECT_TRUE(torch::allclose(posenc::rope(x, positions, inv_freq, 0.5, layout), expected));
  }
}

TEST(Rope, FormatsAndPerRowPositionsAgree) {
  torch::manual_seed(1);
  const auto x = torch::randn({2, 4, 3, 8}, kDouble);  // bshd
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto positions = torch::randint(0, 1000, {2, 4}, torch::kLong);
  const auto expected = posenc::rope(x, positions, inv_freq);
  EXPECT_TRUE(torch::allclose(expected, reference_rope(x, positions, inv_freq, "neox")));
  // bhsd and sbhd views of the same data, read through their strides.
  const auto bhsd = posenc::rope(x.transpose(1, 2), positions, inv_freq, 1.0, "neox", "bhsd");
  EXPECT_TRUE(torch::allclose(bhsd.transpose(1, 2), expected));
  EXPECT_TRUE(bhsd.is_contiguous());
  const auto sbhd = posenc::rope(x.transpose(0, 1), positions, inv_freq, 1.0, "neox", "sbhd");
  EXPECT_TRUE(torch::allclose(sbhd.transpose(0, 1), expected));
}

TEST(Rope, PackedSequencesRestartAtEachBoundary) {
  torch::manual_seed(2);
  const auto x = torch::randn({9, 2, 8}, kDouble);
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto cu_seqlens = torch::tensor({0, 4, 4, 9}, torch::kInt);
  const auto out = posenc::rope(x, std::nullopt, inv_freq, 1.0, "gptj", "thd", 3, cu_seqlens);
  for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, 4}, {4, 9}}) {
    const auto alone = posenc::rope(x.slice(0, begin, end), std::nullopt, inv_freq, 1.0, "gptj", "thd", 3);
    EXPECT_TRUE(torch::allclose(out.slice(0, begin, end), alone));
  }
}

TEST(Rope, BackwardIsTheInverseRotationAndDoubleBackwardWorks) {
  torch::manual_seed(3);
  const auto x = torch::randn({2, 3, 2, 8}, kDouble).requires_grad_();
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto grad = torch::randn({2, 3, 2, 8}, kDouble);
  const auto y = posenc::rope(x, std::nullopt, inv_freq, 0.7, "gptj", "bshd", 5);
  const auto grad_x = torch::autograd::grad({y}, {x}, {grad}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  // Rotation by -angle: the same op with negated frequencies.
  EXPECT_TRUE(torch::allclose(grad_x, posenc::rope(grad, std::nullopt, -inv_freq, 0.7, "gptj", "bshd", 5)));
  EXPECT_TRUE(torch::allclose(grad_x, posenc::rope_backward(grad, std::nullopt, inv_freq, 0.7, "gptj", "bshd", 5)));
  // d(grad_x . v)/d grad = rope(v): the backward of the backward is the forward.
  const auto v = torch::randn_like(grad);
  const auto grad_grad = torch::randn_like(grad).requires_grad_();
  const auto gx = posenc::rope_backward(grad_grad, std::nullopt, inv_freq, 0.7, "gptj", "bshd", 5);
  const auto second = torch::autograd::grad({gx}, {grad_grad}, {v})[0];
  EXPECT_TRUE(torch::allclose(second, posenc::rope(v, std::nullopt, inv_freq, 0.7, "gptj", "bshd", 5)));
}

TEST(Rope, QkInPlaceAndCosSinAgreeWithRope) {
  torch::manual_seed(4);
  const auto q = torch::randn({2, 6, 4, 16});
  const auto k = torch::randn({2, 6, 1, 16});  // MQA: one key head
  const auto inv_freq = posenc::frequencies::rope(12).inv_freq;
  const auto positions = torch::arange(100, 106, torch::kLong);
  const auto [q_out, k_out] = posenc::rope_qk(q, k, positions, inv_freq);
  EXPECT_TRUE(torch::equal(q_out, posenc::rope(q, positions, inv_freq)));
  EXPECT_TRUE(torch::equal(k_out, posenc::rope(k, positions, inv_freq)));

  auto inplace = q.clone();
  posenc::rope_(inplace, positions, inv_freq);
  EXPECT_TRUE(torch::equal(inplace, q_out));

  // Hugging Face tables: cos/sin of cat(angles, angles), width rotary_dim.
  const auto angle = positions.to(torch::kDouble).unsqueeze(-1) * inv_freq;
  const auto emb = torch::cat({angle, angle}, -1).to(torch::kFloat);
  const auto via_tables = posenc::rope_cos_sin(q, emb.cos(), emb.sin());
  EXPECT_TRUE(torch::allclose(via_tables, q_out, 1e-5, 1e-5));
}

TEST(Rope, RopeCosSinBackwardIsTheTranspose) {
  torch::manual_seed(5);
  const auto x = torch::randn({1, 4, 2, 8}, kDouble).requires_grad_();
  const auto cos = torch::randn({4, 6}, kDouble);  // arbitrary tables: the adjoint must hold for any
  const auto sin = torch::randn({4, 6}, kDouble);
  const auto grad = torch::randn({1, 4, 2, 8}, kDouble);
  for (const std::string layout : {"neox", "gptj"}) {
    const auto y = posenc::rope_cos_sin(x, cos, sin, layout);
    const auto grad_x = torch::autograd::grad({y}, {x}, {grad})[0];
    // <y(x), g> = <x, grad_x> for a linear map, checked against y's directional derivative.
    const auto dir = torch::randn_like(x);
    const auto lhs = (posenc::rope_cos_sin(dir, cos, sin, layout) * grad).sum();
    EXPECT_NEAR(lhs.item<double>(), (dir * grad_x).sum().item<double>(), 1e-10);
  }
}

TEST(Rope, InPlaceTrainsThroughANonLeafTensor) {
  const auto leaf = torch::randn({1, 3, 2, 4}, kDouble).requires_grad_();
  const auto inv_freq = posenc::frequencies::rope(4).inv_freq;
  auto x = leaf * 2;
  const auto version = x._version();
  posenc::rope_(x, std::nullopt, inv_freq);
  EXPECT_GT(x._version(), version);
  const auto grad = torch::randn_like(x);
  x.backward(grad);
  EXPECT_TRUE(torch::allclose(leaf.grad(), 2 * posenc::rope_backward(grad, std::nullopt, inv_freq)));
}

TEST(Frequencies, EveryScalingTypeMatchesItsFormula) {
  using posenc::frequencies::rope;
  const int64_t r = 8;
  const auto i = torch::arange(0, r, 2, kDouble);
  const auto plain = torch::pow(10000.0, -i / r);
  EXPECT_TRUE(torch::allclose(rope(r).inv_freq, plain, 1e-14, 0));

  const auto linear = scaling_of("linear", 4.0);
  EXPECT_TRUE(torch::allclose(rope(r, 10000.0, linear).inv_freq, plain / 4.0, 1e-14, 0));

  auto dynamic = scaling_of("dynamic", 2.0);
  dynamic.max_position_embeddings = 1024;
  EXPECT_TRUE(torch::allclose(rope(r, 10000.0, dynamic, 512).inv_freq, plain, 1e-14, 0));
  const double grown = 10000.0 * std::pow(2.0 * 4096 / 1024 - 1.0, 8.0 / 6.0);
  EXPECT_TRUE(torch::allclose(rope(r, 10000.0, dynamic, 4096).inv_freq, torch::pow(grown, -i / r), 1e-13, 0));

  RopeScaling ntk;
  ntk.rope_type = "ntk";
  ntk.alpha = 3.0;
  EXPECT_TRUE(torch::allclose(rope(r, 10000.0, ntk).inv_freq,
                              torch::pow(10000.0 * std::pow(3.0, 8.0 / 6.0), -i / r), 1e-13, 0));

  auto yarn = scaling_of("yarn", 4.0, 64);
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 0.5;
  const auto yarn_freqs = rope(r, 10000.0, yarn);
  // corr(n) = r ln(64 / (2 pi n)) / (2 ln 1e4): low = floor(corr(32)) -> 0, high = ceil(corr(1)) = 2.
  const auto ramp = (torch::arange(4, kDouble) / 2.0).clamp(0, 1);
  EXPECT_TRUE(torch::allclose(yarn_freqs.inv_freq, plain / 4.0 * ramp + plain * (1 - ramp), 1e-14, 0));
  EXPECT_NEAR(yarn_freqs.attention_scale, (0.1 * std::log(4.0) + 1) / (0.05 * std::log(4.0) + 1), 1e-15);

  auto llama3 = scaling_of("llama3", 8.0, 64);
  llama3.low_freq_factor = 1.0;
  llama3.high_freq_factor = 4.0;
  const auto wavelength = 2 * M_PI / plain;
  const auto smooth = (64.0 / wavelength - 1.0) / 3.0;
  const auto medium = (1 - smooth) * plain / 8.0 + smooth * plain;
  const auto expected = torch::where(wavelength < 16.0, plain, torch::where(wavelength > 64.0, plain / 8.0, medium));
  EXPECT_TRUE(torch::allclose(rope(r, 10000.0, llama3).inv_freq, expected, 1e-14, 0));

  const auto longrope = longrope_scaling(100, 400);
  const auto short_freqs = rope(r, 10000.0, longrope, 100);
  const auto long_freqs = rope(r, 10000.0, longrope, 101);
  EXPECT_TRUE(torch::allclose(short_freqs.inv_freq, plain / torch::tensor({1.0, 1.5, 2.0, 2.5}, kDouble), 1e-14, 0));
  EXPECT_TRUE(torch::allclose(long_freqs.inv_freq, plain / torch::tensor({3.0, 4.0, 5.0, 6.0}, kDouble), 1e-14, 0));
  EXPECT_NEAR(long_freqs.attention_scale, std::sqrt(1 + std::log(4.0) / std::log(100.0)), 1e-15);

  // Gemma 4's proportional: int(0.6 * 8 // 2) = 2 of the 4 pairs turn, at the whole head's exponents / factor.
  RopeScaling proportional;
  proportional.rope_type = "proportional";
  proportional.partial_rotary_factor = 0.6;
  proportional.factor = 2.0;
  const auto rotated = torch::tensor({1.0, 1.0, 0.0, 0.0}, kDouble);
  EXPECT_TRUE(torch::allclose(rope(r, 10000.0, proportional).inv_freq, plain / 2.0 * rotated, 1e-14, 0));
  EXPECT_TRUE(torch::equal(rope(r, 10000.0, proportional).inv_freq.slice(0, 2), torch::zeros({2}, kDouble)));
}

TEST(RotaryEmbedding, ForwardMatchesRopeQkAndFrequenciesSurviveBFloat16) {
  RopeScaling scaling;
  scaling.rope_type = "dynamic";
  scaling.factor = 2.0;
  scaling.max_position_embeddings = 8;
  posenc::nn::RotaryEmbedding module(16, 8, 10000.0, "gptj", scaling);
  module->to(torch::kBFloat16);
  EXPECT_EQ(module->inv_freq().scalar_type(), torch::kDouble);
  const auto q = torch::randn({1, 20, 2, 16});
  const auto k = torch::randn({1, 20, 1, 16});
  const auto [q_out, k_out] = module(q, k);
  // 20 tokens exceed max_position_embeddings 8: the dynamic base is that of seq_len 20.
  const auto freqs = posenc::frequencies::rope(8, 10000.0, scaling, 20).inv_freq;
  const auto [q_ref, k_ref] = posenc::rope_qk(q, k, std::nullopt, freqs, 1.0, "gptj");
  EXPECT_TRUE(torch::equal(q_out, q_ref));
  EXPECT_TRUE(torch::equal(k_out, k_ref));
  EXPECT_FALSE(torch::equal(freqs, module->inv_freq()));
}

// The per-call length (a tensor, never read back by the module): max position + 1 + offset with positions, the
// longest packed sequence + offset with cu_seqlens; LongRoPE switches to its long factors past the context.
TEST(RotaryEmbedding, PerCallLengthFromPositionsAndPackedSequences) {
  const auto scaling = longrope_scaling(16, 64);
  posenc::nn::RotaryEmbedding module(8, std::nullopt, 10000.0, "neox", scaling);
  const auto q = torch::randn({1, 4, 2, 8});
  const auto k = torch::randn({1, 4, 1, 8});
  const auto expect = [&](const std::optional<at::Tensor>& positions, int64_t offset, int64_t length,
                          const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& qq, const at::Tensor& kk,
                          const char* format) {
    const auto freqs = posenc::frequencies::rope(8, 10000.0, scaling, length);
    const auto [q_ref, k_ref] =
        posenc::rope_qk(qq, kk, positions, freqs.inv_freq, freqs.attention_scale, "neox", format, offset, cu_seqlens);
    posenc::nn::RotaryEmbedding packed(8, std::nullopt, 10000.0, "neox", scaling, format);
    const auto [q_out, k_out] = (cu_seqlens ? packed : module)(qq, kk, positions, offset, cu_seqlens);
    EXPECT_TRUE(torch::equal(q_out, q_ref)) << length;
    EXPECT_TRUE(torch::equal(k_out, k_ref)) << length;
  };
  expect(torch::tensor({0, 3, 14, 2}), 1, 16, std::nullopt, q, k, "bshd");  // 14 + 1 + 1: the short factors
  expect(torch::tensor({0, 3, 15, 2}), 1, 17, std::nullopt, q, k, "bshd");  // one past the context: the long ones
  expect(std::nullopt, 14, 18, std::nullopt, q, k, "bshd");                  // 4 tokens after a cache of 14
  const auto cu_seqlens = torch::tensor({0, 3, 20, 24}, torch::kInt);       // the longest sequence holds 17 tokens
  const auto packed_q = torch::randn({24, 2, 8});
  const auto packed_k = torch::randn({24, 1, 8});
  expect(std::nullopt, 0, 17, cu_seqlens, packed_q, packed_k, "thd");
}

TEST(ContextParallel, ShardedRotationEqualsTheUnshardedOne) {
  torch::manual_seed(6);
  const auto x = torch::randn({2, 16, 2, 8});
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto full = posenc::rope(x, std::nullopt, inv_freq);
  std::vector<int64_t> seen;
  for (const int64_t rank : {0, 1, 2, 3}) {
    const auto positions = posenc::zigzag_positions(16, 4, rank);
    const auto local = posenc::rope(x.index_select(1, positions), positions, inv_freq);
    EXPECT_TRUE(torch::equal(local, full.index_select(1, positions)));
    for (const auto p : c10::irange(positions.numel())) seen.push_back(positions[p].item<int64_t>());
  }
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(16);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(seen, all);

  // Packed: sequences of 8 and 16 tokens over 2 ranks.
  const auto packed = torch::randn({24, 2, 8});
  const auto cu_seqlens = torch::tensor({0, 8, 24}, torch::kInt);
  const auto full_packed = posenc::rope(packed, std::nullopt, inv_freq, 1.0, "neox", "thd", 0, cu_seqlens);
  for (const int64_t rank : {0, 1}) {
    const auto [positions, indices, local_cu] = posenc::zigzag_positions_varlen(cu_seqlens, 2, rank);
    EXPECT_TRUE(torch::equal(local_cu, torch::tensor({0, 4, 12}, torch::kInt)));
    const auto local = posenc::rope(packed.index_select(0, indices), positions, inv_freq, 1.0, "neox", "thd");
    EXPECT_TRUE(torch::equal(local, full_packed.index_select(0, indices)));
  }
}

// Each bad input is a c10::Error naming the op, the argument and the value.
TEST(Rope, BadInputIsAnErrorNamingTheArgument) {
  const auto x = torch::randn({1, 4, 2, 8});
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  expect_error([&] { posenc::rope(x, std::nullopt, posenc::frequencies::rope(10).inv_freq); },
               "posenc.rope: rotary_dim 10 exceeds the head_dim 8 of x");
  expect_error([&] { posenc::frequencies::rope(7); }, "rotary_dim must be even and at least 2, got 7");
  expect_error([&] { posenc::rope(x, torch::arange(4, torch::kHalf), inv_freq); },
               "positions must be an int64, int32, float32 or float64 tensor, got Half");
  expect_error([&] { posenc::rope(x, torch::tensor({0.0, 1.0, std::numeric_limits<double>::infinity(), 3.0}), inv_freq); },
               "posenc.rope: position inf is outside [-2^53, 2^53]");
  expect_error([&] { posenc::rope(x, torch::arange(5, torch::kLong), inv_freq); }, "positions has shape [5]");
  expect_error([&] { posenc::rope(x.to(torch::kInt), std::nullopt, inv_freq); }, "x must be a floating tensor");
  expect_error([&] { posenc::rope(x, std::nullopt, inv_freq, 1.0, "rotate_half"); }, "got \"rotate_half\"");
  const auto packed = torch::randn({6, 2, 8});
  const auto decreasing = torch::tensor({0, 4, 2, 6});
  expect_error([&] { posenc::rope(packed, std::nullopt, inv_freq, 1.0, "neox", "thd", 0, decreasing); },
               "cu_seqlens must not decrease, got 4 then 2");
  expect_error([&] { posenc::rope(packed, std::nullopt, inv_freq, 1.0, "neox", "thd", 0, torch::tensor({0, 4, 5})); },
               "cu_seqlens must end at the token count T = 6, got 5");
  expect_error([&] { posenc::zigzag_positions(10, 2, 0); }, "seq_len 10 must be a multiple of 2 * cp_size = 4");
  RopeScaling unknown;
  unknown.rope_type = "su";
  expect_error([&] { posenc::frequencies::rope(8, 10000.0, unknown); }, "unknown rope_type \"su\"");
}

// Scaling values are refused with a c10::ValueError naming the type, the key and the value; a default applies
// only to an unset key, never to a zero.
TEST(Frequencies, InvalidScalingValuesAreRefused) {
  using posenc::frequencies::rope;
  const auto expect_value_error = [](const std::function<void()>& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one mentioning: " << fragment;
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(fragment), std::string::npos)
          << e.what_without_backtrace();
    }
  };
  RopeScaling llama3;
  llama3.rope_type = "llama3";
  EXPECT_TRUE(torch::equal(rope(64, 5e5, llama3).inv_freq, [&] {
    RopeScaling given = llama3;
    given.factor = 8.0;
    given.low_freq_factor = 1.0;
    given.high_freq_factor = 4.0;
    given.original_max_position_embeddings = 8192;
    return rope(64, 5e5, given).inv_freq;
  }()));
  llama3.factor = 0.0;
  expect_value_error([&] { rope(64, 5e5, llama3); },
                     "posenc.frequencies.rope: llama3 factor must be positive, got 0.0");
  llama3.factor = 8.0;
  llama3.high_freq_factor = 0.5;
  expect_value_error([&] { rope(64, 5e5, llama3); }, "llama3 high_freq_factor 0.5 must exceed low_freq_factor 1.0");

  auto linear = scaling_of("linear", -2.0);
  expect_value_error([&] { rope(8, 1e4, linear); }, "linear factor must be positive, got -2.0");
  linear.factor = std::nan("");
  expect_value_error([&] { rope(8, 1e4, linear); }, "linear factor must be finite, got nan");
  expect_value_error([&] { rope(8, -1e4); }, "base must be positive, got -10000.0");
  expect_value_error([&] { rope(8, 1e4, {}, -3); }, "seq_len must be non-negative, got -3");

  auto yarn = scaling_of("yarn", 4.0, 64);
  yarn.beta_fast = 0.0;
  expect_value_error([&] { rope(8, 1e4, yarn); }, "yarn beta_fast must be positive, got 0.0");

  RopeScaling longrope;
  longrope.rope_type = "longrope";
  longrope.original_max_position_embeddings = 64;
  longrope.factor = 2.0;
  longrope.short_factor = {1.0, 1.0, 1.0, 1.0};
  longrope.long_factor = {1.0, -1.0, 1.0, 1.0};
  expect_value_error([&] { rope(8, 1e4, longrope); }, "longrope long_factor[1] must be positive, got -1.0");
  expect_value_error([] { posenc::frequencies::sinusoidal(8, 0.0); },
                     "posenc.frequencies.sinusoidal: base must be positive, got 0.0");
  expect_value_error([] { posenc::alibi_slopes(0); }, "posenc.alibi_slopes: num_heads must be positive, got 0");
}

// rope_for_length reads its length from a tensor (no copy to the host) and gives rope's bits for that length.
TEST(Frequencies, ForLengthEqualsRopeBitForBit) {
  using posenc::frequencies::rope;
  using posenc::frequencies::rope_for_length;
  auto dynamic = scaling_of("dynamic", 3.0);
  dynamic.max_position_embeddings = 100;
  const auto longrope = longrope_scaling(100, 400);
  for (const auto& scaling : {dynamic, longrope}) {
    for (const int64_t length : {0, 50, 100, 101, 4000}) {
      const auto expected = rope(8, 1e4, scaling, length).inv_freq;
      EXPECT_TRUE(torch::equal(rope_for_length(8, 1e4, scaling, torch::tensor(length)), expected));
      EXPECT_TRUE(torch::equal(rope_for_length(8, 1e4, scaling, torch::tensor(static_cast<double>(length))), expected));
    }
  }
  const double grown = 1e4 * std::pow(3.0 * 4000 / 100 - 2.0, 8.0 / 6.0);
  EXPECT_TRUE(torch::allclose(rope_for_length(8, 1e4, dynamic, torch::tensor(4000)),
                              torch::pow(grown, -torch::arange(0, 8, 2, torch::kDouble) / 8), 1e-13, 0));
  EXPECT_THROW(rope_for_length(8, 1e4, dynamic, torch::tensor({4000})), c10::Error);
}

}  // namespace

// Learned frequencies from C++: d loss / d inv_freq of rope_qk against a central difference in float64.
TEST(Rope, LearnedFrequenciesGradientFromCpp) {
  const auto q = torch::randn({2, 5, 3, 8}, at::kDouble);
  const auto k = torch::randn({2, 5, 1, 8}, at::kDouble);
  const auto positions = torch::tensor({0.5, 1.0, -2.25, 3.0, 7.5}, at::kDouble);
  auto inv_freq = posenc::frequencies::rope(8).inv_freq.clone().requires_grad_(true);
  const auto loss = [&](const at::Tensor& w) {
    const auto [out_q, out_k] = posenc::rope_qk(q, k, positions, w, 1.0, "gptj");
    return (out_q * out_q.cos()).sum() + out_k.sum();
  };
  loss(inv_freq).backward();
  const double h = 1e-6;
  for (int64_t i = 0; i < 4; ++i) {
    auto up = inv_freq.detach().clone();
    auto down = inv_freq.detach().clone();
    up[i] += h;
    down[i] -= h;
    const double numeric = (loss(up) - loss(down)).item<double>() / (2 * h);
    EXPECT_NEAR(inv_freq.grad()[i].item<double>(), numeric, 1e-6 * std::max(1.0, std::abs(numeric)));
  }
}
