// TorchScript round trip: modules scripted and saved by scripts/export_torchscript.py, loaded here with
// torch::jit::load, run forward and backward, values checked against float64 formulas.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "bias_reference.h"
#include "reference.h"
#include "rope_reference.h"
#include "test_helpers.h"

using posenc::test::max_abs_diff;
using posenc::test::reference_frequencies;
using posenc::test::reference_pe;
using posenc::test::reference_qk_norm_rope;
using posenc::test::reference_rope;

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
  posenc::test::expect_error<std::exception>([&] { module.forward({torch::tensor({{11}}), x}); },
                                             "posenc.embed_sinusoidal: tokens holds 11");
}

TEST(TorchScript, LearnedForwardAndBackward) {
  auto module = load_fixture("learned");
  const auto tokens = torch::tensor({{0, 0, 7, 10}, {3, 1, 4, 1}});
  const auto mask = tokens.ne(0).to(at::kLong);
  auto x = torch::randn({2, 4, 4}, torch::requires_grad(true));
  const auto outputs = module.forward({tokens, mask, x, 3}).toTuple();
  const auto embedded = outputs->elements()[0].toTensor();
  const auto positioned = outputs->elements()[1].toTensor();
  const auto fairseq = outputs->elements()[2].toTensor();

  // GPT-2: token_weight[tokens] * 2 + pos_weight[3 .. 7).
  const auto token_weight = parameter(module, "embed.token_weight");
  const auto pos_weight = parameter(module, "embed.pos_weight");
  const auto expected_embedded = token_weight.detach().index_select(0, tokens.flatten()).view({2, 4, 4}) * 2.0 +
                                 pos_weight.detach().slice(0, 3, 7);
  EXPECT_LT(max_abs_diff(embedded, expected_embedded), 1e-6);
  // OPT: rows cumsum(mask) - 1 + 2 for real tokens, row 1 for padding.
  const auto weight = parameter(module, "position.weight");
  const auto rows = torch::tensor({{1, 1, 2, 3}, {2, 3, 4, 5}});
  const auto expected_positioned = x.detach() + weight.detach().index_select(0, rows.flatten()).view({2, 4, 4});
  EXPECT_LT(max_abs_diff(positioned, expected_positioned), 1e-6);
  EXPECT_TRUE(torch::equal(fairseq, torch::tensor({{0, 0, 1, 2}, {1, 2, 3, 4}})));

  const auto grad = torch::randn_like(embedded);
  const auto grad_positioned = torch::randn_like(positioned);
  torch::autograd::backward({embedded, positioned}, {grad, grad_positioned});
  auto expected_token_grad = torch::zeros({11, 4}).index_add_(0, tokens.flatten(), grad.view({8, 4})) * 2.0;
  expected_token_grad[0] = 0;  // padding_idx
  EXPECT_LT(max_abs_diff(token_weight.grad(), expected_token_grad), 1e-5);
  auto expected_pos_grad = torch::zeros({8, 4});
  expected_pos_grad.slice(0, 3, 7) += grad.sum(0);
  EXPECT_LT(max_abs_diff(pos_weight.grad(), expected_pos_grad), 1e-5);
  const auto expected_weight_grad = torch::zeros({8, 4}).index_add_(0, rows.flatten(), grad_positioned.view({8, 4}));
  EXPECT_LT(max_abs_diff(weight.grad(), expected_weight_grad), 1e-5);
  EXPECT_TRUE(torch::equal(x.grad(), grad_positioned));

  // A cache of 5 puts the last token at position 8 of an 8-row table: an error inside the scripted module.
  posenc::test::expect_error<std::exception>([&] { module.forward({tokens, mask, x, 5}); },
                                             "posenc.embed_learned: position 8 is outside [0, L_max) with L_max = 8");
}

