#pragma once
// Conversions between storage precision (fp16, bf16, float32, float64) and maths precision (float32 for the
// first three, float64 for float64). c10's Half/BFloat16 conversions branch on NaN and denormals, which stops
// the compiler vectorizing a loop; these compute the same bits with selects and bit operations only:
// - bf16: round to nearest even, every NaN to 0x7FC0 (c10's rule);
// - fp16: round to nearest even, NaNs quieted with their payload kept (what F16C's vcvtps2ph does, and so
//   what torch's vectorized Tensor.half() gives), so the CPU capabilities with F16C and those without agree.
#include "portable/macros.h"
#include "portable/types.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

namespace posenc::portable {

inline namespace POSENC_KERNEL_NAMESPACE {

POSENC_INLINE float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

POSENC_INLINE uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

template <typename T>
POSENC_INLINE opmath_t<T> to_opmath(T value) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bits_to_float(uint32_t(value.x) << 16);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    // c10::detail::fp16_ieee_to_fp32_value with its branch turned into a mask.
    const uint32_t w = uint32_t(value.x) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t is_denormal = 0u - uint32_t(two_w < (1u << 27));
    const uint32_t magnitude = (float_to_bits(denormalized) & is_denormal) | (float_to_bits(normalized) & ~is_denormal);
    return bits_to_float(sign | magnitude);
  } else {
    return value;
  }
}

template <typename T>
POSENC_INLINE T from_opmath(opmath_t<T> value) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t bits = float_to_bits(value);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t is_nan = 0u - uint32_t(value != value);
    return c10::BFloat16(uint16_t((0x7FC0u & is_nan) | (rounded & ~is_nan)), c10::BFloat16::from_bits());
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    // c10::detail::fp16_ieee_from_fp32_value with its branches turned into max and a mask; a NaN keeps the
    // top ten bits of its payload and is quieted, as vcvtps2ph does.
    const uint32_t w = float_to_bits(value);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t exponent = shl1_w & 0xFF000000u;
    const uint32_t bias = exponent > 0x71000000u ? exponent : 0x71000000u;
    const float base = bits_to_float((bias >> 1) + 0x07800000u) +
                       bits_to_float(w & 0x7FFFFFFFu) * 0x1.0p+112f * 0x1.0p-110f;
    const uint32_t bits = float_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    const uint32_t nan = 0x7E00u | ((w >> 13) & 0x03FFu);
    const uint32_t is_nan = 0u - uint32_t(shl1_w > 0xFF000000u);
    return c10::Half(uint16_t((sign >> 16) | (nan & is_nan) | (nonsign & ~is_nan)), c10::Half::from_bits());
  } else {
    return value;
  }
}

#if !defined(__CUDACC__)
// F16C where the build has it: the AVX2 and AVX-512 kernel builds (capability.h), whose instruction sets come from a
// target pragma, which (GCC 12, clang) defines no __F16C__, or a -march that does.
#if defined(__F16C__) || \
    ((defined(__x86_64__) || defined(__i386__)) && defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX >= 1)
#define POSENC_HAS_F16C 1
#endif

// The baseline's and the AVX2 build's bf16 vector helpers below, and Bf16Vectors' members, are always inlined: GCC
// left some out of line (a call through the PLT for a handful of instructions) in the QK-norm forward and the
// rotations' head walks, whose own bodies are inlined by force.
#define POSENC_VECTOR_INLINE __attribute__((always_inline)) inline

// bf16 in the x86 baseline build (SSE2, which every x86-64 CPU has), eight values at a time. GCC vectorizes
// to_opmath / from_opmath there, but SSE2 has no unsigned 32-to-16-bit pack, and GCC packs the 16-bit results (and
// the NaN masks) with shuffles: a quarter of a bf16 rotation's instructions. Rounded in 32-bit lanes, NaNs selected
// there, then shifted down with their sign (-0x8000..0x7FFF, which the signed pack keeps whole): the same bits as
// from_opmath.
#if defined(__SSE2__) && defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 0
#define POSENC_BF16_BY_SSE2 1
// Each lane rounded to nearest even in its top 16 bits, a NaN's made 0x7FC0 (the low 16 bits are left over).
// kNaNs false: the caller knows v holds none.
template <bool kNaNs = true>
POSENC_VECTOR_INLINE __m128i bf16_rounded(__m128 v) {
  const __m128i bits = _mm_castps_si128(v);
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
  const __m128i rounded = _mm_add_epi32(_mm_add_epi32(bits, _mm_set1_epi32(0x7FFF)), lsb);
  if constexpr (!kNaNs) return rounded;
  const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
  return _mm_or_si128(_mm_and_si128(nan, _mm_set1_epi32(0x7FC00000)), _mm_andnot_si128(nan, rounded));
}

