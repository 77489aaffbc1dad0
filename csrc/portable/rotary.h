#pragma once
// Rotation of channel pairs, the maths of the rotary family:
//   y1 = x1 * c1 - x2 * s1,   y2 = x2 * c2 + x1 * s2,
// with c1 = c2 = a cos(theta), s1 = s2 = a sin(theta) for rope (a = attention_scale; the backward is the same
// map with -theta) and per-channel tables for rope_cos_sin. Every product is rounded, then the sum: no fused
// multiply-add, so every CPU capability (with FMA or without, vector body or scalar tail) and the GPU give
// the same bits, and float32 results equal eager PyTorch's x * cos + rotate_half(x) * sin for the same
// cos and sin.
#include "portable/convert.h"
#include "portable/libm.h"
#include "portable/streaming.h"
#include "portable/types.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace posenc::portable {

// The rotation coefficients of one token, one entry per channel pair. words: neox rows already in the order of a bf16
// row's words (rotary.h's neox_word_order), as the CPU kernels' tables give them to the views that take them.
template <typename opmath_t>
struct PairCoeffs {
  const opmath_t* c1;
  const opmath_t* s1;
  const opmath_t* c2;
  const opmath_t* s2;
  bool words = false;
};

// Whether a pair's second channel takes its first channel's coefficients (c2 = c1, s2 = s1), as every rotation by
// angle does: its kernels hand over one cos row and one sin row. A float32 row then loads each once, a third fewer
// loads (in-process A/B on Zen 4, float32 rope_qk in cache 1.10-1.11x, decoding [8, 1, 32, 128] 1.05x, past the
// caches 0.99x; bf16 and fp16 rows, which widen and round in between, gained nothing and keep loading four).
// Never float64: its gptj rows so written were compiled (GCC 12, AVX2) to vfmaddsub, a fused multiply-add that
// -ffp-contract=off does not stop, which changed the last bit.
template <typename opmath_t>
inline bool shares_rows(const PairCoeffs<opmath_t>& k) {
  return std::is_same_v<opmath_t, float> && k.c2 == k.c1 && k.s2 == k.s1;
}

inline namespace POSENC_KERNEL_NAMESPACE {

// The query scale at position p, 1 + beta * log(1 + floor((p + shift) / length)), in float64 on posenc's own log
// (the same bits everywhere). A position below -shift is scaled as -shift is (by 1): the models' formula takes the
// log of zero or less there, and no model gives q such a position.
POSENC_INLINE double query_scale(double position, QScale q) {
  const double steps = std::floor((position + static_cast<double>(q.shift)) / static_cast<double>(q.length));
  return 1.0 + q.beta * libm::log(1.0 + (steps > 0.0 ? steps : 0.0));
}

// The sequence index of out that token (b, s) is stored at: s, or its cache slot; -1 where the slot lies outside
// [0, out_seq) (the host checks every slot of a call it can read, so this only guards a call captured into a CUDA
// graph).
template <typename scalar_t>
POSENC_INLINE int64_t output_index(const RotaryView<scalar_t>& v, int64_t b, int64_t s) {
  if (v.slots == nullptr) return s;
  const int64_t slot = v.slots[b * v.slot_batch_stride + s];
  return slot >= 0 && slot < v.out_seq ? slot : -1;
}

// Token (b, s)'s first output element, or null where it is not stored.
template <typename scalar_t>
POSENC_INLINE scalar_t* output_token(const RotaryView<scalar_t>& v, int64_t b, int64_t s) {
  const int64_t index = output_index(v, b, s);
  return index < 0 ? nullptr : v.out + b * v.out_stride[0] + index * v.out_stride[1];
}

template <typename T>
POSENC_INLINE T rotate_first(T x1, T x2, T c, T s) {
  return x1 * c - x2 * s;
}

template <typename T>
POSENC_INLINE T rotate_second(T x1, T x2, T c, T s) {
  return x2 * c + x1 * s;
}

#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 2 && \
    (defined(__x86_64__) || defined(__i386__))
// rotate_first and rotate_second of pairs [i, i + 16) in the AVX-512 build: a holds their first channels, b their
// partners. kShared: k shares_rows, each row loaded once.
template <bool kShared = false>
POSENC_INLINE void rotate_pairs16(__m512 a, __m512 b, PairCoeffs<float> k, int64_t i, __m512& first,
                                  __m512& second) {
  const __m512 c1 = _mm512_loadu_ps(k.c1 + i), s1 = _mm512_loadu_ps(k.s1 + i);
  const __m512 c2 = kShared ? c1 : _mm512_loadu_ps(k.c2 + i), s2 = kShared ? s1 : _mm512_loadu_ps(k.s2 + i);
  first = _mm512_sub_ps(_mm512_mul_ps(a, c1), _mm512_mul_ps(b, s1));
  second = _mm512_add_ps(_mm512_mul_ps(b, c2), _mm512_mul_ps(a, s2));
}

// gptj's 16 pairs, whose channels are adjacent, in two vectors x0, x1: split into their first channels and partners
// (split_pairs16), and the rotated ones joined back in channel order (join_pairs16).
POSENC_INLINE void split_pairs16(__m512 x0, __m512 x1, __m512& firsts, __m512& partners) {
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  firsts = _mm512_permutex2var_ps(x0, evens, x1);
  partners = _mm512_permutex2var_ps(x0, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), x1);
}

POSENC_INLINE void join_pairs16(__m512 firsts, __m512 partners, __m512& x0, __m512& x1) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  x0 = _mm512_permutex2var_ps(firsts, low, partners);
  x1 = _mm512_permutex2var_ps(firsts, _mm512_add_epi32(low, _mm512_set1_epi32(8)), partners);
}
#elif defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX == 1 && \
    (defined(__x86_64__) || defined(__i386__))
