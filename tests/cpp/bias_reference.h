#pragma once
// float64 ALiBi and T5 references written from the formulas, shared by the C++ tests.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace posenc::test {

// The paper's slopes as geometric series: ratio 2^(-8/n) for the first n = 2^floor(log2 H) heads, then every
// other term of the 2n-head series (ratio 2^(-4/n)).
inline at::Tensor reference_alibi_slopes(int64_t num_heads) {
  const auto n = static_cast<int64_t>(std::exp2(std::floor(std::log2(static_cast<double>(num_heads)))));
  auto out = at::empty({num_heads}, at::kDouble);
  for (int64_t k = 1; k <= n; ++k) out[k - 1] = std::pow(std::exp2(-8.0 / n), k);
  for (int64_t j = 1; j <= num_heads - n; ++j) out[n + j - 1] = std::pow(std::exp2(-4.0 / n), 2 * j - 1);
  return out;
}

// [B or 1, num_heads, Q, K]: -m * d (causal) or -m * |d| (symmetric), d = i + (K - Q) - j,
// m = slopes[b or 0, head_offset + h] for slopes [H] or [B, H].
inline at::Tensor reference_alibi_bias(const at::Tensor& slopes, int64_t q_len, int64_t k_len, bool symmetric,
                                       int64_t head_offset, int64_t num_heads) {
  const auto m = (slopes.dim() == 1 ? slopes.unsqueeze(0) : slopes).to(at::kDouble);
  auto out = at::empty({m.size(0), num_heads, q_len, k_len}, at::kDouble);
  auto bias = out.accessor<double, 4>();
  for (int64_t b = 0; b < m.size(0); ++b) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const double slope = m[b][head_offset + h].item<double>();
      for (int64_t i = 0; i < q_len; ++i) {
        for (int64_t j = 0; j < k_len; ++j) {
          const double d = static_cast<double>(i + k_len - q_len - j);
          bias[b][h][i][j] = -slope * (symmetric ? std::abs(d) : d);
        }
      }
    }
  }
  return out;
}

// T5's bucket as Mesh TensorFlow defines it, with T5's float32 log term and truncation.
inline int64_t reference_t5_bucket(int64_t relative, bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  int64_t per_direction = num_buckets;
  int64_t bucket = 0;
  int64_t n = std::max<int64_t>(-relative, 0);
  if (bidirectional) {
    per_direction = num_buckets / 2;
    bucket = relative > 0 ? per_direction : 0;
    n = std::abs(relative);
  }
  const int64_t exact = per_direction / 2;
  if (n < exact) return bucket + n;
  const float log_ratio = static_cast<float>(std::log(static_cast<double>(max_distance) / exact));
  const float scaled = std::log(static_cast<float>(n) / exact) / log_ratio * static_cast<float>(per_direction - exact);
  return bucket + std::min<int64_t>(exact + static_cast<int64_t>(scaled), per_direction - 1);
}

// The buckets [Q, K] of queries at q_offset + i against keys at j.
inline at::Tensor reference_t5_buckets(int64_t q_len, int64_t k_len, bool bidirectional, int64_t num_buckets,
                                       int64_t max_distance, int64_t q_offset) {
  auto out = at::empty({q_len, k_len}, at::kLong);
  auto buckets = out.accessor<int64_t, 2>();
  for (int64_t i = 0; i < q_len; ++i) {
    for (int64_t j = 0; j < k_len; ++j) {
      buckets[i][j] = reference_t5_bucket(j - i - q_offset, bidirectional, num_buckets, max_distance);
    }
  }
  return out;
}

// bias [1, H, Q, K] = weight[bucket(i, j), h], float64.
inline at::Tensor reference_t5_bias(const at::Tensor& weight, const at::Tensor& buckets) {
  return weight.to(at::kDouble).index_select(0, buckets.flatten()).view({buckets.size(0), buckets.size(1), -1})
      .permute({2, 0, 1}).unsqueeze(0);
}

// d/d weight of sum(bias * grad): grad [1, H, Q, K] summed into its buckets, float64 [num_buckets, H].
inline at::Tensor reference_t5_grad(const at::Tensor& grad, const at::Tensor& buckets, int64_t num_buckets) {
  const auto rows = grad.to(at::kDouble)[0].permute({1, 2, 0}).reshape({-1, grad.size(1)});
  return at::zeros({num_buckets, grad.size(1)}, at::kDouble).index_add_(0, buckets.flatten(), rows);
}

}  // namespace posenc::test
