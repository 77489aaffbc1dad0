// Decoding through a KV cache from plain C++ (posenc::rope_qk_cache_): q rotated in place, k rotated into k_cache and
// v copied into v_cache at each token's slot, against a float64 formula written here (rotate, then place the rows by
// hand) for Hugging Face's bhsd cache and a pool of slots (shd) filled by packed sequences; rope_qk's bits in float32;
// the slot checks and the refusal of autograd, each error naming the op.
#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "rope_reference.h"
#include "test_helpers.h"

namespace {

using posenc::test::expect_error;
using posenc::test::max_abs_diff;
using posenc::test::reference_rope;

const auto kDouble = torch::TensorOptions().dtype(torch::kDouble);

// A copy of `cache` with rows [B, S, H, D] written at slots [B, S]: bhsd caches [B, H, S_max, D] per batch row, or
// the pool [S_max, H, D] ("shd") for every token.
at::Tensor place(const at::Tensor& cache, const std::string& cache_format, const at::Tensor& rows,
                 const at::Tensor& slots) {
  auto out = cache.clone();
  for (int64_t b = 0; b < slots.size(0); ++b) {
    for (int64_t s = 0; s < slots.size(1); ++s) {
      const int64_t slot = slots[b][s].item<int64_t>();
      if (cache_format == "bhsd") {
        out.select(0, b).select(1, slot).copy_(rows[b][s]);
      } else {
        out.select(0, slot).copy_(rows[b][s]);
      }
    }
  }
  return out;
}

TEST(KvCache, BhsdCacheMatchesTheFloat64Formula) {
  torch::manual_seed(0);
  const auto q = torch::randn({2, 5, 4, 10}, kDouble);  // GQA: 4 query heads, 2 kv heads
  const auto k = torch::randn({2, 5, 2, 10}, kDouble);
  const auto v = torch::randn({2, 5, 2, 6}, kDouble);  // v of its own head_dim
  const auto inv_freq = posenc::frequencies::rope(8, 500.0).inv_freq;  // partial: 8 of 10 channels rotated
  const auto positions = torch::tensor({3, 0, 11, 7, 5, 1, 2, 9, 4, 10}, torch::kLong).view({2, 5});
  const auto k_cache = torch::randn({2, 2, 12, 10}, kDouble);
  const auto v_cache = torch::randn({2, 2, 12, 6}, kDouble);
  for (const std::string layout : {"neox", "gptj"}) {
    auto q_out = q.clone();
    auto k_out = k_cache.clone();
    auto v_out = v_cache.clone();
    posenc::rope_qk_cache_(q_out, k, v, k_out, v_out, positions, inv_freq, std::nullopt, "bhsd", 0.75, layout);
    EXPECT_LE(max_abs_diff(q_out, reference_rope(q, positions, inv_freq, layout, 0.75)), 1e-12) << layout;
    const auto k_expected = place(k_cache, "bhsd", reference_rope(k, positions, inv_freq, layout, 0.75), positions);
    EXPECT_LE(max_abs_diff(k_out, k_expected), 1e-12) << layout;
    EXPECT_TRUE(torch::equal(v_out, place(v_cache, "bhsd", v, positions))) << layout;  // copied, and the rest kept
    // Slots nobody writes (6 and 8 of row 0) keep their values, bit for bit.
    EXPECT_TRUE(torch::equal(k_out.select(2, 6).select(0, 0), k_cache.select(2, 6).select(0, 0))) << layout;
    EXPECT_TRUE(torch::equal(k_out.select(2, 8).select(0, 0), k_cache.select(2, 8).select(0, 0))) << layout;
  }
}

TEST(KvCache, PoolOfSlotsFilledByPackedSequences) {
  torch::manual_seed(1);
  const auto q = torch::randn({7, 3, 8}, kDouble);  // thd: two sequences of 3 and 4 tokens
  const auto k = torch::randn({7, 1, 8}, kDouble);
  const auto v = torch::randn({7, 1, 8}, kDouble);
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  const auto cu_seqlens = torch::tensor({0, 3, 7}, torch::kLong);
  const auto cache_positions = torch::tensor({12, 13, 14, 0, 1, 2, 3}, torch::kLong);
  // Without positions each sequence counts from the offset: tokens at 2, 3, 4 and 2, 3, 4, 5.
  const auto rotary_positions = torch::tensor({2, 3, 4, 2, 3, 4, 5}, torch::kLong);
  const auto k_cache = torch::randn({16, 1, 8}, kDouble);
  const auto v_cache = torch::randn({16, 1, 8}, kDouble);
  auto q_out = q.clone();
  auto k_out = k_cache.clone();
  auto v_out = v_cache.clone();
  posenc::rope_qk_cache_(q_out, k, v, k_out, v_out, std::nullopt, inv_freq, cache_positions, "shd", 1.0, "gptj", "thd",
                         2, cu_seqlens);
  EXPECT_LE(max_abs_diff(q_out, reference_rope(q, rotary_positions, inv_freq, "gptj")), 1e-12);
  const auto slots = cache_positions.unsqueeze(0);
  const auto k_rotated = reference_rope(k, rotary_positions, inv_freq, "gptj").unsqueeze(0);
  EXPECT_LE(max_abs_diff(k_out, place(k_cache, "shd", k_rotated, slots)), 1e-12);
  EXPECT_TRUE(torch::equal(v_out, place(v_cache, "shd", v.unsqueeze(0), slots)));
}

TEST(KvCache, Float32EqualsRopeQkBitForBit) {
  torch::manual_seed(2);
  const auto q = torch::randn({2, 4, 8, 64});  // bhsd q and k, positions [S] shared by the batch
  const auto k = torch::randn({2, 2, 8, 64});
  const auto v = torch::randn({2, 2, 8, 64});
  const auto inv_freq = posenc::frequencies::rope(64, 1e6).inv_freq;
  const auto positions = torch::arange(20, 28, torch::kLong);
  auto k_cache = torch::zeros({2, 32, 2, 64});  // bshd cache
  auto v_cache = torch::zeros({2, 32, 2, 64});
  auto q_out = q.clone();
  posenc::rope_qk_cache_(q_out, k, v, k_cache, v_cache, positions, inv_freq, std::nullopt, "bshd", 1.0, "neox",
                         "bhsd");
  const auto [q_rope, k_rope] = posenc::rope_qk(q, k, positions, inv_freq, 1.0, "neox", "bhsd");
  EXPECT_TRUE(torch::equal(q_out, q_rope));
  using torch::indexing::Slice;
  EXPECT_TRUE(torch::equal(k_cache.index({Slice(), Slice(20, 28)}), k_rope.transpose(1, 2)));
  EXPECT_TRUE(torch::equal(v_cache.index({Slice(), Slice(20, 28)}), v.transpose(1, 2)));
  EXPECT_EQ(k_cache.index({Slice(), Slice(0, 20)}).abs().sum().item<float>(), 0.0f);
}

TEST(KvCache, SlotChecksNameTheOpAndWriteNothing) {
  const auto q = torch::randn({2, 3, 4, 8});
  const auto k = torch::randn({2, 3, 2, 8});
  const auto v = torch::randn({2, 3, 2, 8});
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  auto q_in = q.clone();
  auto k_cache = torch::zeros({2, 2, 6, 8});
  auto v_cache = torch::zeros({2, 2, 6, 8});
  const auto call = [&](const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& cache_positions,
                        int64_t offset) {
    posenc::rope_qk_cache_(q_in, k, v, k_cache, v_cache, positions, inv_freq, cache_positions, "bhsd", 1.0, "neox",
                           "bshd", offset);
  };
  const std::string op = "posenc.rope_qk_cache_: ";
  expect_error([&] { call(std::nullopt, std::nullopt, 4); },
               op + "position 6 is outside [0, S_max) with S_max = 6 (the slots of the caches)");
  expect_error([&] { call(std::nullopt, torch::tensor({0, 1, 6}, torch::kLong), 0); },
               op + "cache_positions holds 6 at flat index 2, outside [0, S_max) with S_max = 6");
  expect_error([&] { call(std::nullopt, torch::tensor({0, -1, 2}, torch::kLong), 0); },
               op + "cache_positions holds -1 at flat index 1");
  expect_error([&] { call(torch::tensor({2, 1, 2}, torch::kLong), std::nullopt, 0); },
               op + "tokens 0 and 2 (flat indices [batch * seq]) both go to slot 2 of their batch row's caches");
  expect_error([&] { call(std::nullopt, torch::tensor({{0, 1, 2}, {3, 4, 3}}, torch::kLong), 0); },
               op + "tokens 3 and 5 (flat indices [batch * seq]) both go to slot 3");
  expect_error(
      [&] {
        auto pool = torch::zeros({6, 2, 8});
        auto pool_v = torch::zeros({6, 2, 8});
        posenc::rope_qk_cache_(q_in, k, v, pool, pool_v, std::nullopt, inv_freq, std::nullopt, "shd");
      },
      op + "tokens 0 and 3 (flat indices [batch * seq]) both go to slot 0 of the pooled caches");
  expect_error([&] { call(std::nullopt, torch::arange(4, torch::kLong), 0); },
               op + "cache_positions has shape [4] but needs [S] or [B, S]");
  expect_error(
      [&] {
        posenc::rope_qk_cache_(q_in, k, v, k_cache, v_cache, std::nullopt, inv_freq, std::nullopt, "thd");
      },
      op + "cache_format must be \"bhsd\", \"bshd\" or \"shd\", got \"thd\"");
  expect_error(
      [&] {
        auto wrong = torch::zeros({2, 6, 2, 8});  // a bshd cache called bhsd
        posenc::rope_qk_cache_(q_in, k, v, wrong, v_cache, std::nullopt, inv_freq);
      },
      op + "k_cache has shape [2, 6, 2, 8] in cache_format \"bhsd\"");
  EXPECT_TRUE(torch::equal(q_in, q));  // every refusal before the first write
  EXPECT_EQ(k_cache.abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(v_cache.abs().sum().item<float>(), 0.0f);
}

TEST(KvCache, AutogradIsRefusedOutsideNoGrad) {
  const auto inv_freq = posenc::frequencies::rope(8).inv_freq;
  auto q = torch::randn({1, 2, 2, 8});
  const auto k = torch::randn({1, 2, 1, 8}).requires_grad_();
  const auto v = torch::randn({1, 2, 1, 8});
  auto k_cache = torch::zeros({1, 1, 4, 8});
  auto v_cache = torch::zeros({1, 1, 4, 8});
  expect_error([&] { posenc::rope_qk_cache_(q, k, v, k_cache, v_cache, std::nullopt, inv_freq); },
               "posenc.rope_qk_cache_: a tensor requires grad, but the op has no backward");
  {
    torch::NoGradGuard no_grad;
    posenc::rope_qk_cache_(q, k, v, k_cache, v_cache, std::nullopt, inv_freq);
  }
  EXPECT_GT(k_cache.abs().sum().item<float>(), 0.0f);
}

}  // namespace