// low's and high's four values rounded, in order.
template <bool kNaNs = true>
POSENC_VECTOR_INLINE __m128i narrow_bf16x8(__m128 low, __m128 high) {
  return _mm_packs_epi32(_mm_srai_epi32(bf16_rounded<kNaNs>(low), 16), _mm_srai_epi32(bf16_rounded<kNaNs>(high), 16));
}

POSENC_VECTOR_INLINE void narrow_bf16x8(__m128 low, __m128 high, c10::BFloat16* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), narrow_bf16x8(low, high));
}

// Whether any lane of a or b is a NaN.
POSENC_VECTOR_INLINE bool any_nan(__m128 a, __m128 b) { return _mm_movemask_ps(_mm_cmpunord_ps(a, b)) != 0; }

// fp16 likewise, without F16C: to_opmath and from_opmath lane by lane, four floats a vector (SSE2 has no unsigned
// 32-bit compare: both sides have their top bit flipped for a signed one), then the same signed pack. Left to GCC,
// the loops packed the 16-bit results by shuffles (rope_qk fp16 3.2 ns a value, 8x the AVX2 build's).
__attribute__((always_inline)) inline __m128i unsigned_greater(__m128i a, __m128i b) {
  const __m128i top = _mm_set1_epi32(static_cast<int>(0x80000000u));
  return _mm_cmpgt_epi32(_mm_xor_si128(a, top), _mm_xor_si128(b, top));
}

__attribute__((always_inline)) inline __m128 half_lanes_to_float(__m128i w) {  // w: each lane a value's bits << 16
  const __m128i sign = _mm_and_si128(w, _mm_set1_epi32(static_cast<int>(0x80000000u)));
  const __m128i two_w = _mm_add_epi32(w, w);
  const __m128 normalized = _mm_mul_ps(
      _mm_castsi128_ps(_mm_add_epi32(_mm_srli_epi32(two_w, 4), _mm_set1_epi32(0xE0 << 23))), _mm_set1_ps(0x1.0p-112f));
  const __m128i denormal_bits = _mm_or_si128(_mm_srli_epi32(two_w, 17), _mm_set1_epi32(126 << 23));
  const __m128 denormalized = _mm_sub_ps(_mm_castsi128_ps(denormal_bits), _mm_set1_ps(0.5f));
  const __m128i is_denormal = unsigned_greater(_mm_set1_epi32(1 << 27), two_w);
  const __m128i magnitude = _mm_or_si128(_mm_and_si128(is_denormal, _mm_castps_si128(denormalized)),
                                         _mm_andnot_si128(is_denormal, _mm_castps_si128(normalized)));
  return _mm_castsi128_ps(_mm_or_si128(sign, magnitude));
}

__attribute__((always_inline)) inline void widen_halfx8(const c10::Half* src, float* dst) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  _mm_storeu_ps(dst, half_lanes_to_float(_mm_unpacklo_epi16(_mm_setzero_si128(), v)));
  _mm_storeu_ps(dst + 4, half_lanes_to_float(_mm_unpackhi_epi16(_mm_setzero_si128(), v)));
}

