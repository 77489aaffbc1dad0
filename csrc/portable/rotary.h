#pragma once
// Rotation of channel pairs, the maths of the rotary family:
//   y1 = x1 * c1 - x2 * s1,   y2 = x2 * c2 + x1 * s2,
// with c1 = c2 = a cos(theta), s1 = s2 = a sin(theta) for rope (a = attention_scale; the backward is the same
// map with -theta) and per-channel tables for rope_cos_sin. Every product is rounded, then the sum: no fused
// multiply-add, so every CPU capability (with FMA or without, vector body or scalar tail) and the GPU give
// the same bits, and float32 results equal eager PyTorch's x * cos + rotate_half(x) * sin for the same
// cos and sin.
#include "portable/convert.h"
#include "portable/types.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace posenc::portable {

// The rotation coefficients of one token, one entry per channel pair.
template <typename opmath_t>
struct PairCoeffs {
  const opmath_t* c1;
  const opmath_t* s1;
  const opmath_t* c2;
  const opmath_t* s2;
};

inline namespace POSENC_KERNEL_NAMESPACE {

template <typename T>
POSENC_INLINE T rotate_first(T x1, T x2, T c, T s) {
  return x1 * c - x2 * s;
}

template <typename T>
POSENC_INLINE T rotate_second(T x1, T x2, T c, T s) {
  return x2 * c + x1 * s;
}

#if !defined(__CUDACC__)
// One head's row: pair i is channels (i, i + pairs) for neox, (2i, 2i + 1) for gptj; the channels past
// 2 * pairs are copied. kUnit: both rows are contiguous, which fixes every stride at compile time.
template <RopeLayout kLayout, bool kUnit, typename scalar_t, typename opmath_t>
void rotate_row(const scalar_t* in, int64_t in_step, scalar_t* out, int64_t out_step, PairCoeffs<opmath_t> k,
                int64_t pairs, int64_t head_dim) {
  const int64_t is = kUnit ? 1 : in_step;
  const int64_t os = kUnit ? 1 : out_step;
  const int64_t first = kLayout == RopeLayout::Neox ? 1 : 2;       // channel of pair i = first * i
  const int64_t second = kLayout == RopeLayout::Neox ? pairs : 1;  // its partner, `second` channels on
  const scalar_t* x1 = in;
  const scalar_t* x2 = in + second * is;
  scalar_t* y1 = out;
  scalar_t* y2 = out + second * os;
  POSENC_NO_CARRIED_DEPENDENCY
  for (int64_t i = 0; i < pairs; ++i) {
    const auto a = to_opmath(x1[i * first * is]);
    const auto b = to_opmath(x2[i * first * is]);
    y1[i * first * os] = from_opmath<scalar_t>(rotate_first(a, b, k.c1[i], k.s1[i]));
    y2[i * first * os] = from_opmath<scalar_t>(rotate_second(a, b, k.c2[i], k.s2[i]));
  }
  if (in == out) return;  // in place: the channels past rotary_dim are already there
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d * os] = in[d * is];
}

