#pragma once
// The angle engine shared by every family: angle(p, i) = p * inv_freq[i], formed and range-reduced in
// float64, then sin/cos in the maths type (float32 for fp16/bf16/fp32 data, float64 for float64 data).
#include <cmath>
#include <cstdint>
#include <cstring>

namespace posenc {

// pi/2 in three parts (fdlibm's pio2_1, pio2_2, pio2_2t): the first has 33 bits, so k * kHalfPi1 is exact
// for |k| < 2^20 quarter turns and the reduction needs no fma (which would be a libm call, not a vector op).
constexpr double kHalfPi1 = 1.57079632673412561417e+00;
constexpr double kHalfPi2 = 6.07710050630396597660e-11;
constexpr double kHalfPi3 = 2.02226624879595063154e-21;
constexpr double kTwoOverPi = 0.6366197723675814;
constexpr double kRoundMagic = 6755399441055744.0;   // 1.5 * 2^52: x + magic - magic rounds x to an integer

// sin and cos of position * inv_freq[i] for a whole row of frequencies. The float32 version is plain
// arithmetic with no libm call, so the compiler vectorizes the loop: a float64 reduction to
// [-pi/4, pi/4] by quarter turns, then the minimax polynomials of Cephes' sinf/cosf (error < 2e-7).
// The reduction must be float64: at p = 2^20 a float32 product p * w alone is off by up to 0.06 rad.
inline void sincos_row(double position, const double* inv_freq, int64_t n, float* sin_out, float* cos_out) {
  for (int64_t i = 0; i < n; ++i) {
    const double angle = position * inv_freq[i];
    const double shifted = angle * kTwoOverPi + kRoundMagic;
    const double quarter_turns = shifted - kRoundMagic;
    const float x = static_cast<float>(((angle - quarter_turns * kHalfPi1) - quarter_turns * kHalfPi2) -
                                       quarter_turns * kHalfPi3);
    int64_t bits;
    std::memcpy(&bits, &shifted, sizeof(bits));  // the low bits of the shifted value are the integer part
    const float z = x * x;
    const float s = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * x + x;
    const float c = ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z -
                    0.5f * z + 1.0f;
    const bool odd = bits & 1;  // quadrants 1 and 3 swap sin and cos
    const float sin_value = odd ? c : s;
    const float cos_value = odd ? s : c;
    sin_out[i] = (bits & 2) ? -sin_value : sin_value;
    cos_out[i] = ((bits + 1) & 2) ? -cos_value : cos_value;
  }
}

inline void sincos_row(double position, const double* inv_freq, int64_t n, double* sin_out, double* cos_out) {
  for (int64_t i = 0; i < n; ++i) {
    sin_out[i] = std::sin(position * inv_freq[i]);
    cos_out[i] = std::cos(position * inv_freq[i]);
  }
}

}  // namespace posenc