// Each lane's fp16 bits, sign-extended from bit 15.
__attribute__((always_inline)) inline __m128i half_lanes(__m128 value) {
  const __m128i w = _mm_castps_si128(value);
  const __m128i shl1_w = _mm_add_epi32(w, w);
  const __m128i sign = _mm_and_si128(w, _mm_set1_epi32(static_cast<int>(0x80000000u)));
  const __m128i exponent = _mm_and_si128(shl1_w, _mm_set1_epi32(static_cast<int>(0xFF000000u)));
  const __m128i least = _mm_set1_epi32(0x71000000);
  const __m128i above = unsigned_greater(exponent, least);
  const __m128i bias = _mm_or_si128(_mm_and_si128(above, exponent), _mm_andnot_si128(above, least));
  const __m128 magnitude = _mm_castsi128_ps(_mm_and_si128(w, _mm_set1_epi32(0x7FFFFFFF)));
  const __m128 base = _mm_add_ps(_mm_castsi128_ps(_mm_add_epi32(_mm_srli_epi32(bias, 1), _mm_set1_epi32(0x07800000))),
                                 _mm_mul_ps(_mm_mul_ps(magnitude, _mm_set1_ps(0x1.0p+112f)), _mm_set1_ps(0x1.0p-110f)));
  const __m128i bits = _mm_castps_si128(base);
  const __m128i nonsign = _mm_add_epi32(_mm_and_si128(_mm_srli_epi32(bits, 13), _mm_set1_epi32(0x7C00)),
                                        _mm_and_si128(bits, _mm_set1_epi32(0x0FFF)));
  const __m128i payload = _mm_and_si128(_mm_srli_epi32(w, 13), _mm_set1_epi32(0x03FF));
  const __m128i nan = _mm_or_si128(_mm_set1_epi32(0x7E00), payload);
  const __m128i is_nan = unsigned_greater(shl1_w, _mm_set1_epi32(static_cast<int>(0xFF000000u)));
  const __m128i half = _mm_or_si128(_mm_srli_epi32(sign, 16),
                                    _mm_or_si128(_mm_and_si128(is_nan, nan), _mm_andnot_si128(is_nan, nonsign)));
  return _mm_srai_epi32(_mm_slli_epi32(half, 16), 16);
}

__attribute__((always_inline)) inline void narrow_halfx8(__m128 low, __m128 high, c10::Half* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_packs_epi32(half_lanes(low), half_lanes(high)));
}
#endif

// bf16 in the AVX2 build, eight values a vector. GCC's vectorization of from_opmath packs the 16-bit results and the
// NaN masks apart, each with a shuffle across the halves; here NaNs are selected in 32-bit lanes, as in the baseline
// build, and two vectors share one unsigned pack and one permutation: the same bits as from_opmath.
#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 1 && \
    (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDACC__)
#define POSENC_BF16_BY_AVX2 1
// Each lane rounded to nearest even in its top 16 bits, a NaN's made 0x7FC0 (the low 16 bits are left over).
// kNaNs false: the caller knows v holds none. The kept half's low bit is found by a compare (-1 where it is set), not
// a shift: Zen 2 runs vector shifts on one of its four vector pipes, compares on all four.
template <bool kNaNs = true>
POSENC_VECTOR_INLINE __m256i bf16_rounded(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i kept_low_bit = _mm256_set1_epi32(0x10000);
  const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(bits, kept_low_bit), kept_low_bit);
  const __m256i rounded = _mm256_sub_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd);
  if constexpr (!kNaNs) return rounded;
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}

// low's and high's eight values rounded, in order.
template <bool kNaNs = true>
POSENC_VECTOR_INLINE __m256i narrow_bf16x16(__m256 low, __m256 high) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(bf16_rounded<kNaNs>(low), 16),
                                             _mm256_srli_epi32(bf16_rounded<kNaNs>(high), 16));
  return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));
}

// Whether any lane of a or b is a NaN.
POSENC_VECTOR_INLINE bool any_nan(__m256 a, __m256 b) {
  const __m256 nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
  return !_mm256_testz_ps(nan, nan);
}
#endif

