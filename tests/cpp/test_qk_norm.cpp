// QK-norm + RoPE from plain C++ (posenc::qk_norm_rope, qk_norm_rope_backward, qk_norm_rope_): values against a
// float64 formula written here (per head and over all heads of a token, every convention), the rounding of the
// Qwen3 convention in bf16, formats and packed sequences, the backward against autograd of the float64 formula,
// thread-count-free weight gradients, the in-place form under autograd and bad input.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <string>
#include <vector>

#include "rope_reference.h"
#include "test_helpers.h"

namespace {

using posenc::test::expect_error;
using posenc::test::max_abs_diff;
using posenc::test::reference_qk_norm_rope;

const auto kDouble = torch::TensorOptions().dtype(torch::kDouble);
const std::vector<std::string> kNorms{"llama", "gemma", "olmo2", "fused"};

// After torch::manual_seed(seed), in this order: float32 q and k of the given shapes (normal), then the q and k weights
// of q_width and k_width elements in [0.5, 1.5).
std::array<at::Tensor, 4> seeded_qk_and_weights(uint64_t seed, at::IntArrayRef q_shape, at::IntArrayRef k_shape,
                                                int64_t q_width, int64_t k_width) {
  torch::manual_seed(seed);
  return {torch::randn(q_shape), torch::randn(k_shape), torch::rand({q_width}) + 0.5, torch::rand({k_width}) + 0.5};
}

TEST(QkNormRope, MatchesTheFormulaForEveryConventionPerHeadAndOverHeads) {
  torch::manual_seed(0);
  const auto q = torch::randn({2, 5, 4, 10}, kDouble) * 3;
  const auto k = torch::randn({2, 5, 2, 10}, kDouble);  // GQA
  const auto inv_freq = posenc::frequencies::rope(8, 500.0).inv_freq;  // partial: 2 of 10 channels not rotated
  const auto positions = torch::randint(0, 3000, {2, 5}, torch::kLong);
  const auto per_head = torch::randn({10}, kDouble);
  const auto all_heads_q = torch::randn({40}, kDouble);
  const auto all_heads_k = torch::randn({20}, kDouble);
  for (const auto& norm : kNorms) {
    for (const std::string layout : {"neox", "gptj"}) {
      for (const bool olmo : {false, true}) {
        const auto& qw = olmo ? all_heads_q : per_head;
        const auto& kw = olmo ? all_heads_k : per_head;
        const auto [q_out, k_out] = posenc::qk_norm_rope(q, k, qw, kw, positions, inv_freq, 1e-6, norm, 0.75, layout);
        const auto what = norm + " " + layout + (olmo ? " over heads" : " per head");
        EXPECT_LE(max_abs_diff(q_out, reference_qk_norm_rope(q, qw, positions, inv_freq, norm, layout, 0.75)), 1e-12)
            << what;
        EXPECT_LE(max_abs_diff(k_out, reference_qk_norm_rope(k, kw, positions, inv_freq, norm, layout, 0.75)), 1e-12)
            << what;
      }
    }
  }
  // Gemma's weight is 1 + w: "gemma" with w - 1 is "llama" with w.
  const auto [llama_q, llama_k] = posenc::qk_norm_rope(q, k, per_head, per_head, positions, inv_freq);
  const auto [gemma_q, gemma_k] =
      posenc::qk_norm_rope(q, k, per_head - 1, per_head - 1, positions, inv_freq, 1e-6, "gemma");
  EXPECT_LE(max_abs_diff(gemma_q, llama_q), 1e-13);
  EXPECT_LE(max_abs_diff(gemma_k, llama_k), 1e-13);
  const auto gemma_of_w =
      std::get<0>(posenc::qk_norm_rope(q, k, per_head, per_head, positions, inv_freq, 1e-6, "gemma"));
  EXPECT_GT(max_abs_diff(gemma_q, gemma_of_w), 1e-3);
}

TEST(QkNormRope, Float32MatchesTheFormulaWithinItsRounding) {
  const auto [q, k, qw, kw] = seeded_qk_and_weights(1, {2, 7, 3, 64}, {2, 7, 1, 64}, 64, 64);
  const auto inv_freq = posenc::frequencies::rope(64, 1e6).inv_freq;
  const auto positions = torch::randint(0, 100000, {7}, torch::kLong);
  for (const auto& norm : kNorms) {
    const auto [q_out, k_out] = posenc::qk_norm_rope(q, k, qw, kw, positions, inv_freq, 1e-5, norm, 1.0, "neox");
    EXPECT_EQ(q_out.scalar_type(), torch::kFloat);
    // float32 maths: a few float32 roundings of values up to ~4, and sin/cos to 1e-6.
    EXPECT_LE(max_abs_diff(q_out, reference_qk_norm_rope(q.to(at::kDouble), qw.to(at::kDouble), positions,
                                                         inv_freq, norm, "neox", 1.0, 1e-5)),
              2e-5)
        << norm;
    EXPECT_LE(max_abs_diff(k_out, reference_qk_norm_rope(k.to(at::kDouble), kw.to(at::kDouble), positions,
                                                         inv_freq, norm, "neox", 1.0, 1e-5)),
              2e-5)
        << norm;
  }
}

// At position 0 (no rotation) the op returns the normalized rows as the conventions round them. Qwen3 ("llama"):
// x * rsqrt(mean(x^2) + eps) in float32 cast to bf16, times the bf16 weight (a bf16 product); OLMo 2: the product
// in float32, cast once. Our float32 value and ATen's differ in the order of the sum of squares by an ulp or so: the
// bf16 roundings agree except where that value lies next to a rounding boundary (a tiny fraction).
TEST(QkNormRope, BFloat16ConventionsRoundAsTheModelsDo) {
  torch::manual_seed(2);
  const auto x = (torch::randn({2, 6, 3, 32}) * 3).to(torch::kBFloat16);
  const auto w = (torch::randn({32}) * 0.5 + 1).to(torch::kBFloat16);
  const auto zero = torch::zeros({6}, torch::kLong);
  const auto inv_freq = posenc::frequencies::rope(32).inv_freq;
  const auto xf = x.to(torch::kFloat);
  const auto xhat = xf * (xf.pow(2).mean(-1, true) + 1e-6).rsqrt();
  const auto qwen3 = xhat.to(torch::kBFloat16) * w;
  const auto olmo2 = (w.to(torch::kFloat) * xhat).to(torch::kBFloat16);
  const auto llama_out = std::get<0>(posenc::qk_norm_rope(x, x, w, w, zero, inv_freq, 1e-6, "llama"));
  const auto olmo2_out = std::get<0>(posenc::qk_norm_rope(x, x, w, w, zero, inv_freq, 1e-6, "olmo2"));
  EXPECT_EQ(llama_out.scalar_type(), torch::kBFloat16);
  EXPECT_GE(llama_out.eq(qwen3).to(torch::kFloat).mean().item<float>(), 0.99);
  EXPECT_GE(olmo2_out.eq(olmo2).to(torch::kFloat).mean().item<float>(), 0.99);
  // The two conventions differ in many values (not an ulp here and there).
  EXPECT_LE(llama_out.eq(olmo2_out).to(torch::kFloat).mean().item<float>(), 0.9);
}

TEST(QkNormRope, FormatsAndPackedSequencesAgree) {
  torch::manual_seed(3);
  const auto q = torch::randn({2, 6, 4, 16});
  const auto k = torch::randn({2, 6, 2, 16});
  const auto qw = torch::rand({64}) + 0.5;  // over all heads
  const auto kw = torch::rand({16}) + 0.5;
  const auto inv_freq = posenc::frequencies::rope(16).inv_freq;
  const auto positions = torch::randint(0, 900, {2, 6}, torch::kLong);
  const auto [q_out, k_out] = posenc::qk_norm_rope(q, k, qw, kw, positions, inv_freq, 1e-6, "gemma", 1.0, "gptj");
  const auto [bhsd_q, bhsd_k] = posenc::qk_norm_rope(q.transpose(1, 2), k.transpose(1, 2), qw, kw, positions, inv_freq,
                                                     1e-6, "gemma", 1.0, "gptj", "bhsd");
  EXPECT_TRUE(torch::equal(bhsd_q.transpose(1, 2), q_out) && bhsd_q.is_contiguous());
  EXPECT_TRUE(torch::equal(bhsd_k.transpose(1, 2), k_out));
  const auto [sbhd_q, sbhd_k] = posenc::qk_norm_rope(q.transpose(0, 1), k.transpose(0, 1), qw, kw, positions,
                                                     inv_freq, 1e-6, "gemma", 1.0, "gptj", "sbhd");
  EXPECT_TRUE(torch::equal(sbhd_q.transpose(0, 1), q_out));
  EXPECT_TRUE(torch::equal(sbhd_k.transpose(0, 1), k_out));

  // Packed: positions restart at each sequence (offset 3), an empty sequence among them.
  const auto packed_q = torch::randn({9, 4, 16});
  const auto packed_k = torch::randn({9, 2, 16});
  const auto cu_seqlens = torch::tensor({0, 4, 4, 9}, torch::kInt);
  const auto [pq, pk] = posenc::qk_norm_rope(packed_q, packed_k, qw, kw, std::nullopt, inv_freq, 1e-6, "llama", 1.0,
                                             "neox", "thd", 3, cu_seqlens);
  for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, 4}, {4, 9}}) {
    const auto [aq, ak] = posenc::qk_norm_rope(packed_q.slice(0, begin, end), packed_k.slice(0, begin, end), qw, kw,
                                               std::nullopt, inv_freq, 1e-6, "llama", 1.0, "neox", "thd", 3);
    EXPECT_TRUE(torch::equal(pq.slice(0, begin, end), aq));
    EXPECT_TRUE(torch::equal(pk.slice(0, begin, end), ak));
  }
  const auto expected = reference_qk_norm_rope(packed_q.slice(0, 4, 9).unsqueeze(0).to(at::kDouble),
                                               qw.to(at::kDouble), torch::arange(5), inv_freq, "llama", "neox", 1.0,
                                               1e-6, 3);
  EXPECT_LE(max_abs_diff(pq.slice(0, 4, 9).unsqueeze(0), expected), 2e-5);
}