TEST(TorchScript, AlibiForwardAndBackward) {
  using posenc::test::reference_alibi_bias;
  auto module = load_fixture("alibi");
  auto scores = torch::randn({2, 4, 3, 5}, torch::requires_grad(true));
  const auto outputs = module.forward({scores, int64_t{4}, int64_t{6}}).toTuple();
  const auto shard = outputs->elements()[0].toTensor();
  const auto symmetric = outputs->elements()[1].toTensor();

  // The shard holds heads 2..5 of an 8-head model: global slopes, bottom-right aligned causal bias.
  const auto slopes = posenc::alibi_slopes(8, at::kDouble);
  const auto expected_shard = scores.detach().to(at::kDouble) + reference_alibi_bias(slopes, 3, 5, false, 2, 4);
  EXPECT_LT(max_abs_diff(shard, expected_shard), 2e-6);
  EXPECT_EQ(symmetric.scalar_type(), at::kDouble);
  EXPECT_LT(max_abs_diff(symmetric, reference_alibi_bias(posenc::alibi_slopes(6, at::kDouble), 4, 6, true, 0, 6)), 1e-7);

  const auto grad = torch::randn_like(shard);
  shard.backward(grad);
  EXPECT_LT(max_abs_diff(scores.grad(), grad), 1e-7);
  auto expected = torch::zeros({8}, at::kDouble);
  expected.slice(0, 2, 6) =
      (grad.to(at::kDouble) * reference_alibi_bias(torch::ones({4}, at::kDouble), 3, 5, false, 0, 4)).sum({0, 2, 3});
  EXPECT_LT(max_abs_diff(parameter(module, "shard.slopes").grad(), expected), 1e-4);
}

TEST(TorchScript, T5ForwardAndBackward) {
  using posenc::test::reference_t5_bias;
  using posenc::test::reference_t5_buckets;
  using posenc::test::reference_t5_grad;
  auto module = load_fixture("t5");
  const auto scores = torch::randn({2, 3, 4, 150});
  const auto outputs = module.forward({scores, int64_t{146}}).toTuple();
  const auto encoder = outputs->elements()[0].toTensor();
  const auto decoder = outputs->elements()[1].toTensor();

  const auto encoder_weight = parameter(module, "encoder.weight");
  const auto decoder_weight = parameter(module, "decoder.weight");
  const auto encoder_buckets = reference_t5_buckets(4, 150, true, 32, 128, 0);
  const auto decoder_buckets = reference_t5_buckets(4, 150, false, 16, 20, 146);
  const auto expected_encoder = scores.to(at::kDouble) + reference_t5_bias(encoder_weight.detach(), encoder_buckets);
  const auto expected_decoder = scores.to(at::kDouble) + reference_t5_bias(decoder_weight.detach(), decoder_buckets);
  EXPECT_LT(max_abs_diff(encoder, expected_encoder), 1e-6);
  EXPECT_LT(max_abs_diff(decoder, expected_decoder), 1e-6);

  const auto grad = torch::randn_like(encoder);
  torch::autograd::backward({encoder, decoder}, {grad, grad});
  // The bias broadcasts over the batch: its gradient is the batch sum, scattered into the buckets.
  const auto batch_grad = grad.sum(0, /*keepdim=*/true);
  EXPECT_LT(max_abs_diff(encoder_weight.grad(), reference_t5_grad(batch_grad, encoder_buckets, 32)), 1e-4);
  EXPECT_LT(max_abs_diff(decoder_weight.grad(), reference_t5_grad(batch_grad, decoder_buckets, 16)), 1e-4);
}