// The same for pairs [i, i + 8) in the AVX2 build.
POSENC_INLINE void rotate_pairs8(__m256 a, __m256 b, PairCoeffs<float> k, int64_t i, __m256& first, __m256& second) {
  first = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(k.c1 + i)), _mm256_mul_ps(b, _mm256_loadu_ps(k.s1 + i)));
  second = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(k.c2 + i)), _mm256_mul_ps(a, _mm256_loadu_ps(k.s2 + i)));
}

// gptj's 8 pairs in two vectors x0, x1: the firsts and the partners of each 128-bit lane, then the lanes' order
// (split_pairs8); joined back in channel order (join_pairs8).
POSENC_INLINE void split_pairs8(__m256 x0, __m256 x1, __m256& firsts, __m256& partners) {
  firsts = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0x88)), 0xD8));
  partners = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0xDD)), 0xD8));
}

POSENC_INLINE void join_pairs8(__m256 firsts, __m256 partners, __m256& x0, __m256& x1) {
  const __m256 low = _mm256_unpacklo_ps(firsts, partners), high = _mm256_unpackhi_ps(firsts, partners);
  x0 = _mm256_permute2f128_ps(low, high, 0x20);
  x1 = _mm256_permute2f128_ps(low, high, 0x31);
}
#endif

#if !defined(__CUDACC__)
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
// Whether rotate_bf16_words takes a row of `pairs`: whole steps of 2 * kLanes neox pairs or kLanes gptj pairs.
template <RopeLayout kLayout>
POSENC_INLINE bool rotates_bf16_words(int64_t pairs) {
  return pairs % ((kLayout == RopeLayout::Neox ? 2 : 1) * Bf16Vectors::kLanes) == 0;
}

// n values (a multiple of 2 * kLanes) in the order of a bf16 row's words: each 2 * kLanes as the kLanes at even
// places, then the kLanes at odd places.
inline void word_order(const float* src, int64_t n, float* dst) {
  using V = Bf16Vectors;
  for (int64_t i = 0; i < n; i += 2 * V::kLanes) {
    V::Floats even, odd;
    V::deinterleave(V::load_floats(src + i), V::load_floats(src + i + V::kLanes), even, odd);
    V::store_floats(dst + i, even);
    V::store_floats(dst + i + V::kLanes, odd);
  }
}

// k's rows in word_order (rotate_bf16_words' neox pairs: a step's even pairs, then its odd ones), written to rows
// [4 * pairs] (two of them where k shares_rows).
inline PairCoeffs<float> neox_word_order(PairCoeffs<float> k, int64_t pairs, float* rows) {
  const float* source[4] = {k.c1, k.s1, k.c2, k.s2};
  const int count = shares_rows(k) ? 2 : 4;
  for (int r = 0; r < count; ++r) word_order(source[r], pairs, rows + r * pairs);
  return {rows, rows + pairs, rows + (count - 2) * pairs, rows + (count - 1) * pairs};
}

// Room for a token's neox_word_order, formed once and shared by its heads (rotates_bf16_words(pairs), pairs <=
// kMaxPairs): for 64 pairs, 64 instructions against about 3,000 for 16 heads' rows (counted in the kernel's listing).
struct NeoxWordRows {
  static constexpr int64_t kMaxPairs = 256;
  float rows[4 * kMaxPairs];

  static bool fits(int64_t pairs) { return rotates_bf16_words<RopeLayout::Neox>(pairs) && pairs <= kMaxPairs; }
};

// A contiguous bf16 row's pairs (rotates_bf16_words) rotated a 32-bit word of two channels at a time. gptj: a word
// is a pair, its low half the first channel, its high half the partner. neox: a step's 2 * kLanes channels of each
// half are one vector of words, whose low halves (the even channels) and high halves (the odd ones) are two vectors
// of floats, each rotated with its partners in the other half, k in neox_word_order. Either way the rotated values are
// joined back into words by a byte shuffle, an and and an or, with nothing moved across the vector's halves. The same
// products, sums and roundings as rotate_row's loop, so the same bits. rotate_bf16_vectors' neox rows, in the channels'
// own order, widen each 8 channels by a load and a shuffle and narrow each 16 by two shifts, a pack and a permutation
// across the halves, which Zen 2 runs on one or two of its four vector pipes. Separate processes taking turns, AVX2
// on a Zen 2: neox q, k [4, 2048, 16|8, 128] 1.24x (2 threads), in cache [4, 64, ...] 1.51x (one); bhsd 1.04x and
// 1.28x; DINOv3's [16, 16, 1029, 64] 1.29x; the baseline build in cache 1.10x. gptj rows, which rotate_bf16_vectors
// took as words already: bshd in cache 1.25x, bhsd 1.20x, Flux-like bhsd [32, 16, 1024, 64] 1.10x. Always inlined
// with the pair count fixed, in a function of few live values (rotate_unit_heads, rotate_head_runs_by_words): inlined
// into rotate_tokens, GCC rebuilt its constants at every step and reloaded k's pointers after every store.
template <RopeLayout kLayout, bool kStream, int64_t kPairs = 0>
__attribute__((always_inline)) inline void rotate_bf16_words(const c10::BFloat16* in, c10::BFloat16* out,
                                                             PairCoeffs<float> k, int64_t runtime_pairs) {
  using V = Bf16Vectors;
  constexpr int64_t kLanes = V::kLanes;
  const int64_t pairs = kPairs > 0 ? kPairs : runtime_pairs;
  if constexpr (kLayout == RopeLayout::Gptj) {
    for (int64_t i = 0; i < pairs; i += kLanes) {
      const V::Words words = V::load(in + 2 * i);
      const V::Floats a = V::low_halves_up(words), b = V::as_floats(V::high_halves(words));
      const V::Floats u = a * V::load_floats(k.c1 + i) - b * V::load_floats(k.s1 + i);
      const V::Floats v = b * V::load_floats(k.c2 + i) + a * V::load_floats(k.s2 + i);
      V::store_joined<kStream>(out + 2 * i, u, v);
    }
    return;
  }
  for (int64_t i = 0; i < pairs; i += 2 * kLanes) {
    const V::Words x1 = V::load(in + i), x2 = V::load(in + pairs + i);
    const V::Floats a[2] = {V::low_halves_up(x1), V::as_floats(V::high_halves(x1))};
    const V::Floats b[2] = {V::low_halves_up(x2), V::as_floats(V::high_halves(x2))};
    V::Floats u[2], v[2];
    for (int p = 0; p < 2; ++p) {
      const int64_t j = i + p * kLanes;
      u[p] = a[p] * V::load_floats(k.c1 + j) - b[p] * V::load_floats(k.s1 + j);
      v[p] = b[p] * V::load_floats(k.c2 + j) + a[p] * V::load_floats(k.s2 + j);
    }
    V::store_joined<kStream>(out + i, u[0], u[1]);
    V::store_joined<kStream>(out + pairs + i, v[0], v[1]);
  }
}