TEST(QkNormRope, BackwardMatchesAutogradOfTheFormula) {
  torch::manual_seed(4);
  const auto inv_freq = posenc::frequencies::rope(6).inv_freq;  // partial rotary: 3 pairs of 8 channels
  const auto positions = torch::randint(0, 500, {2, 3}, torch::kLong);
  for (const auto& norm : kNorms) {
    const auto q = torch::randn({2, 3, 2, 8}, kDouble).requires_grad_();
    const auto k = torch::randn({2, 3, 1, 8}, kDouble).requires_grad_();
    const auto qw = torch::randn({16}, kDouble).requires_grad_();  // over both heads
    const auto kw = torch::randn({8}, kDouble).requires_grad_();
    const auto grad_q = torch::randn({2, 3, 2, 8}, kDouble);
    const auto grad_k = torch::randn({2, 3, 1, 8}, kDouble);
    const auto [q_out, k_out] = posenc::qk_norm_rope(q, k, qw, kw, positions, inv_freq, 1e-6, norm, 1.3, "gptj");
    const auto got = torch::autograd::grad({q_out, k_out}, {q, k, qw, kw}, {grad_q, grad_k});
    const auto ref_q = reference_qk_norm_rope(q, qw, positions, inv_freq, norm, "gptj", 1.3);
    const auto ref_k = reference_qk_norm_rope(k, kw, positions, inv_freq, norm, "gptj", 1.3);
    const auto expected = torch::autograd::grad({ref_q, ref_k}, {q, k, qw, kw}, {grad_q, grad_k});
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_LE(max_abs_diff(got[i], expected[i]), 1e-11) << norm << " gradient " << i;
    }
    // The backward op gives autograd's bits.
    const auto [gq, gk, gqw, gkw] = posenc::qk_norm_rope_backward(grad_q, grad_k, q.detach(), k.detach(), qw.detach(),
                                                                   kw.detach(), positions, inv_freq, 1e-6, norm, 1.3,
                                                                   "gptj");
    EXPECT_TRUE(torch::equal(gq, got[0]) && torch::equal(gk, got[1]) && torch::equal(gqw, got[2]) &&
                torch::equal(gkw, got[3]))
        << norm;
  }
}