TEST(TorchScript, RopeForwardAndBackward) {
  auto module = load_fixture("rope");
  auto q = torch::randn({2, 5, 4, 8}, torch::requires_grad(true));
  auto k = torch::randn({2, 5, 2, 8}, torch::requires_grad(true));
  const auto positions = torch::randint(0, 4096, {2, 5});
  auto packed = torch::randn({7, 3, 8}, torch::requires_grad(true));
  const auto cu_seqlens = torch::tensor({0, 3, 7}, torch::kInt);
  const auto outputs = module.forward({q, k, positions, packed, cu_seqlens}).toTuple()->elements();

  // inv_freq_i = 100^(-2i/6) / 2 (linear factor 2); the packed sequences restart at 0.
  auto inv_freq = torch::empty({3}, torch::kDouble);
  for (int64_t i = 0; i < 3; ++i) inv_freq[i] = std::pow(100.0, -2.0 * i / 6.0) / 2.0;
  const auto packed_positions = torch::tensor({0, 1, 2, 0, 1, 2, 3});
  EXPECT_LT(max_abs_diff(outputs[0].toTensor(), reference_rope(q.detach(), positions + 2, inv_freq, "neox")), 2e-6);
  EXPECT_LT(max_abs_diff(outputs[1].toTensor(), reference_rope(k.detach(), positions + 2, inv_freq, "neox")), 2e-6);
  EXPECT_LT(max_abs_diff(outputs[2].toTensor(),
                         reference_rope(packed.detach().unsqueeze(0), packed_positions, inv_freq, "gptj", 0.5)[0]),
            2e-6);

  // Backward: the rotation by -angle, i.e. the reference with negated frequencies.
  std::vector<at::Tensor> grads;
  for (const auto& out : outputs) grads.push_back(torch::randn_like(out.toTensor()));
  torch::autograd::backward({outputs[0].toTensor(), outputs[1].toTensor(), outputs[2].toTensor()}, grads);
  EXPECT_LT(max_abs_diff(q.grad(), reference_rope(grads[0], positions + 2, -inv_freq, "neox")), 2e-6);
  EXPECT_LT(max_abs_diff(k.grad(), reference_rope(grads[1], positions + 2, -inv_freq, "neox")), 2e-6);
  const auto expected_packed_grad = reference_rope(grads[2].unsqueeze(0), packed_positions, -inv_freq, "gptj", 0.5)[0];
  EXPECT_LT(max_abs_diff(packed.grad(), expected_packed_grad), 2e-6);

  // Bad cu_seqlens raise inside the scripted module, naming op, argument and value.
  posenc::test::expect_error<std::exception>(
      [&] { module.forward({q, k, positions, packed, torch::tensor({0, 3, 6}, torch::kInt)}); },
      "posenc.rope: cu_seqlens must end at the token count T = 7, got 6");
}

