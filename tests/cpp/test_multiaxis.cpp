// Multi-axis rotary from C++: the frequency builders, the position grids, rope_qk with pair_axis against a float64
// reference written here, the modules, and a scripted module (scripts/export_torchscript.py) run forward and
// backward through torch::jit::load.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "rope_reference.h"
#include "test_helpers.h"

using posenc::test::expect_error;
using posenc::test::max_abs_diff;

namespace {

// float64 multi-axis RoPE of bshd x: pair i of the layout rotates by positions[pair_axis[i], ...] * inv_freq[i],
// positions [n_axes, S] or [n_axes, B, S]; scale multiplies cos and sin.
at::Tensor reference(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& pair_axis,
                     const at::Tensor& inv_freq, const std::string& layout, double scale = 1.0) {
  const auto per_pair = positions.to(at::kDouble).index_select(0, pair_axis.to(at::kLong));  // [F, (B,) S]
  return posenc::test::rotate_pairs(x, per_pair.movedim(0, -1) * inv_freq.to(at::kDouble), layout, scale);
}

std::vector<int64_t> values(const at::Tensor& t) {
  const auto c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

}  // namespace

TEST(Multiaxis, FrequencyBuilders) {
  EXPECT_EQ(values(posenc::frequencies::mrope_pair_axis({2, 3, 3})), (std::vector<int64_t>{0, 0, 1, 1, 1, 2, 2, 2}));
  // Qwen3-VL: pairs 1, 4 (< 3 * 2) follow height, 2, 5 width, the rest time.
  EXPECT_EQ(values(posenc::frequencies::mrope_pair_axis({4, 2, 2}, true)),
            (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 0}));
  const auto flux = posenc::frequencies::multiaxis({4, 6}, {10.0, 20.0});
  EXPECT_EQ(values(flux.pair_axis), (std::vector<int64_t>{0, 0, 1, 1, 1}));
  const auto expected = torch::tensor(
      {1.0, std::pow(10.0, -0.5), 1.0, std::pow(20.0, -1.0 / 3), std::pow(20.0, -2.0 / 3)}, torch::kDouble);
  EXPECT_LT(max_abs_diff(flux.inv_freq, expected), 1e-15);
  EXPECT_EQ(flux.inv_freq.scalar_type(), at::kDouble);
  const auto axial = posenc::frequencies::axial(16, 2, 100.0);
  EXPECT_EQ(values(axial.pair_axis), (std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_NEAR(axial.inv_freq[3].item<double>(), std::pow(100.0, -12.0 / 16.0), 1e-16);
  const auto mrope = posenc::frequencies::mrope(16, {2, 3, 3}, 1e4);
  EXPECT_TRUE(torch::equal(mrope.inv_freq, posenc::frequencies::rope(16, 1e4).inv_freq));
  expect_error([] { posenc::frequencies::mrope(16, {2, 3, 2}); }, "holds 7 frequency pairs but rotary_dim 16 has 8");
}

TEST(Multiaxis, PositionGrids) {
  EXPECT_EQ(values(posenc::image_positions(2, 3)), (std::vector<int64_t>{0, 0, 0, 1, 1, 1, 0, 1, 2, 0, 1, 2}));
  const auto video = posenc::video_positions(2, 1, 2, 2.5);
  EXPECT_EQ(values(video), (std::vector<int64_t>{0, 0, 2, 2, 0, 0, 0, 0, 0, 1, 0, 1}));
  // Text, a 1 x 4 x 4 image merged 2 x 2 (4 tokens), text: the text after it continues at 2 + 4 / 2.
  const auto types = torch::tensor({{0, 0, 1, 1, 1, 1, 0}});
  const auto [positions, deltas] = posenc::mrope_positions(types, torch::tensor({{1, 4, 4}}));
  EXPECT_EQ(values(positions[0][0]), (std::vector<int64_t>{0, 1, 2, 2, 2, 2, 4}));
  EXPECT_EQ(values(positions[1][0]), (std::vector<int64_t>{0, 1, 2, 2, 3, 3, 4}));
  EXPECT_EQ(values(positions[2][0]), (std::vector<int64_t>{0, 1, 2, 3, 2, 3, 4}));
  EXPECT_EQ(deltas.item<int64_t>(), 5 - 7);
}

TEST(Multiaxis, RopeQkMatchesTheReference) {
  const auto freqs = posenc::frequencies::mrope(10, {1, 2, 2}, 100.0, true);
  auto q = torch::randn({2, 6, 3, 12}, torch::requires_grad(true));
  auto k = torch::randn({2, 6, 1, 12}, torch::requires_grad(true));
  const auto positions = torch::randint(0, 1000, {3, 2, 6});
  const auto [q_out, k_out] =
      posenc::rope_qk(q, k, positions, freqs.inv_freq, 0.5, "gptj", "bshd", 3, std::nullopt, freqs.pair_axis);
  EXPECT_LT(max_abs_diff(q_out, reference(q.detach(), positions + 3, freqs.pair_axis, freqs.inv_freq, "gptj", 0.5)),
            2e-6);
  EXPECT_LT(max_abs_diff(k_out, reference(k.detach(), positions + 3, freqs.pair_axis, freqs.inv_freq, "gptj", 0.5)),
            2e-6);
  // Backward: the rotation by -angle.
  const auto grad = torch::randn_like(q_out);
  torch::autograd::backward({q_out}, {grad});
  EXPECT_LT(max_abs_diff(q.grad(), reference(grad, positions + 3, freqs.pair_axis, -freqs.inv_freq, "gptj", 0.5)),
            2e-6);
  // Every axis at the same position: the one-axis rotation's bits.
  const auto line = torch::randint(0, 1 << 30, {2, 6});
  EXPECT_TRUE(torch::equal(
      posenc::rope(q.detach(), line.expand({3, 2, 6}), freqs.inv_freq, 1.0, "neox", "bshd", 0, std::nullopt,
                   freqs.pair_axis),
      posenc::rope(q.detach(), line, freqs.inv_freq)));
  expect_error([&] { posenc::rope(q.detach(), positions, freqs.inv_freq, 1.0, "neox", "bshd", 0, std::nullopt,
                                 freqs.pair_axis + 1); },
               "posenc.rope: pair_axis holds 3 at index 2, outside [0, 3)");
}

TEST(Multiaxis, Modules) {
  posenc::nn::MultimodalRotaryEmbedding text(16, std::vector<int64_t>{2, 3, 3}, 1e4);
  posenc::nn::AxialRotaryEmbedding image(16, 2, 100.0, "gptj");
  text->to(torch::kBFloat16);
  image->to(torch::kHalf);
  EXPECT_EQ(text->inv_freq().scalar_type(), at::kDouble);
  EXPECT_EQ(image->inv_freq().scalar_type(), at::kDouble);
  const auto q = torch::randn({1, 6, 2, 16});
  const auto k = torch::randn({1, 6, 1, 16});
  const auto positions = torch::randint(0, 50, {3, 6});
  const auto freqs = posenc::frequencies::mrope(16, {2, 3, 3}, 1e4);
  const auto [q_text, k_text] = text(q, k, positions);
  EXPECT_LT(max_abs_diff(q_text, reference(q, positions, freqs.pair_axis, freqs.inv_freq, "neox")), 2e-6);
  EXPECT_TRUE(torch::equal(std::get<1>(text(q, k)), posenc::rope(k, std::nullopt, freqs.inv_freq)));  // text alone
  const auto grid = posenc::image_positions(2, 3);
  const auto axial = posenc::frequencies::axial(16, 2, 100.0);
  EXPECT_LT(max_abs_diff(std::get<0>(image(q, k, grid)), reference(q, grid, axial.pair_axis, axial.inv_freq, "gptj")),
            2e-6);
}

TEST(TorchScript, MultiaxisForwardAndBackward) {
  const char* dir = std::getenv("POSENC_FIXTURES");
  ASSERT_NE(dir, nullptr) << "POSENC_FIXTURES is not set: run the tests through ctest";
  auto module = torch::jit::load(std::string(dir) + "/multiaxis.pt");
  module.to(torch::kBFloat16);  // converts parameters and buffers: the frequencies are neither
  EXPECT_EQ(module.attr("text").toModule().attr("inv_freq").toTensor().scalar_type(), at::kDouble);

  auto q = torch::randn({2, 5, 4, 8}, torch::requires_grad(true));
  auto k = torch::randn({2, 5, 2, 8}, torch::requires_grad(true));
  const auto positions = torch::randint(0, 200, {3, 2, 5});
  auto patches = torch::randn({6, 2, 8}, torch::requires_grad(true));
  const auto grid = posenc::image_positions(2, 3);
  const auto types = torch::tensor({{0, 1, 1, 1, 1, 0}});
  const auto outputs =
      module.forward({q, k, positions, patches, grid, types, torch::tensor({{1, 4, 4}})}).toTuple()->elements();

  const auto text = posenc::frequencies::mrope(8, {2, 1, 1}, 100.0, true);
  const auto axial = posenc::frequencies::axial(8, 2, 1e4);
  EXPECT_LT(max_abs_diff(outputs[0].toTensor(), reference(q.detach(), positions + 1, text.pair_axis, text.inv_freq,
                                                          "neox")),
            2e-6);
  const auto expected_patches = reference(patches.detach().unsqueeze(0), grid, axial.pair_axis, axial.inv_freq, "gptj");
  EXPECT_LT(max_abs_diff(outputs[2].toTensor(), expected_patches[0]), 2e-6);
  EXPECT_EQ(values(outputs[3].toTensor()[1][0]), (std::vector<int64_t>{0, 1, 1, 2, 2, 3}));
  EXPECT_EQ(outputs[4].toTensor().item<int64_t>(), 4 - 6);

  const auto grad_q = torch::randn_like(outputs[0].toTensor());
  const auto grad_patches = torch::randn_like(outputs[2].toTensor());
  torch::autograd::backward({outputs[0].toTensor(), outputs[2].toTensor()}, {grad_q, grad_patches});
  EXPECT_LT(max_abs_diff(q.grad(), reference(grad_q, positions + 1, text.pair_axis, -text.inv_freq, "neox")), 2e-6);
  EXPECT_LT(max_abs_diff(patches.grad(), reference(grad_patches.unsqueeze(0), grid, axial.pair_axis, -axial.inv_freq,
                                                   "gptj")[0]),
            2e-6);
}