TEST(QkNormRope, WeightGradientsHaveTheSameBitsForAnyThreadCount) {
  const auto [q, k, qw, kw] = seeded_qk_and_weights(5, {4, 256, 4, 64}, {4, 256, 2, 64}, 64, 128);
  const auto grad_q = torch::randn_like(q);
  const auto grad_k = torch::randn_like(k);
  const auto inv_freq = posenc::frequencies::rope(64).inv_freq;
  const int previous = at::get_num_threads();
  std::vector<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>> runs;
  for (const int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    runs.push_back(posenc::qk_norm_rope_backward(grad_q, grad_k, q, k, qw, kw, std::nullopt, inv_freq));
  }
  at::set_num_threads(previous);
  for (size_t i = 1; i < runs.size(); ++i) {
    EXPECT_TRUE(torch::equal(std::get<2>(runs[i]), std::get<2>(runs[0]))) << "q_weight, run " << i;
    EXPECT_TRUE(torch::equal(std::get<3>(runs[i]), std::get<3>(runs[0]))) << "k_weight, run " << i;
    EXPECT_TRUE(torch::equal(std::get<0>(runs[i]), std::get<0>(runs[0]))) << "q, run " << i;
  }
  // And they are the sums they should be (float32 sums over 1024 tokens against float64).
  const auto kd = k.to(at::kDouble).requires_grad_();
  const auto kwd = kw.to(at::kDouble).requires_grad_();
  const auto ref = reference_qk_norm_rope(kd, kwd, torch::arange(256), inv_freq, "llama", "neox");
  const auto expected = torch::autograd::grad({ref}, {kwd}, {grad_k.to(at::kDouble)})[0];
  EXPECT_LE(max_abs_diff(std::get<3>(runs[0]), expected), 1e-4 * expected.abs().max().item<double>());
}

