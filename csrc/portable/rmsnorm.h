#pragma once
// RMS normalization of a row before its rotation (qk_norm_rope), written once for the CPU kernels of every
// capability and the GPU:
//   r = 1 / sqrt(sum(x^2) / n + eps),   xhat = x * r,   z = w * xhat,
// and its backward from the gradient gz of z:
//   gw += gz * xhat,   gxhat = gz * w,   gx = r * (gxhat - xhat * sum(gxhat * xhat) / n).
// Sums run over 16 lanes (lane j adds channels j, j + 16, ... in order) folded by a fixed tree, so every CPU
// capability, whatever its vector width, adds in the same order and gives the same bits; a GPU whose 16 threads
// take the lanes and fold them by shuffles does too.
#include "portable/convert.h"
#include "portable/macros.h"
#include "portable/rotary.h"
#include "portable/types.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace posenc::portable {
inline namespace POSENC_KERNEL_NAMESPACE {

constexpr int kSumLanes = 16;

// Tokens per partial sum of the weights' gradients: a function of the token count alone, so that the sums, each in
// token order and then folded chunk by chunk in float64, come out the same for every thread count and on the GPU.
POSENC_INLINE int64_t norm_tokens_per_chunk(int64_t tokens) {
  const int64_t spread = (tokens + 1023) / 1024;  // at most 1024 chunks
  return spread > 16 ? spread : 16;
}

// The sum of term(i), i < n, over the lanes.
template <typename T, typename Term>
POSENC_INLINE T lane_sum(int64_t n, const Term& term) {
  T lane[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int j = 0; j < kSumLanes; ++j) lane[j] += term(i + j);
  }
  for (int j = 0; i + j < n; ++j) lane[j] += term(i + j);
  // The tree written out: with a loop over the widths the compilers fold it one scalar at a time through memory.
  static_assert(kSumLanes == 16, "the fold below is written for 16 lanes");
  for (int j = 0; j < 8; ++j) lane[j] += lane[j + 8];
  for (int j = 0; j < 4; ++j) lane[j] += lane[j + 4];
  for (int j = 0; j < 2; ++j) lane[j] += lane[j + 2];
  return lane[0] + lane[1];
}

// The sum of a[i] * b[i], i < n, over the lanes.
template <typename T>
POSENC_INLINE T lane_dot(const T* a, const T* b, int64_t n) {
  return lane_sum<T>(n, [&](int64_t i) { return a[i] * b[i]; });
}

// lane_dot(g, xhat) with xhat = x * r formed here: the same products, so the same bits, as from a stored xhat.
template <typename T>
POSENC_INLINE T normalized_dot(const T* g, const T* x, T r, int64_t n) {
  return lane_sum<T>(n, [&](int64_t i) { return g[i] * (x[i] * r); });
}

// 1 / sqrt(mean(x^2) + eps): both IEEE operations are correctly rounded on every CPU and (without fast maths) the GPU.
template <typename T>
POSENC_INLINE T inverse_rms(T sum_squares, int64_t n, T eps) {
  using std::sqrt;
  return T(1) / sqrt(sum_squares / static_cast<T>(n) + eps);
}

// v rounded to scalar_t and back: the intermediate rounding of the "llama", "gemma" and "olmo2" conventions.
// bf16 stays in 32-bit lanes (the high half rounded to nearest even, the low half cleared; every NaN to c10's
// 0x7FC0): the same bits as the round trip, without packing to 16 bits and widening back, which took about half
// of the "llama" forward's vector instructions.
template <typename scalar_t, typename T>
POSENC_INLINE T round_to(T v) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<T, float>) {
    const uint32_t bits = float_to_bits(v);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    return bits_to_float(v != v ? 0x7FC00000u : rounded);
#if defined(POSENC_HAS_F16C)
  } else if constexpr (std::is_same_v<scalar_t, c10::Half> && std::is_same_v<T, float>) {
    // one instruction each way, where the integer forms were called out of line (the same bits: convert.h)
    return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  } else {
    return to_opmath(from_opmath<scalar_t>(v));
  }
}

