#pragma once
// The angle engine every family shares: angle(p, i) = p * inv_freq[i], formed in float64, then sin and cos
// in the maths type (float32 for fp16/bf16/fp32 data, float64 for float64 data).
//
// The float32 result is sin/cos of the float64 angle fl(p * w), rounded to float32, to within 2e-7, for
// every angle: a row whose angles all lie within kFastAngle is reduced by quarter turns in float64 with
// plain arithmetic (so the loop vectorizes); any other row, and every float64 result, takes posenc's own
// sin/cos (portable/libm.h), whose reduction is exact for any argument and whose bits are the same on every
// CPU and on the GPU. The reduction must be float64: at p = 2^20 a float32 product p * w alone is off by up
// to 0.06 rad.
#include "portable/libm.h"
#include "portable/macros.h"
#include "portable/types.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace posenc::portable {

// pi/2 in four parts (round to nearest, 26 bits at a time): the first three have at most 26 significant
// bits, so q * part is exact for every quarter-turn count |q| < 2^27, and the reduction is as exact as the
// float64 angle itself without fma (a libm call, not a vector instruction, where the CPU lacks FMA).
constexpr double kHalfPi1 = 0x1.921fb58p+0;
constexpr double kHalfPi2 = -0x1.dde974p-27;
constexpr double kHalfPi3 = 0x1.1a6263p-54;
constexpr double kHalfPi4 = 0x1.8a2e03707344ap-81;
constexpr double kTwoOverPi = 0x1.45f306dc9c883p-1;
constexpr double kRoundMagic = 0x1.8p+52;  // 1.5 * 2^52: x + magic - magic rounds x to an integer
// Angles up to 2^26 rad (quarter turns below 2^26) take the fast reduction: positions up to 6.7e7 at
// inv_freq 1, which covers every context length in use.
constexpr double kFastAngle = 0x1p+26;
// The minimax polynomials of Cephes' sinf/cosf on [-pi/4, pi/4]:
// sin x = ((kSin3 z + kSin2) z - kSin1) z x + x, cos x = ((kCos3 z - kCos2) z + kCos1) z z - z / 2 + 1, z = x^2.
constexpr float kSin3 = -1.9515295891e-4f, kSin2 = 8.3321608736e-3f, kSin1 = 1.6666654611e-1f;
constexpr float kCos3 = 2.443315711809948e-5f, kCos2 = 1.388731625493765e-3f, kCos1 = 4.166664568298827e-2f;