TEST(QkNormRope, InPlaceEqualsTheFunctionalOpAndTrainsThroughNonLeafTensors) {
  torch::manual_seed(6);
  const auto q_leaf = torch::randn({1, 4, 3, 8}, kDouble).requires_grad_();
  const auto k_leaf = torch::randn({1, 4, 1, 8}, kDouble).requires_grad_();
  const auto qw = torch::randn({8}, kDouble).requires_grad_();
  const auto kw = torch::randn({8}, kDouble).requires_grad_();
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto [q_ref, k_ref] = posenc::qk_norm_rope(q_leaf * 2, k_leaf * 2, qw, kw, std::nullopt, inv_freq, 1e-6,
                                                   "olmo2", 1.0, "neox", "bshd", 5);
  const auto grad_q = torch::randn({1, 4, 3, 8}, kDouble);
  const auto grad_k = torch::randn({1, 4, 1, 8}, kDouble);
  const auto expected = torch::autograd::grad({q_ref, k_ref}, {q_leaf, k_leaf, qw, kw}, {grad_q, grad_k});
  auto q = q_leaf * 2;
  auto k = k_leaf * 2;
  const auto version = q._version();
  posenc::qk_norm_rope_(q, k, qw, kw, std::nullopt, inv_freq, 1e-6, "olmo2", 1.0, "neox", "bshd", 5);
  EXPECT_GT(q._version(), version);
  EXPECT_TRUE(torch::equal(q, q_ref) && torch::equal(k, k_ref));
  const auto got = torch::autograd::grad({q, k}, {q_leaf, k_leaf, qw, kw}, {grad_q, grad_k});
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << "gradient " << i;
}

