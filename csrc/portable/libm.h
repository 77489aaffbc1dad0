#pragma once
// posenc's own exp, log, pow and sin/cos, for the values whose bits must not depend on the machine: every
// configuration formula (frequencies, slopes, scales, T5's bucket edges) and the angles that leave the fast
// quarter-turn reduction of angle.h. A system libm picks its code for the CPU it runs on (glibc has FMA and
// non-FMA variants of exp, log, pow, sin and cos; ATen's vectorized exp differs again between AVX2 and
// AVX-512; CUDA has its own), and those round differently in the last bit now and then.
//
// Everything here is IEEE-754 float64 addition, subtraction, multiplication, division and integer arithmetic,
// each correctly rounded by the standard, in a fixed order, compiled without contraction into FMA
// (-ffp-contract=off, nvcc --fmad=false): the same bits on every CPU, every capability and the GPU. The
// functions evaluate in double-double arithmetic (a value hi + lo carried to about 2^-104 relative) and round
// once at the end, so each result is the correctly rounded value of the exact function except where the exact
// value lies within about 2^-100 of a rounding boundary, which no input of ours has been seen to hit.
#include "portable/macros.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace posenc::portable {

// hi + lo with |lo| <= ulp(hi) / 2: hi is the value rounded to float64.
struct DoubleDouble {
  double hi;
  double lo;
};

// The bits of 2/pi after the binary point, 64 to a word (the first word holds bits 1..64): enough for the
// quarter-turn reduction of every finite float64 (its largest exponent reads up to bit 1163).
#define POSENC_TWO_OVER_PI_WORDS                                                                                     \
  0xa2f9836e4e441529ull, 0xfc2757d1f534ddc0ull, 0xdb6295993c439041ull, 0xfe5163abdebbc561ull, 0xb7246e3a424dd2e0ull, \
      0x06492eea09d1921cull, 0xfe1deb1cb129a73eull, 0xe88235f52ebb4484ull, 0xe99c7026b45f7e41ull,                    \
      0x3991d639835339f4ull, 0x9c845f8bbdf9283bull, 0x1ff897ffde05980full, 0xef2f118b5a0a6d1full,                    \
      0x6d367ecf27cb09b7ull, 0x4f463f669e5fea2dull, 0x7527bac7ebe5f17bull, 0x3d0739f78a5292eaull,                    \
      0x6bfb5fb11f8d5d08ull, 0x56033046fc7b6babull, 0xf0cfbc209af4361dull

// sin(j pi/64) for j = 0 ... 32 in double-double (hi, lo pairs); cos(j pi/64) = sin((32 - j) pi/64).
#define POSENC_SIN_PI_OVER_64 \
    0x0.0p+0, 0x0.0p+0, 0x1.91f65f10dd814p-5, -0x1.912bd0d569a90p-61, 0x1.917a6bc29b42cp-4, -0x1.e2718d26ed688p-60, \
    0x1.2c8106e8e613ap-3, 0x1.13000a89a11e0p-58, 0x1.8f8b83c69a60bp-3, -0x1.26d19b9ff8d82p-57, 0x1.f19f97b215f1bp-3, -0x1.42deef11da2c4p-57, \
    0x1.294062ed59f06p-2, -0x1.5d28da2c4612dp-56, 0x1.58f9a75ab1fddp-2, -0x1.efdc0d58cf620p-62, 0x1.87de2a6aea963p-2, -0x1.72cedd3d5a610p-57, \
    0x1.b5d1009e15cc0p-2, 0x1.5b362cb974183p-57, 0x1.e2b5d3806f63bp-2, 0x1.e0d891d3c6841p-58, 0x1.073879922ffeep-1, -0x1.a5a014347406cp-55, \
    0x1.1c73b39ae68c8p-1, 0x1.b25dd267f6600p-55, 0x1.30ff7fce17035p-1, -0x1.efcc626f74a6fp-57, 0x1.44cf325091dd6p-1, 0x1.8076a2cfdc6b3p-57, \
    0x1.57d69348ceca0p-1, -0x1.75720992bfbb2p-55, 0x1.6a09e667f3bcdp-1, -0x1.bdd3413b26456p-55, 0x1.7b5df226aafafp-1, -0x1.0f537acdf0ad7p-56, \
    0x1.8bc806b151741p-1, -0x1.2c5e12ed1336dp-55, 0x1.9b3e047f38741p-1, -0x1.30ee286712474p-55, 0x1.a9b66290ea1a3p-1, 0x1.9f630e8b6dac8p-60, \
    0x1.b728345196e3ep-1, -0x1.bc69f324e6d61p-55, 0x1.c38b2f180bdb1p-1, -0x1.6e0b1757c8d07p-56, 0x1.ced7af43cc773p-1, -0x1.e7b6bb5ab58aep-58, \
    0x1.d906bcf328d46p-1, 0x1.457e610231ac2p-56, 0x1.e212104f686e5p-1, -0x1.014c76c126527p-55, 0x1.e9f4156c62ddap-1, 0x1.760b1e2e3f81ep-55, \
    0x1.f0a7efb9230d7p-1, 0x1.52c7adc6b4989p-56, 0x1.f6297cff75cb0p-1, 0x1.562172a361fd3p-56, 0x1.fa7557f08a517p-1, -0x1.7a0a8ca13571fp-55, \
    0x1.fd88da3d12526p-1, -0x1.87df6378811c7p-55, 0x1.ff621e3796d7ep-1, -0x1.c57bc2e24aa15p-57, 0x1.0000000000000p+0, 0x0.0p+0