// The first pairs of a contiguous bf16 row in the baseline and AVX2 builds, through convert.h's widening and rounding
// by SSE2 or AVX2 (four or eight pairs a vector): the same products, sums and roundings as rotate_row's loop, so the
// same bits. NaNs are looked for once per two vectors (any_nan) and selected only where they hold one. gptj's pairs
// are 32-bit words, rotated by rotate_bf16_words. Returns the count rotated (a multiple of two vectors for neox, of
// one for gptj). kStream: stored past the caches, out on a vector's boundary.
// In-process A/Bs against GCC's vectorization of rotate_row's loop, q, k [4, 2048, 16|8, 128], 2 threads, on a
// 2-core Emerald Rapids guest: AVX2 neox 1.20x, gptj 1.46x, in place 1.15x (one thread 1.32x, 1.45x, 1.15x),
// looking for NaNs once a step 1.15-1.17x of that; the baseline's first form, pairs split by shuffles and every
// lane's NaN selected, 1.2-1.3x.
template <RopeLayout kLayout, bool kStream = false>
inline int64_t rotate_bf16_vectors(const c10::BFloat16* in, c10::BFloat16* out, PairCoeffs<float> k, int64_t pairs) {
  using V = Bf16Vectors;
  constexpr int64_t kLanes = V::kLanes;
  if constexpr (kLayout == RopeLayout::Gptj) {  // pair i: channels 2i and 2i + 1, the low and high halves of one word
    const int64_t whole = pairs - pairs % kLanes;
    rotate_bf16_words<kLayout, kStream>(in, out, k, whole);
    return whole;
  }
  const auto rotate = [&](V::Floats a, V::Floats b, int64_t i, V::Floats& u, V::Floats& v) {  // rotate_first, _second
    u = a * V::load_floats(k.c1 + i) - b * V::load_floats(k.s1 + i);
    v = b * V::load_floats(k.c2 + i) + a * V::load_floats(k.s2 + i);
  };
  int64_t i = 0;
  for (; i < pairs - pairs % (2 * kLanes); i += 2 * kLanes) {  // pair i: channels i and i + pairs
    V::Floats u[2], v[2];
    rotate(V::widen(in + i), V::widen(in + pairs + i), i, u[0], v[0]);
    rotate(V::widen(in + i + kLanes), V::widen(in + pairs + i + kLanes), i + kLanes, u[1], v[1]);
    V::store_narrowed<kStream>(out + i, u[0], u[1]);
    V::store_narrowed<kStream>(out + pairs + i, v[0], v[1]);
  }
  return i;
}

// Whether a bf16 row of `pairs` at out goes past the caches by rotate_bf16_vectors: whole 64-byte lines.
template <RopeLayout kLayout>
POSENC_INLINE bool streams_bf16_vectors(const c10::BFloat16* out, int64_t pairs) {
  return pairs % (kLayout == RopeLayout::Neox ? 32 : 16) == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0;
}

// Whether a contiguous row of view v goes past the caches by rotate_bf16_vectors: bf16, the view streams, out of
// place, whole lines.
template <RopeLayout kLayout, typename scalar_t>
POSENC_INLINE bool streams_bf16_row(const RotaryView<scalar_t>& v, const scalar_t* in, const scalar_t* out,
                                    int64_t pairs) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return v.stream && in != out && streams_bf16_vectors<kLayout>(out, pairs);
  }
  return false;
}

// A row that streams_bf16_row picks: rotated past the caches by rotate_bf16_vectors, the channels past the pairs copied.
template <RopeLayout kLayout>
POSENC_INLINE void rotate_bf16_row_streamed(const c10::BFloat16* in, c10::BFloat16* out, PairCoeffs<float> k,
                                            int64_t pairs, int64_t head_dim) {
  rotate_bf16_vectors<kLayout, true>(in, out, k, pairs);
  std::copy(in + 2 * pairs, in + head_dim, out + 2 * pairs);
}

// A contiguous bf16 head's row of a view rotated by rotate_bf16_words (neox: k in neox_word_order), past the caches
// where streams_bf16_row picks it; the channels past the pairs copied.
template <RopeLayout kLayout, int64_t kPairs>
__attribute__((always_inline)) inline void rotate_bf16_words_row(const RotaryView<c10::BFloat16>& v,
                                                                 const c10::BFloat16* in, c10::BFloat16* out,
                                                                 PairCoeffs<float> k, int64_t pairs) {
  if (streams_bf16_row<kLayout>(v, in, out, pairs)) {
    rotate_bf16_words<kLayout, true, kPairs>(in, out, k, pairs);
  } else {
    rotate_bf16_words<kLayout, false, kPairs>(in, out, k, pairs);
    if (in == out) return;
  }
  std::copy(in + 2 * pairs, in + v.head_dim, out + 2 * pairs);
}
#endif