TEST(QkNormRope, DoubleBackwardIsRefusedWithAClearError) {
  const auto q = torch::randn({1, 3, 2, 8}, kDouble).requires_grad_();
  const auto w = torch::randn({8}, kDouble).requires_grad_();
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto out = std::get<0>(posenc::qk_norm_rope(q, q, w, w, std::nullopt, inv_freq));
  expect_error([&] { torch::autograd::grad({out.sum()}, {q}, {}, /*retain_graph=*/true, /*create_graph=*/true); },
               "posenc.qk_norm_rope_backward: a second derivative of qk_norm_rope is not supported");
  EXPECT_GT(torch::autograd::grad({out.sum()}, {q})[0].abs().sum().item<double>(), 0);
}

// Each bad input is a c10::Error naming the op, the argument and the value.
TEST(QkNormRope, BadInputIsAnErrorNamingTheArgument) {
  const auto q = torch::randn({2, 4, 3, 8});
  const auto k = torch::randn({2, 4, 1, 8});
  const auto w = torch::ones({8});
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  expect_error([&] { posenc::qk_norm_rope(q, k, torch::ones({7}), w, std::nullopt, inv_freq); },
               "posenc.qk_norm_rope: q_weight has shape [7] but needs [8] (each head) or [24] (all heads of a token)");
  expect_error([&] { posenc::qk_norm_rope(q, k, w, torch::ones({24}), std::nullopt, inv_freq); },
               "k_weight has shape [24] but needs [8] (each head) or [8] (all heads of a token)");
  expect_error([&] { posenc::qk_norm_rope(q, k, w, w, std::nullopt, inv_freq, 1e-6, "rmsnorm"); },
               "posenc.qk_norm_rope: norm must be \"llama\", \"gemma\", \"olmo2\" or \"fused\", got \"rmsnorm\"");
  expect_error([&] { posenc::qk_norm_rope(q, k, w, w, std::nullopt, inv_freq, -1.0); },
               "posenc.qk_norm_rope: eps must be finite and >= 0, got -1");
  expect_error([&] { posenc::qk_norm_rope(q, k, w, w, std::nullopt, inv_freq, std::nan("")); },
               "eps must be finite and >= 0, got nan");
  expect_error([&] { posenc::qk_norm_rope(q, k.to(torch::kDouble), w, w, std::nullopt, inv_freq); },
               "posenc.qk_norm_rope: k is Double but q is Float");
  expect_error([&] { posenc::qk_norm_rope(q, k, w.to(torch::kInt), w, std::nullopt, inv_freq); },
               "posenc.qk_norm_rope: q_weight must be a floating tensor");
  expect_error([&] { posenc::qk_norm_rope_backward(q.slice(2, 0, 2), k, q, k, w, w, std::nullopt, inv_freq); },
               "posenc.qk_norm_rope_backward: grad_q has shape [2, 4, 2, 8] but q has shape [2, 4, 3, 8]");
  const auto x = q.clone();
  expect_error([&] { posenc::qk_norm_rope_(x, x, w, w, std::nullopt, inv_freq); },
               "posenc.qk_norm_rope_: q and k may share elements");
  EXPECT_TRUE(torch::equal(x, q));
}

}  // namespace

