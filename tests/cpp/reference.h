#pragma once
// float64 references written from the formulas, shared by the C++ tests.
#include <ATen/ATen.h>

#include <cmath>
#include <string>

namespace posenc::test {

// omega_i = base^(-i / (dim // 2 - shift)), as loops over doubles.
inline at::Tensor reference_frequencies(int64_t dim, double base, int64_t shift) {
  auto out = at::empty({dim / 2}, at::kDouble);
  for (int64_t i = 0; i < dim / 2; ++i) out[i] = std::pow(base, -static_cast<double>(i) / (dim / 2 - shift));
  return out;
}

// PE of integer positions [n] -> [n, width], zero past 2F.
inline at::Tensor reference_pe(const at::Tensor& positions, const at::Tensor& inv_freq, const std::string& layout,
                               int64_t width) {
  const int64_t pairs = inv_freq.size(0);
  auto out = at::zeros({positions.size(0), width}, at::kDouble);
  auto pe = out.accessor<double, 2>();
  const auto w = inv_freq.to(at::kDouble).contiguous();
  for (int64_t n = 0; n < positions.size(0); ++n) {
    const double p = positions[n].item<double>();
    for (int64_t i = 0; i < pairs; ++i) {
      const double angle = p * w[i].item<double>();
      if (layout == "interleaved") {
        pe[n][2 * i] = std::sin(angle);
        pe[n][2 * i + 1] = std::cos(angle);
      } else {
        pe[n][i] = std::sin(angle);
        pe[n][pairs + i] = std::cos(angle);
      }
    }
  }
  return out;
}

}  // namespace posenc::test