TEST(TorchScript, QkNormRopeAndQueryScaleForwardAndBackward) {
  auto module = load_fixture("qk_norm_rope");
  auto q = torch::randn({2, 5, 4, 8}, torch::dtype(torch::kDouble).requires_grad(true));
  auto k = torch::randn({2, 5, 2, 8}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto positions = torch::randint(0, 40, {2, 5});
  const auto outputs = module.forward({q, k, positions}).toTuple()->elements();

  // The norm and rotation, then a second rotation by the same angles with q times 1 + 0.1 log(1 + floor((p + 1) / 4)):
  // the whole map as a float64 autograd graph, whose gradients are the reference ones.
  auto inv_freq = torch::empty({4}, torch::kDouble);
  for (int64_t i = 0; i < 4; ++i) inv_freq[i] = std::pow(100.0, -2.0 * i / 8.0);
  // The module's weights (float32 parameters: 0.1 i - 0.3 and 0.05 i - 0.4 rounded to float32), in float64.
  auto q_weight = parameter(module, "qk.q_weight").detach().to(at::kDouble).requires_grad_();
  auto k_weight = parameter(module, "qk.k_weight").detach().to(at::kDouble).requires_grad_();
  EXPECT_LT(max_abs_diff(q_weight, torch::arange(8, torch::kDouble) * 0.1 - 0.3), 1e-7);
  const auto angle = positions.to(at::kDouble).unsqueeze(-1) * inv_freq;
  const auto factor = 1 + 0.1 * torch::log1p(torch::floor((positions.to(at::kDouble) + 1) / 4));
  const auto q_norm = reference_qk_norm_rope(q, q_weight, positions, inv_freq, "gemma", "neox");
  const auto k_norm = reference_qk_norm_rope(k, k_weight, positions, inv_freq, "gemma", "neox");
  const auto q_ref = posenc::test::rotate_pairs(q_norm, angle, "neox") * factor.unsqueeze(-1).unsqueeze(-1);
  const auto k_ref = posenc::test::rotate_pairs(k_norm, angle, "neox");
  EXPECT_LT(max_abs_diff(outputs[0].toTensor(), q_ref), 1e-12);
  EXPECT_LT(max_abs_diff(outputs[1].toTensor(), k_ref), 1e-12);

  const auto grad_q = torch::randn_like(q_ref);
  const auto grad_k = torch::randn_like(k_ref);
  torch::autograd::backward({outputs[0].toTensor(), outputs[1].toTensor()}, {grad_q, grad_k});
  const auto expected = torch::autograd::grad({q_ref, k_ref}, {q, k, q_weight, k_weight}, {grad_q, grad_k});
  EXPECT_LT(max_abs_diff(q.grad(), expected[0]), 1e-10);
  EXPECT_LT(max_abs_diff(k.grad(), expected[1]), 1e-10);
  // The weights' gradients are float32, like the weights: one rounding of the float64 sums.
  EXPECT_LT(max_abs_diff(parameter(module, "qk.q_weight").grad(), expected[2]), 1e-5);
  EXPECT_LT(max_abs_diff(parameter(module, "qk.k_weight").grad(), expected[3]), 1e-5);
}

// Per-call frequencies inside a scripted module, and C++'s Module::to(dtype): it converts parameters and buffers,
// so the float64 frequencies, plain attributes of the modules, stay exact.
TEST(TorchScript, ScaledRopeFollowsTheLengthAndKeepsFloat64Frequencies) {
  auto module = load_fixture("scaled_rope");
  module.to(torch::kBFloat16);
  for (const char* name : {"dynamic", "longrope"}) {
    const auto rotary = module.attr(name).toModule();
    EXPECT_EQ(rotary.attr("inv_freq").toTensor().scalar_type(), torch::kDouble) << name;
    EXPECT_EQ(rotary.attr("long_inv_freq").toTensor().scalar_type(), torch::kDouble) << name;
  }
  const auto pairs = [](int64_t rotary_dim) { return torch::arange(0, rotary_dim, 2, torch::kDouble) / rotary_dim; };
  for (const int64_t length : {6, 20}) {
    const auto q = torch::randn({1, length, 2, 16}).to(torch::kBFloat16);
    const auto k = torch::randn({1, length, 1, 16}).to(torch::kBFloat16);
    const auto q8 = torch::randn({1, length, 2, 8});
    const auto k8 = torch::randn({1, length, 1, 8});
    const auto outputs = module.forward({q, k, q8, k8}).toTuple()->elements();
    const auto positions = torch::arange(length);
    // Dynamic NTK: the base grows to 1e4 * (2 L / 8 - 1)^(16 / 14) beyond 8 tokens.
    const double scale = std::max(2.0 * length / 8.0 - 1.0, 1.0);
    const auto dynamic = torch::pow(1e4 * std::pow(scale, 16.0 / 14.0), -pairs(16));
    EXPECT_EQ(outputs[0].toTensor().scalar_type(), torch::kBFloat16);
    EXPECT_LT(max_abs_diff(outputs[0].toTensor(), reference_rope(q, positions, dynamic, "neox")), 3e-2) << length;
    EXPECT_LT(max_abs_diff(outputs[1].toTensor(), reference_rope(k, positions, dynamic, "neox")), 3e-2) << length;
    // LongRoPE: the long factors beyond 8 tokens, attention scale sqrt(1 + ln 4 / ln 8).
    const auto factors = length > 8 ? torch::tensor({3.0, 4.0, 5.0, 6.0}) : torch::tensor({1.0, 1.5, 2.0, 2.5});
    const auto longrope = torch::pow(1e4, -pairs(8)) / factors.to(torch::kDouble);
    const double attention = std::sqrt(1.0 + std::log(4.0) / std::log(8.0));
    EXPECT_LT(max_abs_diff(outputs[2].toTensor(), reference_rope(q8, positions, longrope, "neox", attention)), 2e-6);
    EXPECT_LT(max_abs_diff(outputs[3].toTensor(), reference_rope(k8, positions, longrope, "neox", attention)), 2e-6);
  }
}

TEST(TorchScript, VisionGridAndLearnedFrequencies) {
  auto module = load_fixture("vision");
  auto x = torch::randn({2, 7, 8}, torch::dtype(torch::kDouble).requires_grad(true));
  auto q = torch::randn({2, 5, 2, 8}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto k = torch::randn({2, 5, 1, 8}, at::kDouble);
  const auto positions = torch::tensor({{0.0, -0.5, 0.25, 1.75, -3.0}, {0.0, 2.5, -1.25, 0.5, 4.0}}, at::kDouble);
  const auto outputs = module.forward({x, q, k, positions}).toTuple();
  const auto grid = outputs->elements()[0].toTensor();
  const auto q_out = outputs->elements()[1].toTensor();

  // MAE: token 1 + 3r + c gets [sin(c w), cos(c w), sin(r w), cos(r w)], w = 1, 0.01; the cls token nothing.
  auto table = torch::zeros({7, 8}, at::kDouble);
  for (int64_t n = 0; n < 6; ++n) {
    const double coordinate[2] = {static_cast<double>(n % 3), static_cast<double>(n / 3)};
    for (int64_t block = 0; block < 2; ++block) {
      for (int64_t j = 0; j < 2; ++j) {
        const double angle = coordinate[block] * std::pow(10000.0, -0.5 * static_cast<double>(j));
        table[1 + n][4 * block + j] = std::sin(angle);
        table[1 + n][4 * block + 2 + j] = std::cos(angle);
      }
    }
  }
  EXPECT_LT(max_abs_diff(grid, x.detach() + table), 1e-12);

  // Axial neox: pairs 0, 1 by the row coordinate, 2, 3 by the column, w = 1, 0.01 on each axis.
  const auto w = torch::tensor({1.0, 0.01, 1.0, 0.01}, at::kDouble);
  const auto axis = torch::tensor({0, 0, 1, 1});
  const auto angle = (positions.index_select(0, axis).t() * w).view({1, 5, 1, 4});  // [1, S, 1, pairs]
  const auto x1 = q.detach().narrow(-1, 0, 4), x2 = q.detach().narrow(-1, 4, 4);
  const auto expected_q = torch::cat({x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()}, -1);
  EXPECT_LT(max_abs_diff(q_out, expected_q), 1e-12);

  // Backward: x's gradient passes through; the frequencies' gradient is sum p * (out1 g2 - out2 g1).
  const auto grad = torch::randn_like(q_out);
  torch::autograd::backward({grid, q_out}, {torch::ones_like(grid), grad});
  EXPECT_TRUE(torch::equal(x.grad(), torch::ones_like(x)));
  const auto o1 = q_out.detach().narrow(-1, 0, 4), o2 = q_out.detach().narrow(-1, 4, 4);
  const auto g1 = grad.narrow(-1, 0, 4), g2 = grad.narrow(-1, 4, 4);
  const auto position = positions.index_select(0, axis).t().view({1, 5, 1, 4});
  const auto expected_w = ((o1 * g2 - o2 * g1) * position).sum({0, 1, 2});
  EXPECT_LT(max_abs_diff(parameter(module, "rotary.inv_freq").grad(), expected_w), 1e-12);
}

TEST(TorchScript, ResampledTableForwardAndBackward) {
  auto module = load_fixture("resampled");
  auto x = torch::randn({2, 7, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  const auto out = module.forward({x}).toTensor();

  // Bilinear with aligned corners, 2 x 2 -> 3 x 2: output row h reads source rows at h / 2 (0, 0.5, 1), columns as
  // they are; the cls row is kept.
  const auto weight = parameter(module, "weight").detach();
  auto table = torch::zeros({7, 4}, at::kDouble);
  table[0] = weight[0];
  for (int64_t h = 0; h < 3; ++h) {
    const double t = 0.5 * static_cast<double>(h);
    for (int64_t w = 0; w < 2; ++w) {
      const auto top = weight[1 + w];
      const auto bottom = weight[1 + 2 + w];
      table[1 + 2 * h + w] = top * (1 - t) + bottom * t;
    }
  }
  EXPECT_LT(max_abs_diff(out, x.detach() + table), 1e-12);

  // Backward of sum(out): x's gradient is ones; the table's is the batch (2) times, per source row, the sum of its
  // weights over the output rows (1 + 0.5 = 1.5 for each grid row, 1 for the cls row).
  out.sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), torch::ones_like(x)));
  const auto expected = torch::cat({torch::full({1, 4}, 2.0, at::kDouble), torch::full({4, 4}, 3.0, at::kDouble)});
  EXPECT_LT(max_abs_diff(parameter(module, "weight").grad(), expected), 1e-12);
}