// x * r rounded as round_to rounds it, for x a value of the input and r the inverse_rms of its values. On the CPU, in
// bf16, every NaN there carries its payload in the high half (a bf16 NaN widened and propagated, or x86's default NaN
// 0xFFC00000: eps is finite), so the integer form adds at most 0x8000 to a zero low half, carries nothing into the
// high half, and leaves each NaN a NaN: round_to's select is not needed (5-6 ns of a head's 58 in cache). Not on the
// GPU, whose arithmetic may return a NaN as 0x7FFFFFFF (PTX's canonical NaN), which the carry turns into -0; nor for
// the weight's product, whose NaN may come from a float32 weight with any payload.
template <typename scalar_t, typename T>
POSENC_INLINE T round_normalized(T v) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<T, float>) {
    const uint32_t bits = float_to_bits(v);
    return bits_to_float((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
  }
#endif
  return round_to<scalar_t>(v);
}

// One channel of the normalized row, z = w * x * r with r the row's inverse_rms, rounded as the convention rounds it
// before the rotation.
template <QkNorm kConvention, typename scalar_t, typename T>
POSENC_INLINE T rms_scale(T x, T w, T r) {
  if constexpr (kConvention == QkNorm::Llama) {
    return round_to<scalar_t>(w * round_normalized<scalar_t>(x * r));
  } else if constexpr (kConvention == QkNorm::Fused) {
    return w * (x * r);
  } else {
    return round_to<scalar_t>(w * (x * r));
  }
}

#if !defined(__CUDACC__)
// Pair i of a head (channels (i, i + pairs) for neox, (2i, 2i + 1) for gptj): its channels x normalized by r with
// weights w, rounded as the convention rounds them, rotated and stored in out (channel step os).
template <RopeLayout kLayout, QkNorm kConvention, typename scalar_t, typename T>
POSENC_INLINE void rms_scale_rotate_pair(const T* x, const T* w, T r, PairCoeffs<T> k, int64_t pairs, int64_t i,
                                         scalar_t* out, int64_t os) {
  const int64_t d = kLayout == RopeLayout::Neox ? i : 2 * i;
  const int64_t partner = d + (kLayout == RopeLayout::Neox ? pairs : 1);
  const T a = rms_scale<kConvention, scalar_t>(x[d], w[d], r);
  const T b = rms_scale<kConvention, scalar_t>(x[partner], w[partner], r);
  out[d * os] = from_opmath<scalar_t>(rotate_first(a, b, k.c1[i], k.s1[i]));
  out[partner * os] = from_opmath<scalar_t>(rotate_second(a, b, k.c2[i], k.s2[i]));
}

// One head of a token: its channels x (maths precision, contiguous) normalized by r with weights w, then rotated as
// rotate_row rotates them and stored, in one pass; the channels past 2 * pairs are stored normalized. A kernel forms
// the r of all of a token's heads before it calls this: their sums are then independent, and the core overlaps them
// instead of waiting on each head's sum, square root and division in turn.
template <RopeLayout kLayout, QkNorm kConvention, bool kUnit, typename scalar_t, typename T>
inline void rms_scale_rotate_row(const T* x, const T* w, T r, PairCoeffs<T> k, int64_t pairs, int64_t head_dim,
                                 scalar_t* out, int64_t out_step) {
  const int64_t os = kUnit ? 1 : out_step;
  POSENC_NO_CARRIED_DEPENDENCY
  for (int64_t i = 0; i < pairs; ++i) rms_scale_rotate_pair<kLayout, kConvention>(x, w, r, k, pairs, i, out, os);
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d * os] = from_opmath<scalar_t>(rms_scale<kConvention, scalar_t>(x[d], w[d], r));
}
#endif

