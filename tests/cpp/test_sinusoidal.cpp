// The sinusoidal family through the C++ API: values, autograd from C++, the module, errors.
#include <posenc/posenc.h>

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <torch/torch.h>

#include "reference.h"
#include "test_helpers.h"

using posenc::test::max_abs_diff;
using posenc::test::reference_frequencies;
using posenc::test::reference_pe;

TEST(Sinusoidal, FrequenciesMatchFormula) {
  for (int64_t shift : {0, 1}) {
    const auto w = posenc::frequencies::sinusoidal(64, 10000.0, shift);
    EXPECT_EQ(w.scalar_type(), at::kDouble);
    EXPECT_LT(max_abs_diff(w, reference_frequencies(64, 10000.0, shift)), 1e-15);
  }
  EXPECT_THROW(posenc::frequencies::sinusoidal(1), c10::Error);
}

TEST(Sinusoidal, PrimerTable) {
  const auto pe = posenc::sinusoidal(torch::arange(4), posenc::frequencies::sinusoidal(4), "interleaved", at::kDouble);
  const auto table = torch::tensor({0.000, 1.000, 0.000, 1.000, 0.841, 0.540, 0.010, 1.000,
                                    0.909, -0.416, 0.020, 1.000, 0.141, -0.990, 0.030, 1.000}, at::kDouble)
                         .view({4, 4});
  EXPECT_LT(max_abs_diff(pe, table), 5e-4);
}

TEST(Sinusoidal, AccuracyFloat32AtLargePositions) {
  const auto positions = torch::arange(0, (1 << 20) + 1, 4099);
  const auto inv_freq = posenc::frequencies::sinusoidal(128);
  const auto pe = posenc::sinusoidal(positions, inv_freq, "half");
  EXPECT_EQ(pe.scalar_type(), at::kFloat);
  EXPECT_LE(max_abs_diff(pe, reference_pe(positions, inv_freq, "half", 128)), 1e-6);
}