// Contiguous bf16 rows read and written as 32-bit words of two neighbouring channels (the lower channel in
// the low half): widening is a shift or a mask and two rounded results fill one word, so the loop needs no
// unpack or pack shuffles. The maths and the rounding are those of rotate_row, so the bits are too.
inline uint32_t load_word(const c10::BFloat16* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

inline void store_word(c10::BFloat16* p, uint32_t w) { std::memcpy(p, &w, sizeof(w)); }

inline float low_channel(uint32_t w) { return to_opmath(c10::BFloat16(uint16_t(w), c10::BFloat16::from_bits())); }

inline float high_channel(uint32_t w) {
  return to_opmath(c10::BFloat16(uint16_t(w >> 16), c10::BFloat16::from_bits()));
}

inline uint32_t pack_word(float low, float high) {
  return (uint32_t(from_opmath<c10::BFloat16>(high).x) << 16) | from_opmath<c10::BFloat16>(low).x;
}

// Asks for this head's row of the next token, read and written one token from now. A token's rows of a
// bshd tensor are a page or two (16 heads of 128 channels), and the hardware prefetchers stop at page
// boundaries, so every token would otherwise start with misses on all four streams of rope_qk (q, k and
// their outputs). Measured 10-15% faster on one thread for fp32 and bf16. A prefetch never faults, so the
// last token's (past the end) is harmless.
template <typename scalar_t>
inline void prefetch_next_token(const RotaryView<scalar_t>& v, const scalar_t* in, scalar_t* out) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  const auto next_in = reinterpret_cast<uintptr_t>(in) + v.in_stride[1] * sizeof(scalar_t);
  const auto next_out = reinterpret_cast<uintptr_t>(out) + v.out_stride[1] * sizeof(scalar_t);
  for (int64_t d = 0; d < v.head_dim; d += kLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(next_in + d * v.in_stride[3] * sizeof(scalar_t)));
    __builtin_prefetch(reinterpret_cast<const void*>(next_out + d * v.out_stride[3] * sizeof(scalar_t)), 1);
  }
}

// A contiguous bf16 row. neox: word j of either half holds pairs 2j and 2j + 1, whose coefficients
// `split` holds apart (the even pairs', then the odd pairs', for c1, s1, c2, s2), so the loop reads them
// without shuffles; gptj: word i is pair i.
template <RopeLayout kLayout>
void rotate_row_bf16(const c10::BFloat16* in, c10::BFloat16* out, PairCoeffs<float> k, const float* split,
                     int64_t pairs, int64_t head_dim) {
  if constexpr (kLayout == RopeLayout::Gptj) {
    POSENC_NO_CARRIED_DEPENDENCY
    for (int64_t i = 0; i < pairs; ++i) {
      const uint32_t w = load_word(in + 2 * i);
      const float a = low_channel(w);
      const float b = high_channel(w);
      store_word(out + 2 * i, pack_word(rotate_first(a, b, k.c1[i], k.s1[i]), rotate_second(a, b, k.c2[i], k.s2[i])));
    }
  } else {
    const int64_t words = pairs / 2;
    const float* c1_even = split;
    const float* c1_odd = c1_even + words;
    const float* s1_even = c1_odd + words;
    const float* s1_odd = s1_even + words;
    const float* c2_even = s1_odd + words;
    const float* c2_odd = c2_even + words;
    const float* s2_even = c2_odd + words;
    const float* s2_odd = s2_even + words;
    const c10::BFloat16* x1 = in;
    const c10::BFloat16* x2 = in + pairs;
    c10::BFloat16* y1 = out;
    c10::BFloat16* y2 = out + pairs;
    POSENC_NO_CARRIED_DEPENDENCY
    for (int64_t j = 0; j < words; ++j) {
      const uint32_t w1 = load_word(x1 + 2 * j);
      const uint32_t w2 = load_word(x2 + 2 * j);
      const float a0 = low_channel(w1);
      const float a1 = high_channel(w1);
      const float b0 = low_channel(w2);
      const float b1 = high_channel(w2);
      store_word(y1 + 2 * j, pack_word(rotate_first(a0, b0, c1_even[j], s1_even[j]),
                                       rotate_first(a1, b1, c1_odd[j], s1_odd[j])));
      store_word(y2 + 2 * j, pack_word(rotate_second(a0, b0, c2_even[j], s2_even[j]),
                                       rotate_second(a1, b1, c2_odd[j], s2_odd[j])));
    }
    if (pairs % 2 == 1) {  // an odd last pair, alone
      const int64_t i = pairs - 1;
      const float a = to_opmath(x1[i]);
      const float b = to_opmath(x2[i]);
      y1[i] = from_opmath<c10::BFloat16>(rotate_first(a, b, k.c1[i], k.s1[i]));
      y2[i] = from_opmath<c10::BFloat16>(rotate_second(a, b, k.c2[i], k.s2[i]));
    }
  }
  if (in == out) return;  // in place: the channels past rotary_dim are already there
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d] = in[d];
}

