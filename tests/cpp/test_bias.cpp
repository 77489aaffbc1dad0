// ALiBi and the T5 relative bias through the C++ API: values, autograd from C++, modules, errors.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "bias_reference.h"
#include "test_helpers.h"

using posenc::test::expect_error;
using posenc::test::max_abs_diff;
using posenc::test::reference_alibi_bias;
using posenc::test::reference_alibi_slopes;
using posenc::test::reference_t5_bias;
using posenc::test::reference_t5_buckets;
using posenc::test::reference_t5_grad;

TEST(Alibi, SlopesMatchFormulaFor1To128Heads) {
  for (int64_t heads = 1; heads <= 128; ++heads) {
    const auto slopes = posenc::alibi_slopes(heads, at::kDouble);
    ASSERT_EQ(slopes.size(0), heads);
    EXPECT_LT(max_abs_diff(slopes, reference_alibi_slopes(heads)), 1e-15) << heads << " heads";
  }
  EXPECT_EQ(posenc::alibi_slopes(8).scalar_type(), at::kFloat);
  EXPECT_EQ(posenc::alibi_slopes(4)[0].item<float>(), 0.25f);
  expect_error([] { posenc::alibi_slopes(0); }, "posenc.alibi_slopes: num_heads must be positive, got 0");
}

TEST(Alibi, BiasValuesBottomRightAligned) {
  const auto slopes = torch::rand({2, 10}, at::kDouble);
  for (const bool symmetric : {false, true}) {
    const char* mode = symmetric ? "symmetric" : "causal";
    for (const auto& [q_len, k_len] : std::vector<std::pair<int64_t, int64_t>>{{5, 5}, {2, 7}, {7, 2}}) {
      const auto out = posenc::alibi_bias(slopes, q_len, k_len, mode, 3, 4);
      ASSERT_EQ(out.sizes(), at::IntArrayRef({2, 4, q_len, k_len}));
      EXPECT_LT(max_abs_diff(out, reference_alibi_bias(slopes, q_len, k_len, symmetric, 3, 4)), 1e-15);
    }
  }
  const auto half = posenc::alibi_bias(posenc::alibi_slopes(4), 3, 3, "causal", 0, std::nullopt, at::kHalf);
  EXPECT_EQ(half.scalar_type(), at::kHalf);
  EXPECT_LT(max_abs_diff(half, reference_alibi_bias(posenc::alibi_slopes(4), 3, 3, false, 0, 4)), 1e-3);
}

TEST(Alibi, AddForwardAndBackwardFromCpp) {
  auto scores = torch::randn({2, 3, 4, 6}, torch::dtype(torch::kDouble).requires_grad(true));
  auto slopes = posenc::alibi_slopes(5, at::kDouble).requires_grad_();
  const auto out = posenc::add_alibi(scores, slopes, "symmetric", 1);
  EXPECT_LT(max_abs_diff(out, scores.detach() + reference_alibi_bias(slopes.detach(), 4, 6, true, 1, 3)), 1e-15);
  const auto grad = torch::randn_like(out);
  out.backward(grad);
  EXPECT_LT(max_abs_diff(scores.grad(), grad), 1e-15);
  // d/dm_h = sum over b, i, j of grad * (-|d|): the bias of unit slopes, heads 1..3 only.
  const auto unit_bias = reference_alibi_bias(torch::ones({3}, at::kDouble), 4, 6, true, 0, 3);
  auto expected = torch::zeros({5}, at::kDouble);
  expected.slice(0, 1, 4) = (grad * unit_bias).sum({0, 2, 3});
  EXPECT_LT(max_abs_diff(slopes.grad(), expected), 1e-12);
}

TEST(Alibi, InPlaceMatchesAndRefusesAutograd) {
  const auto slopes = torch::rand({2, 4});
  auto scores = torch::randn({2, 4, 3, 5});
  const auto expected = posenc::add_alibi(scores, slopes, "causal");
  posenc::add_alibi_(scores, slopes, "causal");
  EXPECT_TRUE(torch::equal(scores, expected));
  expect_error([&] { posenc::add_alibi_(scores, slopes.clone().requires_grad_()); },
               "posenc.add_alibi_: the in-place op records no autograd");
}

TEST(Alibi, BackwardDeterministicAcrossThreads) {
  const auto grad = torch::randn({2, 8, 128, 300});
  const auto slopes = posenc::alibi_slopes(8);
  const int previous = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = posenc::alibi_backward(grad, slopes, "causal");
  at::set_num_threads(2);
  const auto two = posenc::alibi_backward(grad, slopes, "causal");
  at::set_num_threads(previous);
  EXPECT_TRUE(torch::equal(one, two));
}