#if defined(POSENC_BF16_BY_AVX512BF16)
// Pairs [i, i + 16) of rms_scale_rotate_row's contiguous neox head in float32, rounded between the steps by
// vcvtne2ps2bf16 two vectors at a time (convert.h): the same products, sums and roundings as the integer form. The
// first channels of the pairs in `first`, their partners in `second`; kChecked: false where a rounding met a denormal
// or a NaN (rounds_apart), and the pairs must be redone by the integer form. Unchecked where rounds_clean has shown
// that no rounding of the head can meet one.
template <QkNorm kConvention, bool kChecked>
POSENC_TARGET_AVX512BF16 POSENC_INLINE bool rms_scale_rotate_bf16x16_pairs(const float* x, const float* w, __m512 r,
                                                                           PairCoeffs<float> k, int64_t pairs,
                                                                           int64_t i, __m512& first, __m512& second) {
  __mmask16 apart = 0;
  __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + i), r);
  __m512 b = _mm512_mul_ps(_mm512_loadu_ps(x + pairs + i), r);
  if constexpr (kConvention == QkNorm::Llama) {
    if constexpr (kChecked) apart |= rounds_apart(a) | rounds_apart(b);
    round_bf16x32(a, b);
  }
  a = _mm512_mul_ps(_mm512_loadu_ps(w + i), a);
  b = _mm512_mul_ps(_mm512_loadu_ps(w + pairs + i), b);
  if constexpr (kConvention != QkNorm::Fused) {
    if constexpr (kChecked) apart |= rounds_apart(a) | rounds_apart(b);
    round_bf16x32(a, b);
  }
  rotate_pairs16(a, b, k, i, first, second);
  if constexpr (!kChecked) return true;
  return (apart | rounds_apart(first) | rounds_apart(second)) == 0;
}

// The least nonzero and the largest magnitude among some values (Magnitudes), gathered 16 floats or 32 bf16 at a time
// as their bits doubled (the sign shifted out), whose unsigned order is the order of the magnitudes with every NaN
// above infinity; less 2 for the least, so that a zero wraps to the top and never wins. `least` is infinity where
// every value is zero, NaN where only NaNs are not; `largest` is NaN where any value is.
struct Magnitudes {
  float least;
  float largest;
};

inline constexpr Magnitudes kUnknownMagnitudes{__builtin_nanf(""), __builtin_nanf("")};  // proves nothing

class FloatMagnitudes {
 public:
  FloatMagnitudes() : least_(_mm512_set1_epi32(-1)), largest_(_mm512_setzero_si512()) {}
  void add(const float* v, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) fold(_mm512_maskz_slli_epi32(0xFFFF, _mm512_loadu_si512(v + i), 1));
    const auto rest = static_cast<__mmask16>((1u << (n - i)) - 1);
    if (i < n) fold(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_loadu_epi32(rest, v + i), 1));
  }
  Magnitudes get() const {
    const uint32_t least = least_of(least_);
    const uint32_t largest = 0xFFFFFFFFu - least_of(_mm512_maskz_xor_epi32(0xFFFF, largest_, _mm512_set1_epi32(-1)));
    return {least >= 0xFFFFFFFEu ? __builtin_inff() : bits_to_float((least + 2) >> 1), bits_to_float(largest >> 1)};
  }

 private:
  static uint32_t least_of(__m512i v) {  // of 16 unsigned 32-bit lanes
    const __m256i eight = _mm256_min_epu32(_mm512_maskz_extracti64x4_epi64(0xF, v, 0),
                                           _mm512_maskz_extracti64x4_epi64(0xF, v, 1));
    __m128i four = _mm_min_epu32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
    four = _mm_min_epu32(four, _mm_shuffle_epi32(four, _MM_SHUFFLE(1, 0, 3, 2)));
    four = _mm_min_epu32(four, _mm_shuffle_epi32(four, _MM_SHUFFLE(2, 3, 0, 1)));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(four));
  }
  // a masked load's zeros are zeros: they never win
  void fold(__m512i doubled) {
    least_ = _mm512_maskz_min_epu32(0xFFFF, least_, _mm512_maskz_sub_epi32(0xFFFF, doubled, _mm512_set1_epi32(2)));
    largest_ = _mm512_maskz_max_epu32(0xFFFF, largest_, doubled);
  }
  __m512i least_;
  __m512i largest_;
};