inline namespace POSENC_KERNEL_NAMESPACE {

// sin and cos of an angle with |angle| <= kFastAngle: reduced to [-pi/4, pi/4] by the nearest quarter turn,
// then the minimax polynomials of Cephes' sinf/cosf (error < 2e-7); NaN or infinite angles give NaN.
POSENC_INLINE void sincos_reduced(double angle, float& sin_out, float& cos_out) {
  const double shifted = angle * kTwoOverPi + kRoundMagic;
  const double q = shifted - kRoundMagic;
  const float x =
      static_cast<float>((((angle - q * kHalfPi1) - q * kHalfPi2) - q * kHalfPi3) - q * kHalfPi4);
  int64_t bits;
  std::memcpy(&bits, &shifted, sizeof(bits));  // the low bits of the shifted value are those of q
  const float z = x * x;
  const float s = ((kSin3 * z + kSin2) * z - kSin1) * z * x + x;
  const float c = ((kCos3 * z - kCos2) * z + kCos1) * z * z - 0.5f * z + 1.0f;
  const bool odd = bits & 1;  // quarter turns 1 and 3 swap sin and cos
  const float sin_value = odd ? c : s;
  const float cos_value = odd ? s : c;
  sin_out = (bits & 2) ? -sin_value : sin_value;
  cos_out = ((bits + 1) & 2) ? -cos_value : cos_value;
}

// sin and cos of any angle, correctly rounded but in the rarest cases (portable/libm.h): the path of angles
// beyond the fast reduction, and of every float64 result.
POSENC_INLINE void sincos_exact(double angle, float& sin_out, float& cos_out) {
  DoubleDouble s, c;
  libm::sincos(angle, s, c);
  sin_out = libm::to_float(s);
  cos_out = libm::to_float(c);
}

POSENC_INLINE void sincos_exact(double angle, double& sin_out, double& cos_out) {
  DoubleDouble s, c;
  libm::sincos(angle, s, c);
  sin_out = s.hi;
  cos_out = c.hi;
}

#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 2 && \
    (defined(__x86_64__) || defined(__i386__))
#define POSENC_SINCOS_BY_AVX512 1
// sincos_reduced(position * inv_freq[i]) for the first i < n, 32 a step in the AVX-512 build: the same operations
// in the same order (so the same bits), the four 8-lane chains interleaved, where GCC's vector loop walked one
// 16-pair chain at a time and waited on its latency (the table of 64 x 512 pairs, one thread: 1.13-1.16x as fast).
// Multi-axis rows (sincos_row_axes) gather their positions and measured no faster so. Returns the count done (a
// multiple of 32).
inline int64_t sincos_reduced_x32(double position, const double* inv_freq, int64_t n, float* sin_out,
                                  float* cos_out) {
  constexpr int kChains = 4;  // of 8 doubles, then 2 of 16 floats
  const __m512d p = _mm512_set1_pd(position), magic = _mm512_set1_pd(kRoundMagic);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512d shifted[kChains], r[kChains];
    for (int j = 0; j < kChains; ++j) r[j] = _mm512_mul_pd(p, _mm512_loadu_pd(inv_freq + i + 8 * j));  // the angle
    for (int j = 0; j < kChains; ++j) {
      shifted[j] = _mm512_add_pd(_mm512_mul_pd(r[j], _mm512_set1_pd(kTwoOverPi)), magic);
    }
    __m512d q[kChains];
    for (int j = 0; j < kChains; ++j) q[j] = _mm512_sub_pd(shifted[j], magic);
    for (const double part : {kHalfPi1, kHalfPi2, kHalfPi3, kHalfPi4}) {
      for (int j = 0; j < kChains; ++j) r[j] = _mm512_sub_pd(r[j], _mm512_mul_pd(q[j], _mm512_set1_pd(part)));
    }
    __m512 x[2], z[2], s[2], c[2];
    __m512i quadrant[2];
    for (int k = 0; k < 2; ++k) {
      x[k] = _mm512_maskz_insertf32x8(0xFFFF, _mm512_castps256_ps512(_mm512_maskz_cvtpd_ps(0xFF, r[2 * k])),
                                      _mm512_maskz_cvtpd_ps(0xFF, r[2 * k + 1]), 1);
      // the quarter-turn count's low bits: the low halves of the shifted values' bits
      const __m256i low = _mm512_maskz_cvtepi64_epi32(0xFF, _mm512_castpd_si512(shifted[2 * k]));
      const __m256i high = _mm512_maskz_cvtepi64_epi32(0xFF, _mm512_castpd_si512(shifted[2 * k + 1]));
      quadrant[k] = _mm512_maskz_inserti64x4(0xFF, _mm512_castsi256_si512(low), high, 1);
    }
    for (int k = 0; k < 2; ++k) z[k] = _mm512_mul_ps(x[k], x[k]);
    for (int k = 0; k < 2; ++k) {
      s[k] = _mm512_mul_ps(_mm512_set1_ps(kSin3), z[k]);
      c[k] = _mm512_mul_ps(_mm512_set1_ps(kCos3), z[k]);
    }
    for (int k = 0; k < 2; ++k) {
      s[k] = _mm512_mul_ps(_mm512_add_ps(s[k], _mm512_set1_ps(kSin2)), z[k]);
      c[k] = _mm512_mul_ps(_mm512_sub_ps(c[k], _mm512_set1_ps(kCos2)), z[k]);
    }
    for (int k = 0; k < 2; ++k) {
      s[k] = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(s[k], _mm512_set1_ps(kSin1)), z[k]), x[k]);
      c[k] = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(c[k], _mm512_set1_ps(kCos1)), z[k]), z[k]);
    }
    for (int k = 0; k < 2; ++k) {
      s[k] = _mm512_add_ps(s[k], x[k]);
      c[k] = _mm512_add_ps(_mm512_sub_ps(c[k], _mm512_mul_ps(_mm512_set1_ps(0.5f), z[k])), _mm512_set1_ps(1.0f));
    }
    for (int k = 0; k < 2; ++k) {  // quarter turns 1 and 3 swap sin and cos; 2 and 3 negate sin, 1 and 2 cos
      const __mmask16 odd = _mm512_test_epi32_mask(quadrant[k], _mm512_set1_epi32(1));
      const __mmask16 sin_negative = _mm512_test_epi32_mask(quadrant[k], _mm512_set1_epi32(2));
      const __mmask16 cos_negative =
          _mm512_test_epi32_mask(_mm512_add_epi32(quadrant[k], _mm512_set1_epi32(1)), _mm512_set1_epi32(2));
      const __m512 sin_value = _mm512_mask_blend_ps(odd, s[k], c[k]);
      const __m512 cos_value = _mm512_mask_blend_ps(odd, c[k], s[k]);
      _mm512_storeu_ps(sin_out + i + 16 * k, _mm512_mask_xor_ps(sin_value, sin_negative, sin_value, sign));
      _mm512_storeu_ps(cos_out + i + 16 * k, _mm512_mask_xor_ps(cos_value, cos_negative, cos_value, sign));
    }
  }
  return i;
}
#endif