#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
// The vectors of the baseline's and the AVX2 build's bf16 rows (rotary.h's rotate_bf16_vectors, rows.h's
// add_bf16_vectors, alibi.h's alibi_row_bf16_vectors): four float32 lanes (SSE2) or eight (AVX2), and the 32-bit
// words of bf16 pairs. Their operators (*, +, -) are GCC's vector arithmetic, each an instruction, unfused
// (-ffp-contract=off).
struct Bf16Vectors {
#if defined(POSENC_BF16_BY_SSE2)
  using Floats = __m128;
  using Words = __m128i;
  static constexpr int64_t kLanes = 4;
  static POSENC_VECTOR_INLINE Floats widen(const c10::BFloat16* p) {  // a bf16 is a float's high half
    const __m128i four = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), four));
  }
  template <bool kNaNs = true>
  static POSENC_VECTOR_INLINE Words narrow(Floats low, Floats high) { return narrow_bf16x8<kNaNs>(low, high); }
  static POSENC_VECTOR_INLINE Words load(const c10::BFloat16* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  template <bool kStream>
  static POSENC_VECTOR_INLINE void store(c10::BFloat16* p, Words v) {
    if constexpr (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
    }
  }
  static POSENC_VECTOR_INLINE Floats load_floats(const float* p) { return _mm_loadu_ps(p); }
  static POSENC_VECTOR_INLINE void store_floats(float* p, Floats f) { _mm_storeu_ps(p, f); }
  // a's and b's values at even places, in order, and those at odd places
  static POSENC_VECTOR_INLINE void deinterleave(Floats a, Floats b, Floats& even, Floats& odd) {
    even = _mm_shuffle_ps(a, b, 0x88);
    odd = _mm_shuffle_ps(a, b, 0xDD);
  }
  static POSENC_VECTOR_INLINE Floats splat(float f) { return _mm_set1_ps(f); }
  static POSENC_VECTOR_INLINE Floats abs(Floats f) { return _mm_andnot_ps(_mm_set1_ps(-0.0f), f); }
  static POSENC_VECTOR_INLINE Floats as_floats(Words w) { return _mm_castsi128_ps(w); }
  static POSENC_VECTOR_INLINE Floats low_halves_up(Words w) { return as_floats(_mm_slli_epi32(w, 16)); }
  static POSENC_VECTOR_INLINE Words high_halves(Words w) {
    return _mm_and_si128(w, _mm_set1_epi32(static_cast<int>(0xFFFF0000u)));
  }
  static POSENC_VECTOR_INLINE Words join(Words high_to_low, Words high) {  // high_to_low's top halves moved down, with high's
    return _mm_or_si128(_mm_srli_epi32(high_to_low, 16), high_halves(high));
  }
#else
  using Floats = __m256;
  using Words = __m256i;
  static constexpr int64_t kLanes = 8;
  // A bf16 is a float's high half: the eight loaded into both halves of a vector, each moved to its lane's high half
  // by one byte shuffle (no shift: see bf16_rounded).
  static POSENC_VECTOR_INLINE Floats widen(const c10::BFloat16* p) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i to_high_halves = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,  //
                                                    -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(both, to_high_halves));
  }
  template <bool kNaNs = true>
  static POSENC_VECTOR_INLINE Words narrow(Floats low, Floats high) { return narrow_bf16x16<kNaNs>(low, high); }
  static POSENC_VECTOR_INLINE Words load(const c10::BFloat16* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  template <bool kStream>
  static POSENC_VECTOR_INLINE void store(c10::BFloat16* p, Words v) {
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
    }
  }
  static POSENC_VECTOR_INLINE Floats load_floats(const float* p) { return _mm256_loadu_ps(p); }
  static POSENC_VECTOR_INLINE void store_floats(float* p, Floats f) { _mm256_storeu_ps(p, f); }
  static POSENC_VECTOR_INLINE void deinterleave(Floats a, Floats b, Floats& even, Floats& odd) {
    even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
  }
  static POSENC_VECTOR_INLINE Floats splat(float f) { return _mm256_set1_ps(f); }
  static POSENC_VECTOR_INLINE Floats abs(Floats f) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), f); }
  static POSENC_VECTOR_INLINE Floats as_floats(Words w) { return _mm256_castsi256_ps(w); }
  // The halves moved by byte shuffles, not shifts (see bf16_rounded)
  static POSENC_VECTOR_INLINE Floats low_halves_up(Words w) {
    const __m256i up = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13,  //
                                        -1, -1, 0, 1, -1, -1, 4, 5, -1, -1, 8, 9, -1, -1, 12, 13);
    return as_floats(_mm256_shuffle_epi8(w, up));
  }
  static POSENC_VECTOR_INLINE Words high_halves(Words w) {
    return _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  }
  static POSENC_VECTOR_INLINE Words join(Words high_to_low, Words high) {
    const __m256i down = _mm256_setr_epi8(2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1,  //
                                          2, 3, -1, -1, 6, 7, -1, -1, 10, 11, -1, -1, 14, 15, -1, -1);
    return _mm256_or_si256(_mm256_shuffle_epi8(high_to_low, down), high_halves(high));
  }
#endif
  // v rounded to bf16 and back in its 32-bit lanes (rmsnorm.h's round_to)
  template <bool kNaNs = true>
  static POSENC_VECTOR_INLINE Floats round(Floats v) {
    return as_floats(high_halves(bf16_rounded<kNaNs>(v)));
  }
  // low's and high's values rounded as from_opmath rounds them (NaNs selected only where the two hold one), stored at p
  template <bool kStream>
  static POSENC_VECTOR_INLINE void store_narrowed(c10::BFloat16* p, Floats low, Floats high) {
    store<kStream>(p, any_nan(low, high) ? narrow(low, high) : narrow<false>(low, high));
  }
  // The words of pairs whose first channels are `low`'s values and whose second are `high`'s, rounded as
  // from_opmath rounds them, stored at p
  template <bool kStream>
  static POSENC_VECTOR_INLINE void store_joined(c10::BFloat16* p, Floats low, Floats high) {
    if (any_nan(low, high)) {
      store<kStream>(p, join(bf16_rounded(low), bf16_rounded(high)));
    } else {
      store<kStream>(p, join(bf16_rounded<false>(low), bf16_rounded<false>(high)));
    }
  }
};