class BFloat16Magnitudes {
 public:
  BFloat16Magnitudes() : least_(_mm512_set1_epi32(-1)), largest_(_mm512_setzero_si512()) {}
  // n a multiple of 32
  void add(const c10::BFloat16* v, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) {
      const __m512i doubled = _mm512_maskz_slli_epi16(0xFFFFFFFFu, _mm512_loadu_si512(v + i), 1);
      const __m512i less_two = _mm512_maskz_sub_epi16(0xFFFFFFFFu, doubled, _mm512_set1_epi16(2));
      least_ = _mm512_maskz_min_epu16(0xFFFFFFFFu, least_, less_two);
      largest_ = _mm512_maskz_max_epu16(0xFFFFFFFFu, largest_, doubled);
    }
  }
  Magnitudes get() const {
    const uint32_t least = least_of(least_);
    const uint32_t largest = 0xFFFFu - least_of(_mm512_maskz_xor_epi32(0xFFFF, largest_, _mm512_set1_epi32(-1)));
    return {least >= 0xFFFEu ? __builtin_inff() : bits_to_float(((least + 2) >> 1) << 16),
            bits_to_float((largest >> 1) << 16)};
  }

 private:
  static uint32_t least_of(__m512i v) {  // of 32 unsigned 16-bit lanes, by phminposuw
    const __m256i eight = _mm256_min_epu16(_mm512_maskz_extracti64x4_epi64(0xF, v, 0),
                                           _mm512_maskz_extracti64x4_epi64(0xF, v, 1));
    const __m128i four = _mm_min_epu16(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(four)) & 0xFFFF);
  }
  __m512i least_;
  __m512i largest_;
};

// Whether no rounding of rms_scale_rotate_bf16x16_pairs can meet a denormal or a NaN in any head of a token, proved
// from bounds: its channels x (magnitudes), their inverse RMS r in [r_least, r_largest], the weights w and the
// coefficients c (magnitudes). Each step's least nonzero and largest magnitude follow from the last's by the same
// product or rounding, which are monotone in magnitude: x * r, rounded for "llama"; times w, rounded but for "fused";
// each rounded value must be normal (at least 2^-126). A rotated value is a sum or difference of two products of a
// value and a coefficient, each zero or at least P = 2^-103, so each a multiple of 2^-126 (float32 keeps 24 bits):
// a nonzero sum is normal too. Below 2Q = 2^127 no sum reaches infinity, so none is a NaN either. A NaN anywhere among
// the bounds fails a comparison: nothing proved. Real heads pass, unless a nonzero value lies some 2^-90 below its
// head's RMS (weights and coefficients about 1); tokens that fail take the checked path, whose bits are the same.
template <QkNorm kConvention>
inline bool rounds_clean(Magnitudes x, float r_least, float r_largest, Magnitudes w, Magnitudes c) {
  constexpr float kNormal = 0x1p-126f;
  if (!(r_largest <= 0x1p127f)) return false;
  float least = x.least * r_least, largest = x.largest * r_largest;
  if constexpr (kConvention == QkNorm::Llama) {
    if (!(least >= kNormal)) return false;
    least = round_to<c10::BFloat16>(least);
    largest = round_to<c10::BFloat16>(largest);
  }
  least *= w.least;
  largest *= w.largest;
  if constexpr (kConvention != QkNorm::Fused) {
    if (!(least >= kNormal)) return false;
    least = round_to<c10::BFloat16>(least);
    largest = round_to<c10::BFloat16>(largest);
  }
  return least * c.least >= 0x1p-103f && largest * c.largest <= 0x1p126f;
}