// One head's row: pair i is channels (i, i + pairs) for neox, (2i, 2i + 1) for gptj; the channels past
// 2 * pairs are copied. kUnit: both rows are contiguous, which fixes every stride at compile time; kPairs > 0:
// so is the pair count, and the compiler unrolls the whole row (a 128-channel head is 4 AVX-512 vectors per
// half: the loop's own overhead would otherwise cost as much as the rotation); kShared: k shares_rows. bf16 is
// widened and rounded by convert.h's bit operations, which vectorize in the channels' own order (in the baseline
// and AVX2 builds, contiguous bf16 rows go through rotate_bf16_vectors first).
template <RopeLayout kLayout, bool kUnit, int64_t kPairs = 0, bool kShared = false, typename scalar_t,
          typename opmath_t>
POSENC_INLINE void rotate_row(const scalar_t* in, int64_t in_step, scalar_t* out, int64_t out_step,
                              PairCoeffs<opmath_t> k, int64_t runtime_pairs, int64_t head_dim) {
  const int64_t pairs = kPairs > 0 ? kPairs : runtime_pairs;
  const int64_t is = kUnit ? 1 : in_step;
  const int64_t os = kUnit ? 1 : out_step;
  const int64_t first = kLayout == RopeLayout::Neox ? 1 : 2;       // channel of pair i = first * i
  const int64_t second = kLayout == RopeLayout::Neox ? pairs : 1;  // its partner, `second` channels on
  const scalar_t* x1 = in;
  const scalar_t* x2 = in + second * is;
  scalar_t* y1 = out;
  scalar_t* y2 = out + second * os;
  int64_t done = 0;
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
  if constexpr (kUnit && std::is_same_v<scalar_t, c10::BFloat16>) {
    done = rotate_bf16_vectors<kLayout>(in, out, k, pairs);
  }
#endif
  POSENC_NO_CARRIED_DEPENDENCY
  for (int64_t i = done; i < pairs; ++i) {
    const auto a = to_opmath(x1[i * first * is]);
    const auto b = to_opmath(x2[i * first * is]);
    const opmath_t c1 = k.c1[i], s1 = k.s1[i];
    y1[i * first * os] = from_opmath<scalar_t>(rotate_first(a, b, c1, s1));
    y2[i * first * os] = from_opmath<scalar_t>(rotate_second(a, b, kShared ? c1 : k.c2[i], kShared ? s1 : k.s2[i]));
  }
  if (in == out) return;  // in place: the channels past rotary_dim are already there
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d * os] = in[d * is];
}

// rotate_row of a contiguous row, each of k's rows loaded once where it shares_rows. Always inlined: left to GCC,
// the shared rows gained 1.03-1.04x in cache where inlined they gain 1.08-1.12x (in-process A/B).
template <RopeLayout kLayout, int64_t kPairs, typename scalar_t, typename opmath_t>
__attribute__((always_inline)) inline void rotate_contiguous_row(const scalar_t* in, scalar_t* out,
                                                                 PairCoeffs<opmath_t> k, int64_t pairs,
                                                                 int64_t head_dim) {
  if (shares_rows(k)) return rotate_row<kLayout, true, kPairs, true>(in, 1, out, 1, k, pairs, head_dim);
  rotate_row<kLayout, true, kPairs>(in, 1, out, 1, k, pairs, head_dim);
}

// Asks for this head's row of the next token where the view's inputs are larger than the caches (v.read_ahead): a
// token's rows of a bshd tensor are a page or two (16 heads of 128 channels), where the hardware prefetchers stop, so
// each token would otherwise start with misses. In-process A/B, q, k [4, 2048, 16, 128] on a 2-core Emerald Rapids
// guest, 2 threads: in place 1.42-1.47x (float32, bf16, fp16), out of place 1.09-1.23x; AVX2 float32 1.24-1.44x, its
// integer-rounded bf16 1.02-1.04x. Inputs in the caches gain nothing (float32 0.91-0.97x, bf16 1.01-1.07x), so they do
// not ask. Always inlined: as a function of its own, GCC 12 found it free of effects and dropped every call (its
// earlier form, for every input, had no prefetch left in the built kernels). The rows are contiguous
// (rotate_unit_heads, rotate_heads_bf16); a prefetch never faults, so the last token's, past the end, are harmless.
template <typename scalar_t>
__attribute__((always_inline)) inline void prefetch_next_token(const RotaryView<scalar_t>& v, const scalar_t* in) {
  if (!v.read_ahead) return;
  const char* next = reinterpret_cast<const char*>(in + v.in_stride[1]);
  const int64_t bytes = v.head_dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(next + b);
}

#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX >= 1 && \
    (defined(__x86_64__) || defined(__i386__))
#define POSENC_ROTATES_F32_STREAMED_FROM_REGISTERS 1
// The pairs a vector of rotate_f32_row_streamed holds: out's lines are whole vectors.
constexpr int64_t kStreamedPairs = POSENC_CPU_CAPABILITY_INDEX == 2 ? 16 : 8;

