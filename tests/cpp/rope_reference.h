#pragma once
// float64 RoPE written from the definition, shared by the rotary C++ tests.
#include <ATen/ATen.h>

#include <string>

namespace posenc::test {

// x [..., S, H, D] rotated in float64 from the definition: pair i of the layout, (x1, x2), becomes
// (x1 cos - x2 sin, x2 cos + x1 sin) * scale with angle [..., S, F]; channels past 2F pass through.
inline at::Tensor rotate_pairs(const at::Tensor& x, const at::Tensor& angle, const std::string& layout,
                               double scale = 1.0) {
  using at::indexing::Slice;
  const int64_t pairs = angle.size(-1);
  const auto xd = x.to(at::kDouble);
  auto out = xd.clone();
  const auto cos = (angle.cos() * scale).unsqueeze(-2);  // [..., S, 1, F]
  const auto sin = (angle.sin() * scale).unsqueeze(-2);
  const auto first = layout == "neox" ? Slice(0, pairs) : Slice(0, 2 * pairs, 2);
  const auto second = layout == "neox" ? Slice(pairs, 2 * pairs) : Slice(1, 2 * pairs, 2);
  const auto x1 = xd.index({"...", first});
  const auto x2 = xd.index({"...", second});
  out.index_put_({"...", first}, x1 * cos - x2 * sin);
  out.index_put_({"...", second}, x2 * cos + x1 * sin);
  return out;
}

// x [..., S, H, D] with positions broadcastable to [..., S]: pairs (x1, x2) of the layout become
// (x1 cos - x2 sin, x2 cos + x1 sin) * scale, angle = p * inv_freq; channels past 2F pass through.
inline at::Tensor reference_rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq,
                                 const std::string& layout, double scale = 1.0) {
  return rotate_pairs(x, positions.to(at::kDouble).unsqueeze(-1) * inv_freq.to(at::kDouble), layout, scale);
}

// bshd x [B, S, H, D] RMS-normalized in groups of weight.size(0) channels (each head, or all heads of a token), times
// the weight (1 + weight for "gemma"), then rotated by angle = (positions + offset) * inv_freq (positions [S] or
// [B, S]), times scale; channels past the rotary ones pass through unscaled. In float64, no rounding: the formula
// every convention computes, and a differentiable one (autograd gives the reference gradients).
inline at::Tensor reference_qk_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& positions,
                                  const at::Tensor& inv_freq, const std::string& norm, const std::string& layout,
                                  double scale = 1.0, double eps = 1e-6, int64_t offset = 0) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  const int64_t group = weight.size(0);
  const auto rows = x.reshape({B, S, H * D / group, group});
  const auto w = norm == "gemma" ? weight + 1 : weight;
  const auto z = (rows * (rows.pow(2).mean(-1, /*keepdim=*/true) + eps).rsqrt() * w).reshape({B, S, H, D});
  return rotate_pairs(z, (positions.to(at::kDouble) + offset).unsqueeze(-1) * inv_freq.to(at::kDouble), layout,
                      scale);
}

}  // namespace posenc::test