TEST(QkNormRope, PackedProjectionSplitsIntoQKAndAViewOfV) {
  torch::manual_seed(9);
  const auto qkv = torch::randn({2, 5, (3 + 2 * 1) * 8}, kDouble);
  const auto qw = torch::rand({8}, kDouble) + 0.5;
  const auto kw = torch::rand({8}, kDouble) + 0.5;
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto positions = torch::randint(0, 99, {2, 5}, torch::kLong);
  const auto heads = qkv.reshape({2, 5, 5, 8});
  const auto [q, k, v] = posenc::qk_norm_rope_packed(qkv, 3, 1, qw, kw, positions, inv_freq, 1e-6, "olmo2");
  EXPECT_LE(max_abs_diff(q, reference_qk_norm_rope(heads.slice(2, 0, 3), qw, positions, inv_freq, "olmo2", "neox")),
            1e-12);
  EXPECT_LE(max_abs_diff(k, reference_qk_norm_rope(heads.slice(2, 3, 4), kw, positions, inv_freq, "olmo2", "neox")),
            1e-12);
  EXPECT_TRUE(torch::equal(v, heads.slice(2, 4, 5)));
  EXPECT_EQ(v.data_ptr<double>(), qkv.data_ptr<double>() + 32);  // a view, not a copy

  const auto buffer = qkv.clone();
  const auto [q_in, k_in, v_in] =
      posenc::qk_norm_rope_packed(buffer, 3, 1, qw, kw, positions, inv_freq, 1e-6, "olmo2", 1.0, "neox", "bshd", 0,
                                  std::nullopt, std::nullopt, 0.0, 1, 0, /*inplace=*/true);
  EXPECT_TRUE(torch::equal(q_in, q) && torch::equal(k_in, k));
  EXPECT_EQ(q_in.data_ptr<double>(), buffer.data_ptr<double>());
  EXPECT_TRUE(torch::equal(buffer.slice(2, 32, 40), qkv.slice(2, 32, 40)));  // v untouched

  expect_error([&] { posenc::qk_norm_rope_packed(qkv, 2, 2, qw, kw, positions, inv_freq); },
               "posenc.qk_norm_rope_packed: qkv's last size 40 must be (num_q_heads + 2 * num_kv_heads) * head_dim");
}

TEST(QkNormRope, QueryScaleMultipliesQAloneByItsPositionsFactor) {
  torch::manual_seed(10);
  const auto q = torch::randn({2, 6, 3, 8}, kDouble);
  const auto k = torch::randn({2, 6, 1, 8}, kDouble);
  const auto w = torch::rand({8}, kDouble) + 0.5;
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto positions = torch::randint(0, 40000, {2, 6}, torch::kLong);
  // Llama 4's attention temperature: 1 + 0.1 * log(1 + floor((p + 1) / 8192)).
  const auto factor = 1 + 0.1 * torch::log1p(torch::floor((positions.to(at::kDouble) + 1) / 8192));
  const auto [q_norm, k_norm] =
      posenc::qk_norm_rope(q, k, w, w, positions, inv_freq, 1e-6, "llama", 1.0, "neox", "bshd", 0, std::nullopt,
                           std::nullopt, 0.1, 8192, 1);
  EXPECT_LE(max_abs_diff(q_norm, reference_qk_norm_rope(q, w, positions, inv_freq, "llama", "neox") *
                                     factor.unsqueeze(-1).unsqueeze(-1)),
            1e-12);
  EXPECT_LE(max_abs_diff(k_norm, reference_qk_norm_rope(k, w, positions, inv_freq, "llama", "neox")), 1e-12);
  const auto [q_rot, k_rot] = posenc::rope_qk(q, k, positions, inv_freq, 1.0, "neox", "bshd", 0, std::nullopt,
                                              std::nullopt, 0.1, 8192, 1);
  const auto [q_plain, k_plain] = posenc::rope_qk(q, k, positions, inv_freq);
  EXPECT_LE(max_abs_diff(q_rot, q_plain * factor.unsqueeze(-1).unsqueeze(-1)), 1e-12);
  EXPECT_TRUE(torch::equal(k_rot, k_plain));
  expect_error([&] { posenc::rope_qk(q, k, positions, inv_freq, 1.0, "neox", "bshd", 0, std::nullopt, std::nullopt,
                                     0.1, 0, 0); },
               "posenc.rope_qk: q_scale_length must be >= 1, got 0");
}