#if defined(__CUDACC__)
static __device__ const uint64_t kTwoOverPiWordsDevice[] = {POSENC_TWO_OVER_PI_WORDS};
static __device__ const double kSinPiOver64Device[] = {POSENC_SIN_PI_OVER_64};
#endif
inline constexpr uint64_t kTwoOverPiWords[] = {POSENC_TWO_OVER_PI_WORDS};
inline constexpr double kSinPiOver64[] = {POSENC_SIN_PI_OVER_64};

inline namespace POSENC_KERNEL_NAMESPACE {
namespace libm {

// pi/64 and ln 2 in double-double; ln 2 also in three parts whose first has 42 bits, so that k * part is exact
// for every |k| < 2^11.
constexpr DoubleDouble kPiOver64 = {0x1.921fb54442d18p-5, 0x1.1a62633145c07p-59};
constexpr DoubleDouble kLn2 = {0x1.62e42fefa39efp-1, 0x1.abc9e3b39803fp-56};
constexpr double kLn2Part1 = 0x1.62e42fefa38p-1;
constexpr double kLn2Part2 = 0x1.ef35793c76730p-45;
constexpr double kLn2Part3 = 0x1.f97b57a079a19p-103;

// ---- double-double arithmetic (Dekker, Knuth): exact sums and products of two doubles, then normalized.

POSENC_INLINE DoubleDouble two_sum(double a, double b) {
  const double s = a + b;
  const double b_virtual = s - a;
  return {s, (a - (s - b_virtual)) + (b - b_virtual)};
}

POSENC_INLINE DoubleDouble fast_two_sum(double a, double b) {  // |a| >= |b| or a == 0
  const double s = a + b;
  return {s, b - (s - a)};
}

POSENC_INLINE DoubleDouble two_prod(double a, double b) {  // |a|, |b| < 2^996 (Veltkamp's split would overflow)
  constexpr double kSplit = 134217729.0;                    // 2^27 + 1
  const double p = a * b;
  const double ca = kSplit * a;
  const double a_hi = ca - (ca - a);
  const double a_lo = a - a_hi;
  const double cb = kSplit * b;
  const double b_hi = cb - (cb - b);
  const double b_lo = b - b_hi;
  return {p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo};
}

POSENC_INLINE DoubleDouble add(DoubleDouble a, DoubleDouble b) {
  DoubleDouble s = two_sum(a.hi, b.hi);
  const DoubleDouble t = two_sum(a.lo, b.lo);
  s = fast_two_sum(s.hi, s.lo + t.hi);
  return fast_two_sum(s.hi, s.lo + t.lo);
}

POSENC_INLINE DoubleDouble neg(DoubleDouble a) { return {-a.hi, -a.lo}; }

POSENC_INLINE DoubleDouble mul(DoubleDouble a, DoubleDouble b) {
  const DoubleDouble p = two_prod(a.hi, b.hi);
  return fast_two_sum(p.hi, p.lo + (a.hi * b.lo + a.lo * b.hi));
}

POSENC_INLINE DoubleDouble mul(DoubleDouble a, double b) {
  const DoubleDouble p = two_prod(a.hi, b);
  return fast_two_sum(p.hi, p.lo + a.lo * b);
}

POSENC_INLINE DoubleDouble div(DoubleDouble a, DoubleDouble b) {  // long division, three quotient digits
  const double q1 = a.hi / b.hi;
  DoubleDouble r = add(a, neg(mul(b, q1)));
  const double q2 = r.hi / b.hi;
  r = add(r, neg(mul(b, q2)));
  const double q3 = r.hi / b.hi;
  return add(fast_two_sum(q1, q2), DoubleDouble{q3, 0.0});
}

POSENC_INLINE DoubleDouble div(DoubleDouble a, double b) {  // one quotient digit and its exact remainder
  const double q = a.hi / b;
  const DoubleDouble p = two_prod(q, b);
  return fast_two_sum(q, (((a.hi - p.hi) - p.lo) + a.lo) / b);
}

// k ln 2 for an integer |k| < 2^11, to about 2^-150.
POSENC_INLINE DoubleDouble times_ln2(double k) {
  return add(add(DoubleDouble{k * kLn2Part1, 0.0}, two_prod(k, kLn2Part2)), DoubleDouble{k * kLn2Part3, 0.0});
}

// ---- exp and log

// e^x for a double-double x.
POSENC_INLINE DoubleDouble exp(DoubleDouble x) {
  if (x.hi != x.hi) return {x.hi, 0.0};
  if (x.hi > 709.8) return {std::numeric_limits<double>::infinity(), 0.0};
  if (x.hi < -745.2) return {0.0, 0.0};
  // e^x = 2^k e^r with |r| <= ln2 / 2, and e^r = (e^(r / 256))^256: the series of e^(r/256) - 1 needs ten terms,
  // and the squarings y -> y (2 + y) keep the result minus one, whose relative precision they preserve.
  const double k = std::floor(x.hi * 0x1.71547652b82fep+0 + 0.5);
  const DoubleDouble r = add(x, neg(times_ln2(k)));
  const DoubleDouble t = {r.hi * 0x1p-8, r.lo * 0x1p-8};
  DoubleDouble series = {1.0, 0.0};  // 1 + t/2 (1 + t/3 (... (1 + t/10)))
  for (int n = 10; n >= 2; --n) series = add(DoubleDouble{1.0, 0.0}, div(mul(series, t), static_cast<double>(n)));
  DoubleDouble y = mul(series, t);  // e^t - 1
  for (int i = 0; i < 8; ++i) y = mul(y, add(DoubleDouble{2.0, 0.0}, y));
  const DoubleDouble e = add(DoubleDouble{1.0, 0.0}, y);
  const int scale = static_cast<int>(k);
  return {std::ldexp(e.hi, scale), std::ldexp(e.lo, scale)};
}

// ln x for a double-double x > 0 (0 gives -inf, a negative or NaN x NaN, +inf +inf).
POSENC_INLINE DoubleDouble log(DoubleDouble x) {
  if (!(x.hi > 0.0)) {
    return {x.hi == 0.0 ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN(), 0.0};
  }
  if (x.hi == std::numeric_limits<double>::infinity()) return {x.hi, 0.0};
  // x = 2^k m with m in [sqrt(1/2), sqrt(2)); ln m = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), s = (m-1)/(m+1),
  // |s| <= 0.172: 22 terms reach 2^-110.
  int k;
  double m_hi = std::frexp(x.hi, &k);
  double m_lo = std::ldexp(x.lo, -k);
  if (m_hi < 0x1.6a09e667f3bcdp-1) {
    m_hi *= 2.0;
    m_lo *= 2.0;
    --k;
  }
  const DoubleDouble m = two_sum(m_hi, m_lo);
  const DoubleDouble s = div(add(m, DoubleDouble{-1.0, 0.0}), add(m, DoubleDouble{1.0, 0.0}));
  const DoubleDouble s2 = mul(s, s);
  DoubleDouble series = div(DoubleDouble{1.0, 0.0}, 43.0);
  for (int n = 20; n >= 0; --n) series = add(div(DoubleDouble{1.0, 0.0}, 2.0 * n + 1.0), mul(series, s2));
  const DoubleDouble ln_m = mul(mul(s, series), 2.0);
  return add(times_ln2(static_cast<double>(k)), ln_m);
}

POSENC_INLINE double exp(double x) { return exp(DoubleDouble{x, 0.0}).hi; }
POSENC_INLINE double log(double x) { return log(DoubleDouble{x, 0.0}).hi; }

// base^exponent for base > 0.
POSENC_INLINE DoubleDouble pow(double base, DoubleDouble exponent) {
  return exp(mul(log(DoubleDouble{base, 0.0}), exponent));
}
POSENC_INLINE double pow(double base, double exponent) { return pow(base, DoubleDouble{exponent, 0.0}).hi; }

// 2^x, exact where x is an integer.
POSENC_INLINE double exp2(DoubleDouble x) {
  const double k = std::floor(x.hi + 0.5);
  return std::ldexp(exp(mul(add(x, DoubleDouble{-k, 0.0}), kLn2)).hi, static_cast<int>(k));
}

// hi + lo rounded to float once: rounding hi alone is right except where hi is halfway between two floats.
POSENC_INLINE float to_float(DoubleDouble x) {
  const float f = static_cast<float>(x.hi);
  const double back = f;
  if (back == x.hi || x.lo == 0.0 || !(f - f == 0.0f)) return f;
  const float toward = x.hi > back ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
#if defined(__CUDA_ARCH__)
  const float other = nextafterf(f, toward);
#else
  const float other = std::nextafter(f, toward);
#endif
  if (x.hi != 0.5 * (back + static_cast<double>(other))) return f;  // no tie: lo cannot cross the midpoint
  return (x.lo > 0.0) == (other > f) ? other : f;
}

POSENC_INLINE float logf(float x) { return to_float(log(DoubleDouble{x, 0.0})); }

// ---- sin and cos

POSENC_INLINE uint64_t mul_wide(uint64_t a, uint64_t b, uint64_t& high) {
#if defined(__CUDA_ARCH__)
  high = __umul64hi(a, b);
#else
  high = static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
  return a * b;
}

POSENC_INLINE int leading_zeros(uint64_t v) {  // v != 0
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(v));
#else
  return __builtin_clzll(v);
#endif
}

// a = j pi/64 + r for a finite a > pi/128: j mod 128 and r in [-pi/128, pi/128] to about 2^-110 relative, by
// the bits of 2/pi (Payne and Hanek). With a = m 2^e (m an integer below 2^53), a 64/pi = m 2^(e+5) 2/pi mod 128
// needs the bits of 2/pi from 2^-(e-1) on: those before add multiples of 128. 192 of them times m leave at least
// 185 bits after the point, of which the closest a float64 comes to a multiple of pi/2 (about 2^-61 away)
// cancels fewer than 64.
POSENC_INLINE void reduce_pi_over_64(double a, int& j, DoubleDouble& r) {
#if defined(__CUDA_ARCH__)
  const uint64_t* words = kTwoOverPiWordsDevice;
#else
  const uint64_t* words = kTwoOverPiWords;
#endif
  uint64_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  const int e = static_cast<int>(bits >> 52) - 1075;
  const uint64_t m = (bits & ((uint64_t{1} << 52) - 1)) | (uint64_t{1} << 52);
  const int first = e - 1 > 1 ? e - 1 : 1;  // the first bit of 2/pi taken, counted from 1 after the point
  const int word = (first - 1) / 64;
  const int bit = (first - 1) % 64;
  // The 192 bits of 2/pi from `first` on, in three words (scalars, not an array: a GPU would keep an indexed array
  // in local memory).
  const auto window = [&](int i) {
    return bit == 0 ? words[word + i] : (words[word + i] << bit) | (words[word + i + 1] >> (64 - bit));
  };
  // p = m * window in four words, p0 the lowest.
  uint64_t h0, h1, h2;
  const uint64_t l0 = mul_wide(m, window(0), h0);
  const uint64_t l1 = mul_wide(m, window(1), h1);
  const uint64_t l2 = mul_wide(m, window(2), h2);
  const uint64_t p0 = l2;
  const uint64_t p1 = h2 + l1;
  uint64_t carry = p1 < l1;
  uint64_t p2 = h1 + carry;
  carry = p2 < carry;
  p2 += l0;
  carry += p2 < l0;
  const uint64_t p3 = h0 + carry;
  // a 64/pi = p 2^-point: j is the 7 bits from the point up, the fraction the 128 bits below them.
  const int point = first + 186 - e;  // 185 ... 245
  const int shift = point - 128;      // 57 ... 117: p >> shift starts in word 0 or 1
  const bool from_word1 = shift >= 64;
  const int sb = shift % 64;
  const uint64_t q0 = from_word1 ? p1 : p0;
  const uint64_t q1 = from_word1 ? p2 : p1;
  const uint64_t q2 = from_word1 ? p3 : p2;
  const uint64_t q3 = from_word1 ? 0 : p3;
  const auto funnel = [sb](uint64_t low, uint64_t high) { return sb == 0 ? low : (low >> sb) | (high << (64 - sb)); };
  const uint64_t z0 = funnel(q0, q1);
  const uint64_t z1 = funnel(q1, q2);
  const uint64_t z2 = funnel(q2, q3);
  j = static_cast<int>(z2 & 127);
  uint64_t f_hi = z1;
  uint64_t f_lo = z0;
  const bool negative = f_hi >> 63;  // a fraction of at least 1/2 rounds up to the next j
  if (negative) {
    j = (j + 1) & 127;
    f_lo = ~f_lo + 1;
    f_hi = ~f_hi + (f_lo == 0);
  }
  if (f_hi == 0 && f_lo == 0) {
    r = {0.0, 0.0};
    return;
  }
  // The fraction f 2^-128 as a double-double: its leading 53 bits, then the next 75.
  const int lz = f_hi != 0 ? leading_zeros(f_hi) : 64 + leading_zeros(f_lo);
  if (lz >= 64) {
    f_hi = f_lo << (lz - 64);
    f_lo = 0;
  } else if (lz > 0) {
    f_hi = (f_hi << lz) | (f_lo >> (64 - lz));
    f_lo <<= lz;
  }
  const double head = std::ldexp(static_cast<double>(f_hi >> 11), -53 - lz);
  const double tail =
      std::ldexp(static_cast<double>(f_hi & 0x7ff), -64 - lz) + std::ldexp(static_cast<double>(f_lo), -128 - lz);
  const DoubleDouble fraction = fast_two_sum(head, tail);
  r = mul(negative ? neg(fraction) : fraction, kPiOver64);
}

// sin and cos of x in double-double (NaN for NaN and infinities): x = j pi/64 + r, then sin(j pi/64 + r) and
// cos(j pi/64 + r) from the table and the Taylor series of sin r and cos r, |r| <= pi/128, whose terms from r^7
// and r^6 on (below 2^-43 and 2^-37 of the result) are summed in float64.
POSENC_INLINE void sincos(double x, DoubleDouble& sin_out, DoubleDouble& cos_out) {
  if (!(x - x == 0.0)) {
    sin_out = cos_out = {std::numeric_limits<double>::quiet_NaN(), 0.0};
    return;
  }
#if defined(__CUDA_ARCH__)
  const double* table = kSinPiOver64Device;
#else
  const double* table = kSinPiOver64;
#endif
  const double a = std::fabs(x);
  int j = 0;
  DoubleDouble r = {a, 0.0};
  if (a > 0x1.921fb54442d18p-6) reduce_pi_over_64(a, j, r);
  const DoubleDouble r2 = mul(r, r);
  const DoubleDouble r3 = mul(r2, r);
  const double t = r2.hi;
  // sin r = r - r^3/6 + r^5/120 + r^5 (-r^2/7! + r^4/9! - r^6/11! + r^8/13!), cos r = 1 - r^2/2 + r^4/24 + r^4 (-r^2/6! +
  // r^4/8! - r^6/10! + r^8/12!): the next terms are below 2^-110 of the result.
  const DoubleDouble sin_low = add(add(r, neg(div(r3, 6.0))), div(mul(r3, r2), 120.0));
  const double sin_tail = (((t / 6227020800.0 - 1.0 / 39916800.0) * t + 1.0 / 362880.0) * t - 1.0 / 5040.0) * t;
  const DoubleDouble sin_r = add(sin_low, DoubleDouble{r3.hi * t * sin_tail, 0.0});
  const DoubleDouble cos_low = add(add(DoubleDouble{1.0, 0.0}, neg(div(r2, 2.0))), div(mul(r2, r2), 24.0));
  const double cos_tail = (((t / 479001600.0 - 1.0 / 3628800.0) * t + 1.0 / 40320.0) * t - 1.0 / 720.0) * t;
  const DoubleDouble cos_r = add(cos_low, DoubleDouble{t * t * cos_tail, 0.0});
  // x = (j / 32) quarter turns + (j mod 32) pi/64 + r
  const int k = j & 31;
  const DoubleDouble sin_k = {table[2 * k], table[2 * k + 1]};
  const DoubleDouble cos_k = {table[2 * (32 - k)], table[2 * (32 - k) + 1]};
  const DoubleDouble s = add(mul(sin_k, cos_r), mul(cos_k, sin_r));
  const DoubleDouble c = add(mul(cos_k, cos_r), neg(mul(sin_k, sin_r)));
  // quarter turns 1 and 3 swap sin and cos; 1 and 2 negate sin, 2 and 3 negate cos
  const int quadrant = j >> 5;
  const DoubleDouble sin_q = (quadrant & 1) ? c : s;
  const DoubleDouble cos_q = (quadrant & 1) ? s : c;
  sin_out = ((quadrant & 2) != 0) != std::signbit(x) ? neg(sin_q) : sin_q;
  cos_out = ((quadrant + 1) & 2) ? neg(cos_q) : cos_q;
}

}  // namespace libm
}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