// A float32 head's row rotated as rotate_row rotates it and sent past the caches from registers in the AVX2 and
// AVX-512 builds (out on a vector's boundary, pairs a multiple of kStreamedPairs); the channels past the pairs are
// copied. Through a row in L1 and store_streaming, the copy took a sixth of rope_qk's samples: in-process A/B, q, k
// [4, 2048, 16|8, 128], 1.07-1.14x (AVX-512).
template <RopeLayout kLayout>
POSENC_INLINE void rotate_f32_row_streamed(const float* in, float* out, PairCoeffs<float> k, int64_t pairs,
                                           int64_t head_dim) {
  constexpr bool kNeox = kLayout == RopeLayout::Neox;
#if POSENC_CPU_CAPABILITY_INDEX == 2
  const auto rotate_all = [&](auto shared) {  // std::true_type where k shares_rows
    for (int64_t i = 0; i < pairs; i += 16) {
      __m512 first, second;
      if constexpr (kNeox) {
        const __m512 a = _mm512_loadu_ps(in + i), b = _mm512_loadu_ps(in + pairs + i);
        rotate_pairs16<decltype(shared)::value>(a, b, k, i, first, second);
        _mm512_stream_ps(out + i, first);
        _mm512_stream_ps(out + pairs + i, second);
      } else {
        __m512 a, b, y0, y1;
        split_pairs16(_mm512_loadu_ps(in + 2 * i), _mm512_loadu_ps(in + 2 * i + 16), a, b);
        rotate_pairs16<decltype(shared)::value>(a, b, k, i, first, second);
        join_pairs16(first, second, y0, y1);
        _mm512_stream_ps(out + 2 * i, y0);
        _mm512_stream_ps(out + 2 * i + 16, y1);
      }
    }
  };
  if (shares_rows(k)) {
    rotate_all(std::true_type{});
  } else {
    rotate_all(std::false_type{});
  }
#else
  for (int64_t i = 0; i < pairs; i += 8) {
    __m256 a, b, first, second;
    if constexpr (kNeox) {
      a = _mm256_loadu_ps(in + i);
      b = _mm256_loadu_ps(in + pairs + i);
    } else {
      split_pairs8(_mm256_loadu_ps(in + 2 * i), _mm256_loadu_ps(in + 2 * i + 8), a, b);
    }
    rotate_pairs8(a, b, k, i, first, second);
    if constexpr (kNeox) {
      _mm256_stream_ps(out + i, first);
      _mm256_stream_ps(out + pairs + i, second);
    } else {
      __m256 y0, y1;
      join_pairs8(first, second, y0, y1);
      _mm256_stream_ps(out + 2 * i, y0);
      _mm256_stream_ps(out + 2 * i + 8, y1);
    }
  }
#endif
  std::copy(in + 2 * pairs, in + head_dim, out + 2 * pairs);
}
#endif

#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX >= 1 && \
    (defined(__x86_64__) || defined(__i386__))
#define POSENC_ROTATES_HALF_BY_INSTRUCTION 1
// A contiguous fp16 head's row rotated in registers in the AVX2 and AVX-512 builds, 64 bytes of output a step (neox:
// pairs a multiple of 32, the first channels of 32 pairs a line and their partners another; gptj: a multiple of 16,
// 16 pairs a line), each step's inputs read before its stores (so in place too): widened by vcvtph2ps, rotated as
// rotate_row rotates (rotate_pairs16, rotate_pairs8), rounded by vcvtps2ph as narrow rounds, so the same bits as
// rotate_row_half, which goes through a float row in L1 (in-process A/B against it, q [4, 2048, 16, 128] fp16, 1 and
// 2 threads, AVX-512: in place 1.20-1.24x, out of place in the cache 1.21-1.25x). AVX2 stores a line as two halves;
// against its float row (streamed by store_streaming in a token walk, ordinary stores in a head walk), in-process
// A/B on a 2-core Emerald Rapids guest, 2 threads (one): q, k [4, 2048, 16, 128] bshd 1.10-1.12x (1.10x), fwd+bwd
// 1.10x (1.37x), in place 1.07-1.16x; bhsd [32, 16, 1024, 64] Flux-like gptj 1.69x (2.08x), neox 1.83x (2.08x); in
// the caches ([1, 64, 16, 128], gptj [1, 16, 64, 64]) 1.08-1.57x.
// `stream`: the lines go past the caches (out on a line). The channels past the pairs are copied.
template <RopeLayout kLayout>
inline void rotate_half_row_by_instruction(const c10::Half* in, c10::Half* out, PairCoeffs<float> k, int64_t pairs,
                                           int64_t head_dim, bool stream) {
#if POSENC_CPU_CAPABILITY_INDEX == 2
  const auto stream_line = [&](c10::Half* p, __m512 low, __m512 high) {
    store_line(p, narrow_halfx32(low, high), stream);
  };
  if constexpr (kLayout == RopeLayout::Neox) {
    for (int64_t i = 0; i < pairs; i += 32) {
      __m512 first, second, first2, second2;
      rotate_pairs16(widen_halfx16(in + i), widen_halfx16(in + pairs + i), k, i, first, second);
      rotate_pairs16(widen_halfx16(in + i + 16), widen_halfx16(in + pairs + i + 16), k, i + 16, first2, second2);
      stream_line(out + i, first, first2);
      stream_line(out + pairs + i, second, second2);
    }
  } else {
    for (int64_t i = 0; i < pairs; i += 16) {
      __m512 a, b, first, second, y0, y1;
      split_pairs16(widen_halfx16(in + 2 * i), widen_halfx16(in + 2 * i + 16), a, b);
      rotate_pairs16(a, b, k, i, first, second);
      join_pairs16(first, second, y0, y1);
      stream_line(out + 2 * i, y0, y1);
    }
  }
#else
  const auto store_half = [&](c10::Half* p, __m256 low, __m256 high) {
    store_half_line(p, narrow_halfx16(low, high), stream);
  };
  if constexpr (kLayout == RopeLayout::Neox) {
    for (int64_t i = 0; i < pairs; i += 32) {
      __m256 first[4], second[4];
      for (int64_t j = 0; j < 4; ++j) {
        const int64_t p = i + 8 * j;
        rotate_pairs8(widen_halfx8(in + p), widen_halfx8(in + pairs + p), k, p, first[j], second[j]);
      }
      store_half(out + i, first[0], first[1]);
      store_half(out + i + 16, first[2], first[3]);
      store_half(out + pairs + i, second[0], second[1]);
      store_half(out + pairs + i + 16, second[2], second[3]);
    }
  } else {
    for (int64_t i = 0; i < pairs; i += 16) {
      __m256 y[4];
      for (int64_t j = 0; j < 2; ++j) {
        const c10::Half* x = in + 2 * i + 16 * j;
        __m256 a, b, first, second;
        split_pairs8(widen_halfx8(x), widen_halfx8(x + 8), a, b);
        rotate_pairs8(a, b, k, i + 8 * j, first, second);
        join_pairs8(first, second, y[2 * j], y[2 * j + 1]);
      }
      store_half(out + 2 * i, y[0], y[1]);
      store_half(out + 2 * i + 16, y[2], y[3]);
    }
  }
#endif
  if (in != out) std::copy(in + 2 * pairs, in + head_dim, out + 2 * pairs);
}