// rms_scale_rotate_row of a contiguous bf16 head rotated whole in neox pairs (a multiple of 16) by
// rms_scale_rotate_bf16x16_pairs, each 16 pairs (32 where pairs is a multiple of 32) checked before they are
// stored and redone by the integer form where the check asks for it (kChecked; else rounds_clean). 32 pairs at a
// time, their first channels are one 64-byte line and their partners another, each stored by one instruction:
// 1.07-1.09x the forward against 16 at a time in half lines (in-process A/B, q, k [4, 2048, 16|8, 128], 1 and 2
// threads). Where `stream`, those lines go past the caches (out on a 64-byte line): alone 0.92-0.94x on Zen 4, but
// with the next token asked for a head at a time, the two together 1.15-1.25x on Emerald Rapids (rope.cpp's
// normalize_rotate_heads).
template <QkNorm kConvention, bool kChecked>
POSENC_TARGET_AVX512BF16 inline void rms_scale_rotate_neox_bf16(const float* x, const float* w, float r,
                                                                PairCoeffs<float> k, int64_t pairs,
                                                                c10::BFloat16* out, bool stream) {
  const __m512 vr = _mm512_set1_ps(r);
  __m512 first, second, first2, second2;
  const int64_t step = pairs % 32 == 0 ? 32 : 16;
  for (int64_t i = 0; i < pairs; i += step) {
    if (step == 16) {
      if (rms_scale_rotate_bf16x16_pairs<kConvention, kChecked>(x, w, vr, k, pairs, i, first, second)) {
        store_bf16x32(first, second, out + i, out + pairs + i);
        continue;
      }
    } else if (rms_scale_rotate_bf16x16_pairs<kConvention, kChecked>(x, w, vr, k, pairs, i, first, second) &&
               rms_scale_rotate_bf16x16_pairs<kConvention, kChecked>(x, w, vr, k, pairs, i + 16, first2, second2)) {
      store_bf16x32_line(first, first2, out + i, stream);
      store_bf16x32_line(second, second2, out + pairs + i, stream);
      continue;
    }
    for (int64_t j = i; j < i + step; ++j) {
      rms_scale_rotate_pair<RopeLayout::Neox, kConvention>(x, w, r, k, pairs, j, out, 1);
    }
  }
}
#endif

#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX >= 1 && \
    (defined(__x86_64__) || defined(__i386__))
// rms_scale_rotate_row of a contiguous float32 head rotated in neox pairs, a vector of them a step (16 in the AVX-512
// build, 8 in AVX2; pairs a multiple of 16), sent past the caches from registers (out on a 64-byte line): every
// convention is w * (x * r) in float32. The channels past 2 * pairs are stored normalized by ordinary stores. The
// AVX2 build's, against its ordinary stores (which read every line they write), separate processes, q, k
// [4, 2048, 16|8, 128], 2 threads: 1.42-2.18x (6 pairs, median 1.7x).
inline void rms_scale_rotate_neox_f32_streamed(const float* x, const float* w, float r, PairCoeffs<float> k,
                                               int64_t pairs, int64_t head_dim, float* out) {
#if POSENC_CPU_CAPABILITY_INDEX == 2
  constexpr int64_t kStep = 16;
  using Vec = __m512;
  const auto mul = [&](Vec a, Vec b) { return _mm512_mul_ps(a, b); };
  const auto load = [&](const float* p) { return _mm512_loadu_ps(p); };
  const auto rotate = [&](Vec a, Vec b, int64_t i, Vec& first, Vec& second) { rotate_pairs16(a, b, k, i, first, second); };
  const auto stream = [&](float* p, Vec v) { _mm512_stream_ps(p, v); };
  const Vec vr = _mm512_set1_ps(r);
#else
  constexpr int64_t kStep = 8;
  using Vec = __m256;
  const auto mul = [&](Vec a, Vec b) { return _mm256_mul_ps(a, b); };
  const auto load = [&](const float* p) { return _mm256_loadu_ps(p); };
  const auto rotate = [&](Vec a, Vec b, int64_t i, Vec& first, Vec& second) { rotate_pairs8(a, b, k, i, first, second); };
  const auto stream = [&](float* p, Vec v) { _mm256_stream_ps(p, v); };
  const Vec vr = _mm256_set1_ps(r);
#endif
  for (int64_t i = 0; i < pairs; i += kStep) {
    Vec first, second;
    rotate(mul(load(w + i), mul(load(x + i), vr)), mul(load(w + pairs + i), mul(load(x + pairs + i), vr)), i, first,
           second);
    stream(out + i, first);
    stream(out + pairs + i, second);
  }
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d] = w[d] * (x[d] * r);
}
#endif

