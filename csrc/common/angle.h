#pragma once
// The angle engine shared by every family: angle(p, i) = p * inv_freq[i], formed and range-reduced in
// float64, then sin/cos in the maths type (float32 for fp16/bf16/fp32 data, float64 for float64 data).
#include <cmath>

namespace posenc {

constexpr double kTwoPiHi = 6.283185307179586;       // the double nearest 2*pi
constexpr double kTwoPiLo = 2.4492935982947064e-16;  // 2*pi - kTwoPiHi
constexpr double kInvTwoPi = 0.15915494309189535;

// Cody-Waite reduction to [-pi, pi]: a float32 sin of p * w at p = 2^20 would otherwise lose all
// accuracy, because the float32 product alone is off by up to 2^20 * 2^-24 = 0.06 rad.
inline double reduce_angle(double angle) {
  const double turns = std::nearbyint(angle * kInvTwoPi);
  return std::fma(-turns, kTwoPiLo, std::fma(-turns, kTwoPiHi, angle));
}

template <typename opmath_t>
struct SinCos {
  opmath_t sin;
  opmath_t cos;
};

template <typename opmath_t>
inline SinCos<opmath_t> sincos(double angle) {
  if constexpr (sizeof(opmath_t) == sizeof(double)) {
    return {std::sin(angle), std::cos(angle)};
  } else {
    const float reduced = static_cast<float>(reduce_angle(angle));
    return {std::sin(reduced), std::cos(reduced)};
  }
}

}  // namespace posenc