// Whether rotate_half_row_by_instruction takes a row of `pairs`: whole steps of 64 bytes of output.
template <RopeLayout kLayout>
POSENC_INLINE bool rotates_half_by_instruction(int64_t pairs) {
  return pairs % (kLayout == RopeLayout::Neox ? 32 : 16) == 0;
}
#endif

// Whether fp16 rows of `pairs` are rotated in registers (rotate_half_row_by_instruction: the AVX2 and AVX-512
// builds).
template <RopeLayout kLayout>
POSENC_INLINE bool rotates_half_in_registers(int64_t pairs) {
#if defined(POSENC_ROTATES_HALF_BY_INSTRUCTION)
  return rotates_half_by_instruction<kLayout>(pairs);
#else
  return false;
#endif
}

#if defined(POSENC_ROTATES_F32_STREAMED_FROM_REGISTERS)
// Whether rotate_f32_row_streamed takes a row of a view: float32, the view streams, out of place, out on a vector's
// boundary, pairs a multiple of a vector's.
template <typename scalar_t>
POSENC_INLINE bool streams_from_registers(const RotaryView<scalar_t>& v, const scalar_t* in, const scalar_t* out,
                                          int64_t pairs) {
  return std::is_same_v<scalar_t, float> && v.stream && in != out && pairs % kStreamedPairs == 0 &&
         reinterpret_cast<uintptr_t>(out) % (4 * kStreamedPairs) == 0;
}
#endif

// A contiguous fp16 row: c10::Half converts one value at a time, which keeps rotate_row scalar. The rotated
// channels are widened into a float row, rotated there by the float kernel and narrowed back (eight at a time
// with F16C where the capability has it); the channels past rotary_dim are copied as they are. The common pair
// counts (head_dim 128 and 64, fully rotated) take rows of a fixed size, as rotate_heads gives the other types:
// 30.7 -> 22.7 ns per row of 64 channels in cache (one thread, AVX-512).
template <RopeLayout kLayout, int64_t kPairs = 0>
void rotate_row_half(const c10::Half* in, c10::Half* out, PairCoeffs<float> k, int64_t pairs, int64_t head_dim) {
  constexpr int64_t kBlock = 128;  // pairs per pass through the float row
  if constexpr (kPairs == 0) {
    if (pairs == 64) return rotate_row_half<kLayout, 64>(in, out, k, pairs, head_dim);
    if (pairs == 32) return rotate_row_half<kLayout, 32>(in, out, k, pairs, head_dim);
  }
  alignas(64) float x[2 * kBlock];
  for (int64_t i = 0; i < pairs; i += kBlock) {
    const int64_t n = kPairs > 0 ? kPairs : std::min(kBlock, pairs - i);
    const PairCoeffs<float> block{k.c1 + i, k.s1 + i, k.c2 + i, k.s2 + i};
    if constexpr (kLayout == RopeLayout::Neox) {  // the block's first channels, then their partners
      widen(in + i, x, n);
      widen(in + pairs + i, x + n, n);
      rotate_row<kLayout, true, kPairs>(x, 1, x, 1, block, n, 2 * n);
      narrow(x, out + i, n);
      narrow(x + n, out + pairs + i, n);
    } else {
      widen(in + 2 * i, x, 2 * n);
      rotate_row<kLayout, true, kPairs>(x, 1, x, 1, block, n, 2 * n);
      narrow(x, out + 2 * i, 2 * n);
    }
  }
  if (in == out) return;
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d] = in[d];
}

// A contiguous fp16 head's row of view v: in registers where rotate_half_row_by_instruction takes its pairs (past the
// caches where v streams and out starts on a line), else through rotate_row_half's float row with ordinary stores.
template <RopeLayout kLayout>
POSENC_INLINE void rotate_half_head(const RotaryView<c10::Half>& v, const c10::Half* in, c10::Half* out,
                                    PairCoeffs<float> k, int64_t pairs) {
#if defined(POSENC_ROTATES_HALF_BY_INSTRUCTION)
  if (rotates_half_by_instruction<kLayout>(pairs)) {
    const bool stream = v.stream && in != out && reinterpret_cast<uintptr_t>(out) % 64 == 0;
    return rotate_half_row_by_instruction<kLayout>(in, out, k, pairs, v.head_dim, stream);
  }
#endif
  rotate_row_half<kLayout>(in, out, k, pairs, v.head_dim);
}

// The most channels of a head that a kernel rotates into a row in L1 to store it past the caches from there (the
// token walk's rows here, the baseline's QK-norm heads in cpu/kernels/rope.cpp); longer heads keep ordinary stores.
constexpr int64_t kStreamedRowChannels = 512;