#if defined(POSENC_HAS_F16C) && defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX >= 1
// rms_scale_rotate_row of a contiguous fp16 head rotated in neox pairs, a vector of pairs a step (16 in the AVX-512
// build, 8 in AVX2; pairs a multiple of it): the conventions' roundings to fp16 and back by vcvtps2ph and vcvtph2ps
// (round_to's), the outputs rounded by vcvtps2ph (from_opmath's), so the same operations on the same values as the
// row's loop, and the same bits. The channels past 2 * pairs go by that loop's per-channel form. The row's loop had
// called the integer forms out of line, value by value: q, k [4, 2048, 16|8, 128] fp16 forward 240 -> 5.5 ms (2
// threads; bf16 5.0), in cache 15 -> 0.31 ms a call ([1, 256, 16|8, 128], one thread; AVX2 0.48). Where `stream`
// (pairs a multiple of 32, out on a 64-byte line), the lines go past the caches: two steps a line in the AVX-512
// build, four stored as two halves in AVX2's (AVX2, in-process A/B against its ordinary stores, q, k
// [4, 2048, 16|8, 128], with the backward's input gradients streamed likewise: 1.06-1.15x the forward on 2 threads,
// 1.11x on one; fwd+bwd 1.02-1.08x).
template <QkNorm kConvention>
inline void rms_scale_rotate_neox_half(const float* x, const float* w, float r, PairCoeffs<float> k, int64_t pairs,
                                       int64_t head_dim, c10::Half* out, bool stream) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#if POSENC_CPU_CAPABILITY_INDEX == 2
  constexpr int64_t kStep = 16;
  using Vec = __m512;
  const auto mul = [&](Vec a, Vec b) { return _mm512_mul_ps(a, b); };
  const auto load = [&](const float* p) { return _mm512_loadu_ps(p); };
  // (the masked forms: GCC 12 warns of its own placeholder in the unmasked conversions)
  const auto narrow16 = [&](Vec v) { return _mm512_maskz_cvtps_ph(0xFFFF, v, kNearest); };
  const auto round_half = [&](Vec v) { return _mm512_maskz_cvtph_ps(0xFFFF, narrow16(v)); };
  const auto store = [&](c10::Half* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow16(v)); };
  const auto rotate = [&](Vec a, Vec b, int64_t i, Vec& first, Vec& second) { rotate_pairs16(a, b, k, i, first, second); };
  const Vec vr = _mm512_set1_ps(r);
#else
  constexpr int64_t kStep = 8;
  using Vec = __m256;
  const auto mul = [&](Vec a, Vec b) { return _mm256_mul_ps(a, b); };
  const auto load = [&](const float* p) { return _mm256_loadu_ps(p); };
  const auto round_half = [&](Vec v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, kNearest)); };
  const auto store = [&](c10::Half* p, Vec v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kNearest));
  };
  const auto rotate = [&](Vec a, Vec b, int64_t i, Vec& first, Vec& second) { rotate_pairs8(a, b, k, i, first, second); };
  const Vec vr = _mm256_set1_ps(r);