TEST(Alibi, ModuleKeepsSlopesAndShards) {
  posenc::nn::ALiBi fixed(12);
  fixed->to(torch::kHalf);
  EXPECT_EQ(fixed->slopes().scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(fixed->slopes(), posenc::alibi_slopes(12)));
  EXPECT_TRUE(fixed->parameters().empty());

  posenc::nn::ALiBi shard(8, "causal", /*learnable=*/true, /*head_offset=*/4, /*num_local_heads=*/2);
  ASSERT_EQ(shard->named_parameters().size(), 1u);
  const auto scores = torch::randn({1, 2, 3, 3});
  const auto out = shard(scores);
  EXPECT_LT(max_abs_diff(out, scores + reference_alibi_bias(posenc::alibi_slopes(8), 3, 3, false, 4, 2)), 1e-6);
  out.square().sum().backward();  // (a plain sum would cancel: causal distances over a square sum to zero)
  const auto grad = shard->slopes().grad();
  EXPECT_EQ(grad.slice(0, 0, 4).abs().sum().item<float>(), 0.0f);
  EXPECT_GT(grad.slice(0, 4, 6).abs().min().item<float>(), 0.0f);
  expect_error([&] { shard(torch::randn({1, 8, 3, 3})); }, "posenc.nn.ALiBi: scores must be [B, 2, Q, K]");
}

TEST(Alibi, ErrorsNameOpArgumentAndValue) {
  const auto slopes = posenc::alibi_slopes(4);
  expect_error([&] { posenc::alibi_bias(slopes, -1, 3); }, "posenc.alibi_bias: q_len must be non-negative, got -1");
  expect_error([&] { posenc::add_alibi(torch::randn({1, 6, 2, 2}), slopes); },
               "posenc.add_alibi: heads [0, 6) need that many slopes but slopes has 4 heads");
  expect_error([&] { posenc::add_alibi(torch::ones({1, 4, 2, 2}, torch::kLong), slopes); },
               "posenc.add_alibi: scores must be a floating tensor, got Long");
  expect_error([&] { posenc::add_alibi(torch::randn({1, 4, 2, 2}), slopes, "future"); },
               "posenc.add_alibi: mode must be \"causal\" or \"symmetric\", got \"future\"");
}

TEST(T5, BucketsKnownValues) {
  const auto relative = torch::tensor({-200, -127, -100, -40, -20, -15, -12, -1, 0, 1, 7, 8, 20, 100, 200});
  const auto bidirectional = torch::tensor({15, 15, 15, 12, 10, 9, 9, 1, 0, 17, 23, 24, 26, 31, 31});
  const auto causal = torch::tensor({31, 31, 30, 23, 17, 15, 12, 1, 0, 0, 0, 0, 0, 0, 0});
  EXPECT_TRUE(torch::equal(posenc::relative_position_bucket(relative), bidirectional));
  EXPECT_TRUE(torch::equal(posenc::relative_position_bucket(relative.to(torch::kInt), false), causal));
}

TEST(T5, BiasAndBackwardFromCpp) {
  auto weight = torch::randn({16, 3}, torch::dtype(torch::kDouble).requires_grad(true));
  for (const bool bidirectional : {true, false}) {
    weight.mutable_grad() = at::Tensor();
    const auto out = posenc::t5_bias(weight, 6, 40, bidirectional, 16, 24, 30);
    const auto buckets = reference_t5_buckets(6, 40, bidirectional, 16, 24, 30);
    EXPECT_TRUE(torch::equal(out, reference_t5_bias(weight.detach(), buckets)));
    const auto grad = torch::randn_like(out);
    out.backward(grad);
    EXPECT_LT(max_abs_diff(weight.grad(), reference_t5_grad(grad, buckets, 16)), 1e-12);
  }
}

TEST(T5, BackwardDeterministicAcrossThreads) {
  const auto grad = torch::randn({1, 4, 200, 300});
  const int previous = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = posenc::t5_bias_backward(grad, false, 32, 128, 3);
  at::set_num_threads(2);
  const auto two = posenc::t5_bias_backward(grad, false, 32, 128, 3);
  at::set_num_threads(previous);
  EXPECT_TRUE(torch::equal(one, two));
}

TEST(T5, ModuleHasOneTableParameter) {
  posenc::nn::T5RelativeBias module(4, 32, 128, false);
  const auto params = module->named_parameters();
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(params.begin()->key(), "weight");
  EXPECT_EQ(module->weight().sizes(), at::IntArrayRef({32, 4}));
  const auto out = module(1, 9, 8);  // one decoding step after a cache of 8
  EXPECT_TRUE(torch::equal(out, reference_t5_bias(module->weight().detach(),
                                                  reference_t5_buckets(1, 9, false, 32, 128, 8)).to(at::kFloat)));
}

TEST(T5, ErrorsNameOpArgumentAndValue) {
  const auto weight = torch::randn({32, 2});
  expect_error([&] { posenc::t5_bias(weight, 3, 3, true, 16, 128); },
               "posenc.t5_bias: weight has 32 rows but num_buckets is 16");
  expect_error([&] { posenc::t5_bias(weight, 3, 3, true, 32, 8); },
               "posenc.t5_bias: max_distance 8 must exceed the 8 exact buckets of num_buckets 32 (bidirectional)");
  expect_error([] { posenc::relative_position_bucket(torch::tensor({1.5})); },
               "posenc.relative_position_bucket: relative_position must be an int64 or int32 tensor, got Float");
  expect_error([] { posenc::relative_position_bucket(torch::tensor({1}), true, -4); },
               "posenc.relative_position_bucket: num_buckets must be positive, got -4");
}