#endif

#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 2 && \
    (defined(__x86_64__) || defined(__i386__))
// 16 bf16 values widened to float32 in the AVX-512 build: a bf16 is a float's high half (the masks of all lanes: GCC
// 12 warns of its own placeholder in the unmasked forms). Only the `lanes` selected are read; the others are 0.
POSENC_INLINE __m512 widen_bf16x16(const c10::BFloat16* src, __mmask16 lanes = 0xFFFF) {
  const __m256i bits = _mm256_maskz_loadu_epi16(lanes, src);
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, bits), 16));
}

// 16 fp16 values widened to float32 by vcvtph2ps (to_opmath's values); only the `lanes` selected are read.
POSENC_INLINE __m512 widen_halfx16(const c10::Half* src, __mmask16 lanes = 0xFFFF) {
  return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_maskz_loadu_epi16(lanes, src));
}

// 32 floats, low's 16 then high's, rounded to fp16 by vcvtps2ph as from_opmath rounds them: one 64-byte vector.
POSENC_INLINE __m512i narrow_halfx32(__m512 low, __m512 high) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm512_maskz_inserti64x4(0xFF, _mm512_castsi256_si512(_mm512_maskz_cvtps_ph(0xFFFF, low, kNearest)),
                                  _mm512_maskz_cvtps_ph(0xFFFF, high, kNearest), 1);
}

// One 64-byte vector stored at p: past the caches where `stream` (p on a 64-byte line).
POSENC_INLINE void store_line(void* p, __m512i line, bool stream) {
  if (stream) {
    _mm512_stream_si512(static_cast<__m512i*>(p), line);
  } else {
    _mm512_storeu_si512(p, line);
  }
}
#endif

#if defined(POSENC_HAS_F16C)
// 8 fp16 values widened to float32 by vcvtph2ps where the build has F16C (to_opmath's values).
POSENC_INLINE __m256 widen_halfx8(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
#endif

#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 1 && \
    (defined(__x86_64__) || defined(__i386__))

// 16 floats, low's 8 then high's, rounded to fp16 by vcvtps2ph as from_opmath rounds them: half a 64-byte line.
POSENC_INLINE __m256i narrow_halfx16(__m256 low, __m256 high) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return _mm256_set_m128i(_mm256_cvtps_ph(high, kNearest), _mm256_cvtps_ph(low, kNearest));
}

// Half a line (32 bytes) stored at p: past the caches where `stream` (p on 32 bytes), where the line's other half
// goes next, so that the core writes the line whole.
POSENC_INLINE void store_half_line(void* p, __m256i half, bool stream) {
  if (stream) {
    _mm256_stream_si256(static_cast<__m256i*>(p), half);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(p), half);
  }
}
#endif

// bf16 by AVX-512 BF16's vcvtneps2bf16 / vcvtne2ps2bf16 in the AVX-512 build, for the kernels that check the CPU has
// it (cpu::has_avx512_bf16()). It rounds to nearest even as from_opmath does (checked on every float32 bit pattern),
// but reads a denormal as zero, which from_opmath rounds, and keeps a NaN's payload, which from_opmath sets to 0x7FC0.
// So a kernel tests what it rounds (rounds_apart: one vfpclassps per 16) and redoes by the integer form whatever
// held a denormal or a NaN: the same bits as from_opmath. A zero rounds alike both ways, and no normal float rounds to
// a denormal bf16 (bf16 has float32's exponent range).
#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 2 && \
    (defined(__x86_64__) || defined(__i386__)) && (defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10)
#define POSENC_BF16_BY_AVX512BF16 1
#define POSENC_TARGET_AVX512BF16 __attribute__((target("avx512bf16")))

// The lanes of v the instruction rounds otherwise than from_opmath: NaNs (quiet, signalling) and denormals.
POSENC_INLINE __mmask16 rounds_apart(__m512 v) {
  return _mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80);
}