#if !defined(__CUDACC__)
// sin and cos of position * inv_freq[i] for i < n on a path chosen already: the fast reduction (`fast`, every
// angle within kFastAngle) or the exact one. float64 results always take the exact one.
inline void sincos_row_on_path(double position, const double* inv_freq, int64_t n, bool fast, float* sin_out,
                               float* cos_out) {
  if (fast) {
    int64_t i = 0;
#if defined(POSENC_SINCOS_BY_AVX512)
    i = sincos_reduced_x32(position, inv_freq, n, sin_out, cos_out);
#endif
    for (; i < n; ++i) sincos_reduced(position * inv_freq[i], sin_out[i], cos_out[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) sincos_exact(position * inv_freq[i], sin_out[i], cos_out[i]);
}

inline void sincos_row_on_path(double position, const double* inv_freq, int64_t n, bool /*fast*/, double* sin_out,
                               double* cos_out) {
  for (int64_t i = 0; i < n; ++i) sincos_exact(position * inv_freq[i], sin_out[i], cos_out[i]);
}

// sin and cos of position * inv_freq[i] for i < n; max_abs_freq = max_i |inv_freq[i]| picks the path (far
// positions, and NaN or infinite ones, take the exact one).
template <typename opmath_t>
void sincos_row(double position, const double* inv_freq, int64_t n, double max_abs_freq, opmath_t* sin_out,
                opmath_t* cos_out) {
  sincos_row_on_path(position, inv_freq, n, std::abs(position) * max_abs_freq <= kFastAngle, sin_out, cos_out);
}
#endif

// Multi-axis rotary (images, video, multimodal text): a token has one position per axis (time, height, width,
// ...) and frequency pair i follows the axis pair_axis[i], so its angle is positions[pair_axis[i]] * inv_freq[i],
// the same float64 product as a one-axis angle. Every pair_axis[i] lies in [0, n_axes) (checked by the caller).
POSENC_INLINE double pair_angle(const double* positions, const int32_t* pair_axis, const double* inv_freq,
                                int64_t i) {
  return positions[pair_axis[i]] * inv_freq[i];
}

// The position index read by row p (portable/types.h's SequenceRows), or -1 for a prefix token.
POSENC_INLINE int64_t sequence_position(const SequenceRows& rows, int64_t p) {
  if (rows.prefix == 0) return p;
  const int64_t s = p % rows.period;
  return s < rows.prefix ? -1 : (p / rows.period) * (rows.period - rows.prefix) + s - rows.prefix;
}

#if !defined(__CUDACC__)
// sin and cos of pair_angle(positions, pair_axis, inv_freq, i) for i < n, positions holding the token's n_axes
// positions. The path is sincos_row's, chosen by the largest of them: the fast reduction when every angle
// lies within kFastAngle. The loop gathers each pair's position (a vector gather where the capability has
// one), so interleaved sections cost what contiguous ones do.
// Whether a token with these n_axes positions takes the fast reduction: every one of its angles within kFastAngle.
inline bool fast_angles(const double* positions, int64_t n_axes, double max_abs_freq) {
  bool fast = true;
  for (int64_t a = 0; a < n_axes; ++a) fast = fast && std::abs(positions[a]) * max_abs_freq <= kFastAngle;
  return fast;
}

inline void sincos_row_axes(const double* positions, int64_t n_axes, const int32_t* pair_axis,
                            const double* inv_freq, int64_t n, double max_abs_freq, float* sin_out, float* cos_out) {
  if (fast_angles(positions, n_axes, max_abs_freq)) {
    for (int64_t i = 0; i < n; ++i) {
      sincos_reduced(pair_angle(positions, pair_axis, inv_freq, i), sin_out[i], cos_out[i]);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {  // far positions
    sincos_exact(pair_angle(positions, pair_axis, inv_freq, i), sin_out[i], cos_out[i]);
  }
}

inline void sincos_row_axes(const double* positions, int64_t /*n_axes*/, const int32_t* pair_axis,
                            const double* inv_freq, int64_t n, double /*max_abs_freq*/, double* sin_out,
                            double* cos_out) {
  for (int64_t i = 0; i < n; ++i) sincos_exact(pair_angle(positions, pair_axis, inv_freq, i), sin_out[i], cos_out[i]);
}
#endif

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