#endif
  const auto scaled = [&](int64_t c) {  // rms_scale of channels c ..
    const Vec xr = mul(load(x + c), vr);
    if constexpr (kConvention == QkNorm::Llama) {
      return round_half(mul(load(w + c), round_half(xr)));
    } else if constexpr (kConvention == QkNorm::Fused) {
      return mul(load(w + c), xr);
    } else {
      return round_half(mul(load(w + c), xr));
    }
  };
  int64_t i = 0;
#if POSENC_CPU_CAPABILITY_INDEX == 2
  if (stream && pairs % 32 == 0) {  // two steps a line
    for (; i < pairs; i += 2 * kStep) {
      Vec first, second, first2, second2;
      rotate(scaled(i), scaled(pairs + i), i, first, second);
      rotate(scaled(i + kStep), scaled(pairs + i + kStep), i + kStep, first2, second2);
      store_line(out + i, narrow_halfx32(first, first2), true);
      store_line(out + pairs + i, narrow_halfx32(second, second2), true);
    }
  }
#else
  if (stream && pairs % 32 == 0) {  // four steps a line, stored as two halves
    for (; i < pairs; i += 4 * kStep) {
      Vec first[4], second[4];
      for (int64_t h = 0; h < 4; ++h) {
        rotate(scaled(i + h * kStep), scaled(pairs + i + h * kStep), i + h * kStep, first[h], second[h]);
      }
      for (int64_t h = 0; h < 4; h += 2) {
        store_half_line(out + i + h * kStep, narrow_halfx16(first[h], first[h + 1]), true);
        store_half_line(out + pairs + i + h * kStep, narrow_halfx16(second[h], second[h + 1]), true);
      }
    }
  }
#endif
  for (; i < pairs; i += kStep) {
    Vec first, second;
    rotate(scaled(i), scaled(pairs + i), i, first, second);
    store(out + i, first);
    store(out + pairs + i, second);
  }
  for (int64_t d = 2 * pairs; d < head_dim; ++d) {
    out[d] = from_opmath<c10::Half>(rms_scale<kConvention, c10::Half>(x[d], w[d], r));
  }
}
#endif

#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
// rms_scale_rotate_row of a contiguous bf16 head rotated in neox pairs in the baseline and AVX2 builds, two vectors of
// pairs a step (8 or 16; pairs a multiple of it), on convert.h's Bf16Vectors: round_to's and round_normalized's
// roundings in 32-bit lanes as they are written, round_to's and the outputs' NaNs looked for once a step. The same
// operations on the same values as the row's loop, so the same bits; the channels past 2 * pairs go by that loop's
// per-channel form. Against GCC's vectorization of the loop, q, k [4, 2048, 16|8, 128] bf16, separate processes
// alternating, AVX2 build, 2 threads: "llama" 1.21x, "gemma" 1.41x, "fused" 1.15x (5 pairs); the baseline build
// 0.90-1.84x, 1.05-1.52x, 1.25-1.48x (3 pairs). Always inlined: called once a head, out of line, it set up its
// constants every head and ran 0.8-1.0x the loop's speed.
template <QkNorm kConvention>
__attribute__((always_inline)) inline void rms_scale_rotate_neox_bf16_vectors(const float* x, const float* w, float r,
                                                                              PairCoeffs<float> k, int64_t pairs,
                                                                              int64_t head_dim, c10::BFloat16* out) {
  using V = Bf16Vectors;
  constexpr int64_t kLanes = V::kLanes;
  const V::Floats vr = V::splat(r);
  // rms_scale before its last rounding; round_normalized's rounding needs no NaN select (its comment says why)
  const auto product = [&](int64_t c) {
    const V::Floats xr = V::load_floats(x + c) * vr;
    if constexpr (kConvention == QkNorm::Llama) {
      return V::load_floats(w + c) * V::round<false>(xr);
    } else {
      return V::load_floats(w + c) * xr;
    }
  };
  for (int64_t i = 0; i < pairs; i += 2 * kLanes) {
    V::Floats a[2], b[2];
    for (int64_t h = 0; h < 2; ++h) {
      a[h] = product(i + h * kLanes);
      b[h] = product(pairs + i + h * kLanes);
    }
    if constexpr (kConvention != QkNorm::Fused) {  // round_to, NaNs selected only where a step has one
      if (any_nan(a[0], a[1]) || any_nan(b[0], b[1])) {
        for (int64_t h = 0; h < 2; ++h) {
          a[h] = V::round(a[h]);
          b[h] = V::round(b[h]);
        }
      } else {
        for (int64_t h = 0; h < 2; ++h) {
          a[h] = V::round<false>(a[h]);
          b[h] = V::round<false>(b[h]);
        }
      }
    }
    V::Floats first[2], second[2];
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t j = i + h * kLanes;
      first[h] = a[h] * V::load_floats(k.c1 + j) - b[h] * V::load_floats(k.s1 + j);   // rotate_first
      second[h] = b[h] * V::load_floats(k.c2 + j) + a[h] * V::load_floats(k.s2 + j);  // rotate_second
    }
    V::store_narrowed<false>(out + i, first[0], first[1]);
    V::store_narrowed<false>(out + pairs + i, second[0], second[1]);
  }
  for (int64_t d = 2 * pairs; d < head_dim; ++d) {
    out[d] = from_opmath<c10::BFloat16>(rms_scale<kConvention, c10::BFloat16>(x[d], w[d], r));
  }
}
#endif