// a and b rounded to bf16 and back, both in one vcvtne2ps2bf16 (a's 16 in the low words, b's in the high), each
// moved back to its float's high half by one vpermw that zeroes the low half: 3 instructions for 32 values, where
// converting and widening each 16 on its own took 6.
POSENC_TARGET_AVX512BF16 POSENC_INLINE void round_bf16x32(__m512& a, __m512& b) {
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  const __m512i word = _mm512_setr_epi32(0, 1 << 16, 2 << 16, 3 << 16, 4 << 16, 5 << 16, 6 << 16, 7 << 16, 8 << 16,
                                         9 << 16, 10 << 16, 11 << 16, 12 << 16, 13 << 16, 14 << 16, 15 << 16);
  constexpr __mmask32 kHighHalves = 0xAAAAAAAAu;
  a = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighHalves, word, both));
  b = _mm512_castsi512_ps(
      _mm512_maskz_permutexvar_epi16(kHighHalves, _mm512_add_epi32(word, _mm512_set1_epi32(16 << 16)), both));
}

// a and b rounded to bf16 and stored, 16 each, at pa and pb by one vcvtne2ps2bf16.
POSENC_TARGET_AVX512BF16 POSENC_INLINE void store_bf16x32(__m512 a, __m512 b, c10::BFloat16* pa, c10::BFloat16* pb) {
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pa), _mm512_maskz_extracti64x4_epi64(0xF, both, 0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb), _mm512_maskz_extracti64x4_epi64(0xF, both, 1));
}

// 32 floats, low's 16 then high's, rounded to bf16 by one vcvtne2ps2bf16 and stored as one line at p (store_line).
POSENC_TARGET_AVX512BF16 POSENC_INLINE void store_bf16x32_line(__m512 low, __m512 high, c10::BFloat16* p, bool stream) {
  store_line(p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)), stream);
}
#endif

// n values widened to (narrowed from) maths precision. fp16 goes through F16C where the capability has it (widened
// 16 at a time in the AVX-512 build, else eight): the same bits as to_opmath / from_opmath, several times faster
// than their integer form; bf16 is narrowed eight at a time by SSE2 in the baseline build.
template <typename T>
inline void widen(const T* src, opmath_t<T>* dst, int64_t n) {
  int64_t i = 0;
#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 2 && \
    (defined(__x86_64__) || defined(__i386__))
  // 16 at a time in the AVX-512 build (in-process A/B, 1 and 2 threads): qk_norm_rope's fp16 rows 1.06-1.10x the
  // forward and 1.02-1.05x the backward, the additive rows' fp16 tables 1.00-1.12x. bf16 rows keep GCC's loop, which
  // widening 16 at a time made 0.96-1.00x.
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, widen_halfx16(src + i));
  }
#endif
#if defined(POSENC_HAS_F16C)
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i < n - n % 8; i += 8) _mm256_storeu_ps(dst + i, widen_halfx8(src + i));
  }
#endif
#if defined(POSENC_BF16_BY_SSE2)
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i < n - n % 8; i += 8) widen_halfx8(src + i, dst + i);
  }
#endif
#if defined(POSENC_BF16_BY_AVX2)
  // GCC's loop widens by a zero extension and a shift (see bf16_rounded for why not a shift)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i < n - n % 8; i += 8) _mm256_storeu_ps(dst + i, Bf16Vectors::widen(src + i));
  }
#endif
  for (; i < n; ++i) dst[i] = to_opmath(src[i]);
}

template <typename T>
inline void narrow(const opmath_t<T>* src, T* dst, int64_t n) {
  int64_t i = 0;
#if defined(POSENC_HAS_F16C)
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
  }
#endif
#if defined(POSENC_BF16_BY_SSE2)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i < n - n % 8; i += 8) narrow_bf16x8(_mm_loadu_ps(src + i), _mm_loadu_ps(src + i + 4), dst + i);
  }
  if constexpr (std::is_same_v<T, c10::Half>) {
    for (; i < n - n % 8; i += 8) narrow_halfx8(_mm_loadu_ps(src + i), _mm_loadu_ps(src + i + 4), dst + i);
  }
#endif
#if defined(POSENC_BF16_BY_AVX2)
  // GCC's loop rounds each vector with shifts and packs the NaN masks apart
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i < n - n % 16; i += 16) {
      Bf16Vectors::store_narrowed<false>(dst + i, _mm256_loadu_ps(src + i), _mm256_loadu_ps(src + i + 8));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = from_opmath<T>(src[i]);
}
#endif

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