// A head's row of a token walk rotated as rotate_row<kLayout, true, kPairs> rotates it (fp16: rotate_half_head), and
// stored past the caches when the view asks: float32 rows from registers where rotate_f32_row_streamed takes them,
// fp16 rows where rotate_half_head streams them, the others through a row in L1 sent on by store_streaming (heads
// wider than it take ordinary stores). fp16 rows through the row so streamed, in-process A/B, AVX2 build, q, k
// [4, 2048, 16, 128] on a 2-core Emerald Rapids guest: 1.44-1.81x on 2 threads (fwd+bwd 1.55-1.71x), 1.69x on one;
// the baseline build 1.00x (a head walk's rows so streamed, Flux-like bhsd gptj [32, 16, 1024, 64], 0.94x under
// AVX2: there they stream only from registers, rotate_half_head). bf16 rows of the baseline and
// AVX2 builds go from registers as whole lines (rotate_bf16_vectors; AVX2, q, k [4, 2048, 16|8, 128]: 1.11x on 2
// threads, 1.19-1.21x on one); through a row in L1 they had read 0.94-1.11x. Not float64: rotated into a local row,
// its gptj pairs were compiled (GCC 12, AVX2 and AVX-512) to vfmaddsub, a fused multiply-add that -ffp-contract=off
// does not stop, which changed the last bit.
template <RopeLayout kLayout, int64_t kPairs, typename scalar_t, typename opmath_t>
POSENC_INLINE void rotate_unit_row(const RotaryView<scalar_t>& v, const scalar_t* in, scalar_t* out,
                                   PairCoeffs<opmath_t> k, int64_t pairs) {
  constexpr int64_t kRow = kStreamedRowChannels;
  if constexpr (std::is_same_v<scalar_t, float>) {
#if defined(POSENC_ROTATES_F32_STREAMED_FROM_REGISTERS)
    if (streams_from_registers(v, in, out, pairs)) {
      rotate_f32_row_streamed<kLayout>(in, out, k, pairs, v.head_dim);
      return;
    }
#endif
    if (v.stream && in != out && v.head_dim <= kRow) {
      alignas(64) float row[kRow];
      rotate_row<kLayout, true, kPairs>(in, 1, row, 1, k, pairs, v.head_dim);
      store_streaming(row, out, v.head_dim);
      return;
    }
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
    if (streams_bf16_row<kLayout>(v, in, out, pairs)) {
      rotate_bf16_row_streamed<kLayout>(in, out, k, pairs, v.head_dim);
      return;
    }
#endif
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    if (v.stream && in != out && v.head_dim <= kRow && !rotates_half_in_registers<kLayout>(pairs)) {
      alignas(64) c10::Half row[kRow];
      rotate_row_half<kLayout>(in, row, k, pairs, v.head_dim);
      store_streaming(row, out, v.head_dim);
      return;
    }
    return rotate_half_head<kLayout>(v, in, out, k, pairs);
  }
  rotate_contiguous_row<kLayout, kPairs>(in, out, k, pairs, v.head_dim);
}

// Every head of a token of a view whose rows are contiguous, from the token's first rows in and out, kPairs
// pairs each (0: any count).
template <RopeLayout kLayout, int64_t kPairs, typename scalar_t, typename opmath_t>
void rotate_unit_heads(const RotaryView<scalar_t>& v, const scalar_t* in, scalar_t* out, PairCoeffs<opmath_t> k,
                       int64_t pairs) {
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const bool reorders = kLayout == RopeLayout::Neox && !k.words;  // k.words: whole steps already
    if (reorders ? NeoxWordRows::fits(pairs) : rotates_bf16_words<kLayout>(pairs)) {
      NeoxWordRows rows;
      const PairCoeffs<float> words = reorders ? neox_word_order(k, pairs, rows.rows) : k;
      for (int64_t h = 0; h < v.heads; ++h, in += v.in_stride[2], out += v.out_stride[2]) {
        prefetch_next_token(v, in);
        rotate_bf16_words_row<kLayout, kPairs>(v, in, out, words, pairs);
      }
      return;
    }
  }
#endif
  for (int64_t h = 0; h < v.heads; ++h, in += v.in_stride[2], out += v.out_stride[2]) {
    prefetch_next_token(v, in);
    rotate_unit_row<kLayout, kPairs>(v, in, out, k, pairs);
  }
}

// Every head of token (b, s) of a view. The common pair counts (head_dim 128 and 64, fully rotated) get rows
// of a fixed size (fp16 rows go through float blocks of their own size).
template <RopeLayout kLayout, typename scalar_t, typename opmath_t>
void rotate_heads(const RotaryView<scalar_t>& v, int64_t b, int64_t s, PairCoeffs<opmath_t> k, int64_t pairs) {
  const scalar_t* in = v.in + b * v.in_stride[0] + s * v.in_stride[1];
  scalar_t* out = output_token(v, b, s);
  if (out == nullptr) return;
  const int64_t fixed = std::is_same_v<scalar_t, c10::Half> ? 0 : pairs;
  if (v.in_stride[3] != 1 || v.out_stride[3] != 1) {
    for (int64_t h = 0; h < v.heads; ++h, in += v.in_stride[2], out += v.out_stride[2]) {
      rotate_row<kLayout, false>(in, v.in_stride[3], out, v.out_stride[3], k, pairs, v.head_dim);
    }
  } else if (fixed == 64) {
    rotate_unit_heads<kLayout, 64>(v, in, out, k, pairs);
  } else if (fixed == 32) {
    rotate_unit_heads<kLayout, 32>(v, in, out, k, pairs);
  } else {
    rotate_unit_heads<kLayout, 0>(v, in, out, k, pairs);
  }
}

// Every head of token (b, s) copied as it is (a value written into its cache).
template <typename scalar_t>
void copy_token(const RotaryView<scalar_t>& v, int64_t b, int64_t s) {
  const scalar_t* in = v.in + b * v.in_stride[0] + s * v.in_stride[1];
  scalar_t* out = output_token(v, b, s);
  if (out == nullptr) return;
  for (int64_t h = 0; h < v.heads; ++h, in += v.in_stride[2], out += v.out_stride[2]) {
    if (v.in_stride[3] == 1 && v.out_stride[3] == 1) {
      std::copy(in, in + v.head_dim, out);
    } else {
      for (int64_t d = 0; d < v.head_dim; ++d) out[d * v.out_stride[3]] = in[d * v.in_stride[3]];
    }
  }
}

