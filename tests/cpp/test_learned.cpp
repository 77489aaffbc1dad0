// The learned family through the C++ API: values, autograd from C++, positions, modules, errors.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>

#include "test_helpers.h"

using posenc::test::expect_error;
using posenc::test::max_abs_diff;

namespace {

// table[rows] as [rows.shape..., D], written with index_select.
at::Tensor gather(const at::Tensor& table, const at::Tensor& rows) {
  auto sizes = rows.sizes().vec();
  sizes.push_back(table.size(1));
  return table.detach().index_select(0, rows.flatten()).view(sizes);
}

// Sum of grad's rows [N, D] into a [num_rows, D] table at rows [N].
at::Tensor scatter(const at::Tensor& grad, const at::Tensor& rows, int64_t num_rows) {
  return torch::zeros({num_rows, grad.size(-1)}, grad.options()).index_add_(0, rows.flatten(),
                                                                             grad.reshape({-1, grad.size(-1)}));
}

}  // namespace

TEST(Learned, GatherForwardAndBackward) {
  auto weight = torch::randn({9, 5}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto positions = torch::tensor({{0, 3, 3}, {6, 1, 0}}, torch::kInt);
  const auto out = posenc::learned(weight, positions, /*offset=*/2, /*padding_idx=*/2);
  const auto rows = positions.to(torch::kLong) + 2;
  EXPECT_TRUE(torch::equal(out, gather(weight, rows)));
  const auto grad = torch::randn_like(out);
  out.backward(grad);
  auto expected = scatter(grad, rows, 9);
  expected[2] = 0;  // padding row
  EXPECT_LT(max_abs_diff(weight.grad(), expected), 1e-12);
}

TEST(Learned, AddDefaultSharedAndPerRowPositions) {
  auto x = torch::randn({2, 4, 3}, torch::dtype(torch::kDouble).requires_grad(true));
  auto weight = torch::randn({10, 3}, torch::dtype(torch::kDouble).requires_grad(true));
  // Default positions continue a cache of 5: rows 5 .. 8.
  auto out = posenc::add_learned(x, weight, std::nullopt, 5);
  EXPECT_LT(max_abs_diff(out, x.detach() + weight.detach().slice(0, 5, 9)), 1e-15);
  const auto grad = torch::randn_like(out);
  out.backward(grad);
  EXPECT_TRUE(torch::equal(x.grad(), grad));
  auto expected = torch::zeros({10, 3}, torch::kDouble);
  expected.slice(0, 5, 9) += grad.sum(0);
  EXPECT_LT(max_abs_diff(weight.grad(), expected), 1e-12);

  const auto shared = torch::tensor({9, 0, 9, 2});
  EXPECT_LT(max_abs_diff(posenc::add_learned(x, weight, shared), x.detach() + gather(weight, shared)), 1e-15);
  const auto per_row = torch::tensor({{1, 2, 3, 4}, {0, 0, 8, 7}});
  EXPECT_LT(max_abs_diff(posenc::add_learned(x, weight, per_row, 1), x.detach() + gather(weight, per_row + 1)), 1e-15);
}

TEST(Learned, EmbedScalesTokensOnlyAndSkipsPaddingRows) {
  auto token_weight = torch::randn({7, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  auto pos_weight = torch::randn({6, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto tokens = torch::tensor({{1, 1, 5, 6}, {0, 2, 1, 6}});
  const auto positions = posenc::make_positions(tokens, 1);  // fairseq: padding 1 keeps row 1
  const auto out = posenc::embed_learned(tokens, token_weight, pos_weight, positions, 3.0, /*padding_idx=*/1,
                                         /*offset=*/0, /*pos_padding_idx=*/1);
  EXPECT_LT(max_abs_diff(out, gather(token_weight, tokens) * 3.0 + gather(pos_weight, positions)), 1e-12);
  const auto grad = torch::randn_like(out);
  out.backward(grad);
  auto token_grad = scatter(grad, tokens, 7) * 3.0;
  token_grad[1] = 0;
  auto pos_grad = scatter(grad, positions, 6);
  pos_grad[1] = 0;
  EXPECT_LT(max_abs_diff(token_weight.grad(), token_grad), 1e-12);
  EXPECT_LT(max_abs_diff(pos_weight.grad(), pos_grad), 1e-12);
}

TEST(Learned, PositionsFromFairseqAndMasks) {
  const auto tokens = torch::tensor({{1, 1, 5, 6}, {4, 2, 1, 6}});
  EXPECT_TRUE(torch::equal(posenc::make_positions(tokens, 1), torch::tensor({{1, 1, 2, 3}, {2, 3, 1, 4}})));
  const auto mask = torch::tensor({{false, false, true, true}, {true, true, true, true}});
  EXPECT_TRUE(torch::equal(posenc::positions_from_mask(mask), torch::tensor({{0, 0, 0, 1}, {0, 1, 2, 3}})));
  EXPECT_TRUE(torch::equal(posenc::positions_from_mask(mask, -1), torch::tensor({{-1, -1, 0, 1}, {0, 1, 2, 3}})));
}

TEST(Learned, GradientsAreBitwiseIdenticalForOneAndTwoThreads) {
  const auto tokens = torch::randint(0, 40, {8, 512});
  auto token_weight = torch::randn({40, 128}, torch::requires_grad(true));
  auto pos_weight = torch::randn({512, 128}, torch::requires_grad(true));
  const auto grad = torch::randn({8, 512, 128});
  const int threads = at::get_num_threads();
  std::vector<std::vector<at::Tensor>> runs;
  for (int n : {1, 2, 1, 2}) {
    at::set_num_threads(n);
    const auto out = posenc::embed_learned(tokens, token_weight, pos_weight, std::nullopt, 0.5);
    runs.push_back(torch::autograd::grad({out}, {token_weight, pos_weight}, {grad}));
  }
  at::set_num_threads(threads);
  for (const auto& run : runs) {
    EXPECT_TRUE(torch::equal(run[0], runs[0][0]));
    EXPECT_TRUE(torch::equal(run[1], runs[0][1]));
  }
  EXPECT_LT(max_abs_diff(runs[0][1], grad.sum(0)), 1e-4);
}

TEST(Learned, PositionalModule) {
  torch::manual_seed(0);
  posenc::nn::LearnedPositionalEmbedding module(300, 64, /*padding_idx=*/-1, /*offset=*/2);
  ASSERT_EQ(module->weight.sizes(), (at::IntArrayRef{302, 64}));
  EXPECT_EQ(module->padding_idx, 301);
  EXPECT_TRUE(module->weight[301].eq(0).all().item<bool>());
  EXPECT_NEAR(module->weight.std().item<double>(), 0.02, 1e-3);
  EXPECT_EQ(module->parameters().size(), 1u);

  const auto x = torch::randn({2, 3, 64});
  const auto out = module(x, std::nullopt, 4);  // a cache of 4: rows 2 + 4 ..
  EXPECT_LT(max_abs_diff(out, x + module->weight.detach().slice(0, 6, 9)), 1e-6);
  out.sum().backward();
  EXPECT_TRUE(module->weight.grad().slice(0, 6, 9).eq(2).all().item<bool>());
  expect_error([&] { module(x, torch::tensor({0, 1, 300})); },
               "posenc.add_learned: position 302 is outside [0, L_max) with L_max = 302");
}

TEST(Learned, EmbeddingModule) {
  posenc::nn::LearnedEmbedding module(10, 16, 6, /*padding_idx=*/3, /*token_scale=*/2.0);
  EXPECT_TRUE(module->token_weight[3].eq(0).all().item<bool>());
  const auto tokens = torch::tensor({{3, 3, 5, 9}});
  const auto out = module(tokens, std::nullopt, 2);
  EXPECT_LT(max_abs_diff(out, gather(module->token_weight, tokens) * 2.0 + module->pos_weight.detach().slice(0, 2, 6)),
            1e-6);
  out.sum().backward();
  EXPECT_TRUE(module->token_weight.grad()[3].eq(0).all().item<bool>());
  EXPECT_TRUE(module->token_weight.grad()[5].eq(2).all().item<bool>());
}

TEST(Learned, ErrorsNameOpPositionAndLMax) {
  const auto weight = torch::randn({10, 3});
  expect_error([&] { posenc::learned(weight, torch::tensor({4, 10})); },
               "posenc.learned: position 10 is outside [0, L_max) with L_max = 10");
  expect_error([&] { posenc::learned(weight, torch::tensor({0}), -1); },
               "posenc.learned: position -1 is outside [0, L_max) with L_max = 10");
  expect_error([&] { posenc::add_learned(torch::zeros({1, 11, 3}), weight); },
               "posenc.add_learned: position 10 is outside [0, L_max) with L_max = 10");
  const auto tokens = torch::tensor({0, 1});
  expect_error([&] { posenc::embed_learned(tokens, torch::randn({4, 3}), weight, torch::tensor({0, 12})); },
               "posenc.embed_learned: position 12 is outside [0, L_max) with L_max = 10");
  expect_error([&] { posenc::embed_learned(torch::tensor({0, 4}), torch::randn({4, 3}), weight); },
               "posenc.embed_learned: tokens holds 4 at flat index 1, outside [0, 4)");
  expect_error([&] { posenc::add_learned(torch::zeros({1, 2, 3}, torch::kDouble), weight); },
               "posenc.add_learned: weight is Float but x is Double");
  expect_error([&] { posenc::learned(weight, torch::tensor({0.5})); },
               "posenc.learned: positions must be an int64 or int32 tensor, got Float");
}
