// The learned family through the C++ API: values, autograd from C++, positions, modules, errors.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "test_helpers.h"

using posenc::test::expect_error;
using posenc::test::max_abs_diff;
using posenc::test::PosencResolver;

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

namespace {

// Keys' cubic convolution kernel with parameter a.
double keys(double x, double a) {
  x = std::abs(x);
  if (x <= 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0;
}

// float64 [out, in]: F.interpolate's bicubic weights (A = -0.75, clamped taps, half-pixel coordinates), or the
// antialiased bilinear triangle widened by the downscale and normalized.
at::Tensor axis_weights(int64_t in, int64_t out, bool antialias) {
  auto m = torch::zeros({out, in}, torch::kDouble);
  auto a = m.accessor<double, 2>();
  const double scale = static_cast<double>(in) / static_cast<double>(out);
  for (int64_t o = 0; o < out; ++o) {
    if (antialias) {
      const double support = std::max(scale, 1.0);
      const double inv = scale >= 1.0 ? 1.0 / scale : 1.0;
      const double center = scale * (o + 0.5);
      const int64_t lo = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
      const int64_t hi = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in);
      double total = 0;
      for (int64_t k = lo; k < hi; ++k) total += std::max(0.0, 1 - std::abs((k - center + 0.5) * inv));
      for (int64_t k = lo; k < hi; ++k) a[o][k] += std::max(0.0, 1 - std::abs((k - center + 0.5) * inv)) / total;
      continue;
    }
    const double source = scale * (o + 0.5) - 0.5;
    const int64_t i = std::min<int64_t>(static_cast<int64_t>(std::floor(source)), in - 1);
    const double t = std::clamp(source - static_cast<double>(i), 0.0, 1.0);
    const double w[4] = {keys(t + 1, -0.75), keys(t, -0.75), keys(1 - t, -0.75), keys(2 - t, -0.75)};
    for (int64_t k = 0; k < 4; ++k) a[o][std::clamp<int64_t>(i - 1 + k, 0, in - 1)] += w[k];
  }
  return m;
}

// The table resampled in float64: prefix rows, then Mh @ grid @ Mw^T per channel.
at::Tensor resampled(const at::Tensor& weight, int64_t prefix, int64_t hs, int64_t ws, int64_t h, int64_t w,
                     bool antialias) {
  const auto grid = weight.slice(0, prefix).to(torch::kDouble).view({hs, ws, -1});
  const auto rows = torch::einsum("hi,ijd,wj->hwd", {axis_weights(hs, h, antialias), grid, axis_weights(ws, w, antialias)});
  return torch::cat({weight.slice(0, 0, prefix).to(torch::kDouble), rows.reshape({h * w, -1})});
}

}  // namespace