TEST(Sinusoidal, AddForwardAndBackwardFromCpp) {
  const auto inv_freq = posenc::frequencies::sinusoidal(8, 10000.0, 1);
  auto x = torch::randn({2, 5, 9}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto out = posenc::add_sinusoidal(x, std::nullopt, inv_freq, 3.0, "half", 2);
  const auto pe = reference_pe(torch::arange(2, 7), inv_freq, "half", 9);
  EXPECT_LT(max_abs_diff(out, x.detach() * 3.0 + pe), 1e-12);
  const auto grad = torch::randn_like(out);
  out.backward(grad);
  EXPECT_LT(max_abs_diff(x.grad(), grad * 3.0), 1e-15);
}

TEST(Sinusoidal, EmbedBackwardScattersIntoTokenTable) {
  const auto inv_freq = posenc::frequencies::sinusoidal(4);
  auto weight = torch::randn({6, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto tokens = torch::tensor({{1, 5, 1}, {0, 2, 5}});
  const auto out = posenc::embed_sinusoidal(tokens, weight, std::nullopt, inv_freq, 2.0, 0);
  const auto expected = weight.detach().index_select(0, tokens.flatten()).view({2, 3, 4}) * 2.0 +
                        reference_pe(torch::arange(3), inv_freq, "interleaved", 4);
  EXPECT_LT(max_abs_diff(out, expected), 1e-12);
  const auto grad = torch::randn_like(out);
  out.backward(grad);
  auto grad_weight = torch::zeros({6, 4}, at::kDouble).index_add_(0, tokens.flatten(), grad.view({6, 4})) * 2.0;
  grad_weight[0] = 0;  // padding row
  EXPECT_LT(max_abs_diff(weight.grad(), grad_weight), 1e-12);
}

TEST(Sinusoidal, ModuleKeepsFloat64Frequencies) {
  posenc::nn::SinusoidalPositionalEncoding module(16, 10000.0, 0, "interleaved", 1.0);
  module->to(torch::kBFloat16);
  EXPECT_EQ(module->inv_freq().scalar_type(), at::kDouble);
  const auto x = torch::zeros({1, 3, 16}, torch::kBFloat16);
  const auto out = module(x);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_LT(max_abs_diff(out[0], reference_pe(torch::arange(3), reference_frequencies(16, 1e4, 0), "interleaved", 16)), 4e-3);
}

TEST(Sinusoidal, ErrorsNameOpArgumentAndValue) {
  const auto inv_freq = posenc::frequencies::sinusoidal(4);
  try {
    posenc::add_sinusoidal(torch::randn({2, 7}), std::nullopt, inv_freq);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("posenc.add_sinusoidal: x has 7 channels but inv_freq has 2 frequencies"),
              std::string::npos);
  }
  EXPECT_THROW(posenc::embed_sinusoidal(torch::tensor({7}), torch::randn({5, 4}), std::nullopt, inv_freq), c10::Error);
  EXPECT_THROW(posenc::add_sinusoidal(torch::ones({2, 4}, torch::kLong), std::nullopt, inv_freq), c10::Error);
}

// MAE's 2-D table (util/pos_embed.py) in float64: the column's sin and cos, then the row's, each with the
// frequencies 1 / 10000^(k / (D / 4)).
at::Tensor mae_table(int64_t height, int64_t width, int64_t dim) {
  auto table = torch::zeros({height * width, dim}, at::kDouble);
  const int64_t quarter = dim / 4;
  for (int64_t n = 0; n < height * width; ++n) {
    const double coordinate[2] = {static_cast<double>(n % width), static_cast<double>(n / width)};
    for (int64_t block = 0; block < 2; ++block) {
      for (int64_t k = 0; k < quarter; ++k) {
        const double angle = coordinate[block] / std::pow(10000.0, static_cast<double>(k) / quarter);
        table[n][block * 2 * quarter + k] = std::sin(angle);
        table[n][block * 2 * quarter + quarter + k] = std::cos(angle);
      }
    }
  }
  return table;
}

TEST(Sinusoidal, GridTableOfMaeWithPrefixTokens) {
  const auto grid = posenc::frequencies::grid_sinusoidal(32, "mae");
  EXPECT_EQ(grid.layout, "half_per_axis");
  auto x = torch::randn({2, 2 + 5 * 7, 32}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto out = posenc::add_sinusoidal(x, posenc::grid_positions({5, 7}), grid.inv_freq, 1.0, grid.layout, 0,
                                          grid.pair_axis, 2);
  const auto expected = x.detach().slice(1, 2) + mae_table(5, 7, 32);
  EXPECT_LT(max_abs_diff(out.slice(1, 2), expected), 1e-15);
  EXPECT_TRUE(torch::equal(out.slice(1, 0, 2), x.detach().slice(1, 0, 2)));
  const auto grad = torch::randn_like(out);
  out.backward(grad);
  EXPECT_TRUE(torch::equal(x.grad(), grad));

  posenc::nn::SinusoidalGridEncoding module(32, "mae", 10000.0, 2);
  module->to(torch::kFloat);
  const auto from_module = module(x.detach().to(torch::kFloat), std::vector<int64_t>{5, 7});
  EXPECT_LT(max_abs_diff(from_module.slice(1, 2).to(torch::kDouble), expected), 1e-6);
}

TEST(Sinusoidal, GridErrorsNameOpArgumentAndValue) {
  const auto grid = posenc::frequencies::grid_sinusoidal(16, "timm");
  const auto x = torch::randn({1, 12, 16});
  const auto expect_error = [](const std::function<void()>& call, const std::string& text) {
    try {
      call();
      FAIL() << "expected an error with: " << text;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error([&] { posenc::add_sinusoidal(x, std::nullopt, grid.inv_freq, 1.0, grid.layout, 0, grid.pair_axis); },
               "posenc.add_sinusoidal: pair_axis needs positions");
  expect_error([&] { posenc::add_sinusoidal(x, posenc::grid_positions({3, 4}), grid.inv_freq, 1.0, grid.layout, 0,
                                            grid.pair_axis, 13); },
               "posenc.add_sinusoidal: num_prefix_tokens 13 is outside [0, S]");
  expect_error([&] { posenc::add_sinusoidal(x, posenc::grid_positions({3, 4}).slice(0, 0, 1), grid.inv_freq, 1.0,
                                            grid.layout, 0, grid.pair_axis); },
               "posenc.add_sinusoidal: pair_axis holds 1 at index 4, outside [0, 1)");
  expect_error([&] { posenc::frequencies::grid_sinusoidal(18, "mae"); },
               "posenc.grid_sinusoidal_inv_freq: dim must be a positive multiple of 4");
  expect_error([&] { posenc::grid_positions({4, 4}, std::vector<int64_t>{8, 3}); },
               "posenc.grid_positions: crop_from[1] = 3 is smaller than grid[1] = 4");
}