#if !defined(__CUDACC__)
// The backward of one head, first pass: the gradient of the output (grad, read through grad_step) rotated back by the
// inverse coefficients k into gz; then, with xhat = x * r (formed here, and again where the last step needs it, not
// stored: a store less per channel, 1.05-1.2x in cache), gw += gz * xhat and g = gz * w (the gradient of xhat)
// written to g. The intermediate roundings of the conventions pass the gradient through, as autograd's casts do.
template <RopeLayout kLayout, bool kUnit, typename scalar_t, typename T>
inline void rms_rotate_back_row(const scalar_t* grad, int64_t grad_step, PairCoeffs<T> k, int64_t pairs,
                                int64_t head_dim, const T* x, T r, const T* w, T* gw, T* g) {
  const int64_t gs = kUnit ? 1 : grad_step;
  const int64_t first = kLayout == RopeLayout::Neox ? 1 : 2;
  const int64_t second = kLayout == RopeLayout::Neox ? pairs : 1;
  const auto through_norm = [&](int64_t d, T gz) {
    gw[d] += gz * (x[d] * r);
    g[d] = gz * w[d];
  };
  POSENC_NO_CARRIED_DEPENDENCY
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t d = i * first;
    const T a = to_opmath(grad[d * gs]);
    const T b = to_opmath(grad[(d + second) * gs]);
    through_norm(d, rotate_first(a, b, k.c1[i], k.s1[i]));
    through_norm(d + second, rotate_second(a, b, k.c2[i], k.s2[i]));
  }
  for (int64_t d = 2 * pairs; d < head_dim; ++d) through_norm(d, to_opmath(grad[d * gs]));
}
#endif

// The backward's last step over n channels of a group, after rms_rotate_back_row has formed the gradient g of
// xhat = x * r, and with mean_dot = normalized_dot(g, x, r) / width over the whole group: the gradient of x,
// r * (g - xhat * mean_dot), rounded to out's type and stored in out (which may be g itself).
template <typename T, typename out_t>
POSENC_INLINE void rms_input_grad(const T* x, const T* g, int64_t n, T r, T mean_dot, out_t* out) {
  POSENC_NO_CARRIED_DEPENDENCY
  for (int64_t i = 0; i < n; ++i) out[i] = from_opmath<out_t>(r * (g[i] - (x[i] * r) * mean_dot));
}

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