TEST(Learned, ResampledTableAgainstFloat64Formula) {
  torch::manual_seed(0);
  const auto options = torch::dtype(torch::kDouble).requires_grad(true);
  for (const bool antialias : {false, true}) {
    // up (5 x 4 -> 7 x 9) and down (9 x 8 -> 3 x 5), one prefix row (cls)
    for (const auto& [hs, ws, h, w] : {std::array<int64_t, 4>{5, 4, 7, 9}, std::array<int64_t, 4>{9, 8, 3, 5}}) {
      auto weight = torch::randn({1 + hs * ws, 6}, options);
      auto x = torch::randn({2, 1 + h * w, 6}, options);
      const std::string mode = antialias ? "bilinear" : "bicubic";
      const auto table = posenc::resample_learned(weight, {hs, ws}, {h, w}, mode, false, antialias, std::nullopt, 1);
      const auto expected = resampled(weight.detach(), 1, hs, ws, h, w, antialias);
      EXPECT_LT(max_abs_diff(table, expected), 1e-12);
      EXPECT_TRUE(torch::equal(table.slice(0, 0, 1), weight.detach().slice(0, 0, 1)));
      // float32: the float64 sum rounded once, so within half a float32 step (2^-24 relative) of the formula's
      // float64 value (the formula sums in another order, so the two float64 sums may straddle a rounding boundary)
      const auto table32 = posenc::resample_learned(weight.detach().to(torch::kFloat), {hs, ws}, {h, w}, mode, false,
                                                    antialias, std::nullopt, 1);
      const auto exact = resampled(weight.detach().to(torch::kFloat), 1, hs, ws, h, w, antialias);
      EXPECT_TRUE(((table32.to(torch::kDouble) - exact).abs() <= exact.abs() * std::ldexp(1.0, -24) * (1 + 1e-9))
                      .all()
                      .item<bool>());
      // the add and its gradients: d/dx = grad, d/dweight = the adjoint of the grad summed over the batch
      auto out = posenc::add_resampled_learned(x, weight, {hs, ws}, {h, w}, mode, false, antialias, std::nullopt, 1);
      EXPECT_LT(max_abs_diff(out, x.detach() + expected), 1e-12);
      const auto grad = torch::randn_like(out);
      out.backward(grad);
      EXPECT_TRUE(torch::equal(x.grad(), grad));
      const auto summed = grad.sum(0);
      const auto matrix = resampled(torch::eye(1 + hs * ws, torch::kDouble), 1, hs, ws, h, w, antialias);
      EXPECT_LT(max_abs_diff(weight.grad(), matrix.t().mm(summed)), 1e-12);
      EXPECT_LT(max_abs_diff(posenc::resample_learned_backward(grad, {hs, ws}, {h, w}, mode, false, antialias,
                                                               std::nullopt, 1),
                             weight.grad()),
                1e-15);
    }
  }
}

TEST(Learned, ResampledTableErrorsNameOpArgumentAndValue) {
  const auto weight = torch::randn({5, 3});
  expect_error([&] { posenc::resample_learned(weight, {2, 2}, {3, 3}); },
               "posenc.resample_learned: weight has 5 rows but num_prefix_tokens + prod(source_grid) = 0 + 2 * 2 = 4");
  expect_error([&] { posenc::resample_learned(weight, {2, 2}, {3, 3}, "area", false, false, std::nullopt, 1); },
               "posenc.resample_learned: mode must be \"bicubic\" or \"bilinear\", got \"area\"");
  expect_error([&] { posenc::add_resampled_learned(torch::randn({2, 9, 3}), weight, {2, 2}, {3, 3}, "bicubic", false,
                                                   false, std::nullopt, 1); },
               "posenc.add_resampled_learned: x has 9 rows but num_prefix_tokens + prod(grid) = 1 + 3 * 3 = 10");
  const std::vector<double> scale{1.5, -1.0};
  expect_error([&] { posenc::resample_learned(weight, {2, 2}, {3, 3}, "bicubic", false, false,
                                                          std::optional<at::ArrayRef<double>>(scale), 1); },
               "posenc.resample_learned: scale_factor must be two positive finite numbers (rows, columns), got [1.5, -1]");
}

TEST(Learned, ResampledTableThroughTorchScriptForwardAndBackward) {
  auto unit = std::make_shared<torch::jit::CompilationUnit>();
  unit->define(std::nullopt, R"JIT(
def vit(x: Tensor, weight: Tensor, rows: int, cols: int):
    return posenc.add_resampled_learned(x, weight, [4, 4], [rows, cols], "bicubic", False, True, None, 1)
)JIT",
               std::make_shared<PosencResolver>(), nullptr);
  auto weight = torch::randn({1 + 16, 6}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto x = torch::randn({2, 1 + 5 * 7, 6}, torch::kDouble);
  const auto out = unit->run_method("vit", x, weight, 5, 7).toTensor();
  const auto expected = posenc::add_resampled_learned(x, weight.detach(), {4, 4}, {5, 7}, "bicubic", false, true,
                                                      std::nullopt, 1);
  EXPECT_TRUE(torch::equal(out, expected));
  const auto grad = torch::randn_like(out);
  out.backward(grad);
  EXPECT_TRUE(torch::equal(weight.grad(), posenc::resample_learned_backward(grad, {4, 4}, {5, 7}, "bicubic", false,
                                                                            true, std::nullopt, 1)));
}