#if defined(POSENC_BF16_BY_AVX512BF16)
// Pairs [i, i + 16) of a contiguous bf16 row rotated in float32 as rotate_row rotates them: their first channels in
// `first`, their partners in `second`. False where the instruction would round one of them otherwise than the
// integer form (rounds_apart, convert.h).
template <RopeLayout kLayout>
POSENC_TARGET_AVX512BF16 POSENC_INLINE bool rotate_bf16x16_pairs(const c10::BFloat16* in, PairCoeffs<float> k,
                                                                 int64_t pairs, int64_t i, __m512& first,
                                                                 __m512& second) {
  __m512 a, b;
  if constexpr (kLayout == RopeLayout::Neox) {
    a = widen_bf16x16(in + i);
    b = widen_bf16x16(in + pairs + i);
  } else {  // a pair's two bf16 are the halves of one 32-bit word (masks of all lanes: GCC 12's placeholders)
    const __m512i words = _mm512_loadu_si512(in + 2 * i);
    a = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, words, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  rotate_pairs16(a, b, k, i, first, second);
  return (rounds_apart(first) | rounds_apart(second)) == 0;
}

// Pairs [i, i + count) of a bf16 row rotated and rounded by the integer form.
template <RopeLayout kLayout>
inline void rotate_bf16_pairs_by_integers(const c10::BFloat16* in, c10::BFloat16* out, PairCoeffs<float> k,
                                          int64_t pairs, int64_t i, int64_t count) {
  const int64_t step = kLayout == RopeLayout::Neox ? 1 : 2;
  const int64_t partner = kLayout == RopeLayout::Neox ? pairs : 1;
  for (int64_t j = i; j < i + count; ++j) {
    const float x1 = to_opmath(in[j * step]);
    const float x2 = to_opmath(in[j * step + partner]);
    out[j * step] = from_opmath<c10::BFloat16>(rotate_first(x1, x2, k.c1[j], k.s1[j]));
    out[j * step + partner] = from_opmath<c10::BFloat16>(rotate_second(x1, x2, k.c2[j], k.s2[j]));
  }
}

// One contiguous bf16 row of `pairs` (a multiple of 16) rotated and rounded by AVX-512 BF16 where that gives the
// integer form's bits (rotate_bf16x16_pairs; each 16 pairs are rotated, checked, then stored, so rows rotated in
// place are redone from their input). `stream`: the output's 64-byte lines go past the caches from registers (out
// on a line): gptj's 16 pairs are one, neox's first (and second) channels of 32 pairs another. The channels past
// the pairs are copied.
template <RopeLayout kLayout>
POSENC_TARGET_AVX512BF16 POSENC_INLINE void rotate_bf16_row(const c10::BFloat16* in, c10::BFloat16* out,
                                                            PairCoeffs<float> k, int64_t pairs, int64_t head_dim,
                                                            bool stream) {
  constexpr bool kNeox = kLayout == RopeLayout::Neox;
  __m512 first, second, first2, second2;
  if (kNeox && pairs % 32 == 0) {
    for (int64_t i = 0; i < pairs; i += 32) {
      if (rotate_bf16x16_pairs<kLayout>(in, k, pairs, i, first, second) &&
          rotate_bf16x16_pairs<kLayout>(in, k, pairs, i + 16, first2, second2)) {
        store_bf16x32_line(first, first2, out + i, stream);
        store_bf16x32_line(second, second2, out + pairs + i, stream);
      } else {
        rotate_bf16_pairs_by_integers<kLayout>(in, out, k, pairs, i, 32);
      }
    }
  } else {
    for (int64_t i = 0; i < pairs; i += 16) {
      if (!rotate_bf16x16_pairs<kLayout>(in, k, pairs, i, first, second)) {
        rotate_bf16_pairs_by_integers<kLayout>(in, out, k, pairs, i, 16);
      } else if constexpr (kNeox) {
        store_bf16x32(first, second, out + i, out + pairs + i);
      } else {  // first's 16 in the low words, second's in the high, put back in pair order by one vpermw
        const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));
        const __m512i pair_order = _mm512_setr_epi32(16 << 16, 1 | 17 << 16, 2 | 18 << 16, 3 | 19 << 16,
                                                     4 | 20 << 16, 5 | 21 << 16, 6 | 22 << 16, 7 | 23 << 16,
                                                     8 | 24 << 16, 9 | 25 << 16, 10 | 26 << 16, 11 | 27 << 16,
                                                     12 | 28 << 16, 13 | 29 << 16, 14 | 30 << 16, 15 | 31 << 16);
        store_line(out + 2 * i, _mm512_maskz_permutexvar_epi16(0xFFFFFFFFu, pair_order, halves), stream);
      }
    }
  }
  if (in != out) std::copy(in + 2 * pairs, in + head_dim, out + 2 * pairs);
}

// rotate_heads of a bf16 view whose rows are contiguous, pairs a multiple of 16, each head by rotate_bf16_row; heads
// whose output starts on a line stream where the view does.
template <RopeLayout kLayout>
POSENC_TARGET_AVX512BF16 void rotate_heads_bf16(const RotaryView<c10::BFloat16>& v, int64_t b, int64_t s,
                                                PairCoeffs<float> k, int64_t pairs) {
  const c10::BFloat16* in = v.in + b * v.in_stride[0] + s * v.in_stride[1];
  c10::BFloat16* out = output_token(v, b, s);
  if (out == nullptr) return;
  for (int64_t h = 0; h < v.heads; ++h, in += v.in_stride[2], out += v.out_stride[2]) {
    prefetch_next_token(v, in);
    const bool stream = v.stream && in != out && reinterpret_cast<uintptr_t>(out) % 64 == 0;
    rotate_bf16_row<kLayout>(in, out, k, pairs, v.head_dim, stream);
  }
}
#endif

template <typename scalar_t, typename opmath_t>
void rotate_token(const RotaryView<scalar_t>& v, int64_t b, int64_t s, PairCoeffs<opmath_t> k, int64_t pairs,
                  RopeLayout layout) {
  if (layout == RopeLayout::Neox) {
    rotate_heads<RopeLayout::Neox>(v, b, s, k, pairs);
  } else {
    rotate_heads<RopeLayout::Gptj>(v, b, s, k, pairs);
  }
}
#endif

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