// The neox coefficient split of rotate_row_bf16: 8 * (pairs / 2) floats.
inline void split_even_odd(PairCoeffs<float> k, int64_t pairs, float* split) {
  const int64_t words = pairs / 2;
  const float* coeffs[4] = {k.c1, k.s1, k.c2, k.s2};
  for (int c = 0; c < 4; ++c) {
    for (int64_t j = 0; j < words; ++j) {
      split[2 * c * words + j] = coeffs[c][2 * j];
      split[(2 * c + 1) * words + j] = coeffs[c][2 * j + 1];
    }
  }
}

// A contiguous fp16 row: c10::Half converts one value at a time, which keeps rotate_row scalar. The rotated
// channels are widened into a float row, rotated there by the float kernel and narrowed back (eight at a time
// with F16C where the capability has it); the channels past rotary_dim are copied as they are.
template <RopeLayout kLayout>
void rotate_row_half(const c10::Half* in, c10::Half* out, PairCoeffs<float> k, int64_t pairs, int64_t head_dim) {
  constexpr int64_t kBlock = 128;  // pairs per pass through the float row
  float x[2 * kBlock];
  for (int64_t i = 0; i < pairs; i += kBlock) {
    const int64_t n = std::min(kBlock, pairs - i);
    const PairCoeffs<float> block{k.c1 + i, k.s1 + i, k.c2 + i, k.s2 + i};
    if constexpr (kLayout == RopeLayout::Neox) {  // the block's first channels, then their partners
      widen(in + i, x, n);
      widen(in + pairs + i, x + n, n);
      rotate_row<kLayout, true>(x, 1, x, 1, block, n, 2 * n);
      narrow(x, out + i, n);
      narrow(x + n, out + pairs + i, n);
    } else {
      widen(in + 2 * i, x, 2 * n);
      rotate_row<kLayout, true>(x, 1, x, 1, block, n, 2 * n);
      narrow(x, out + 2 * i, 2 * n);
    }
  }
  if (in == out) return;
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d] = in[d];
}

// Every head of token (b, s) of a view. `split` is scratch of 8 * (pairs / 2) floats (bf16 neox).
template <RopeLayout kLayout, typename scalar_t, typename opmath_t>
void rotate_heads(const RotaryView<scalar_t>& v, int64_t b, int64_t s, PairCoeffs<opmath_t> k, int64_t pairs,
                  float* split) {
  const bool unit = v.in_stride[3] == 1 && v.out_stride[3] == 1;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (unit && kLayout == RopeLayout::Neox) split_even_odd(k, pairs, split);
  }
  for (int64_t h = 0; h < v.heads; ++h) {
    const scalar_t* in = v.in + b * v.in_stride[0] + s * v.in_stride[1] + h * v.in_stride[2];
    scalar_t* out = v.out + b * v.out_stride[0] + s * v.out_stride[1] + h * v.out_stride[2];
    if (!unit) {
      rotate_row<kLayout, false>(in, v.in_stride[3], out, v.out_stride[3], k, pairs, v.head_dim);
      continue;
    }
    prefetch_next_token(v, in, out);
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      rotate_row_bf16<kLayout>(in, out, k, split, pairs, v.head_dim);
    } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
      rotate_row_half<kLayout>(in, out, k, pairs, v.head_dim);
    } else {
      rotate_row<kLayout, true>(in, 1, out, 1, k, pairs, v.head_dim);
    }
  }
}

template <typename scalar_t, typename opmath_t>
void rotate_token(const RotaryView<scalar_t>& v, int64_t b, int64_t s, PairCoeffs<opmath_t> k, int64_t pairs,
                  RopeLayout layout, float* split) {
  if (layout == RopeLayout::Neox) {
    rotate_heads<RopeLayout::Neox>(v, b, s, k, pairs, split);
  } else {
    rotate_heads<RopeLayout::Gptj>(v, b, s, k, pairs, split);
  }
}
#endif

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
