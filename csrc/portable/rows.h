#pragma once
// Row adders of the additive families (sinusoidal, learned): out = in * scale + pe over rows, in maths
// precision, rounded once. `pe` is the encoding (maths precision: sinusoidal) or a table row (storage
// precision: learned); the row's channels past `encoded` (an odd width's last channel) get no encoding.
#include "portable/convert.h"
#include "portable/streaming.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace posenc::portable {
inline namespace POSENC_KERNEL_NAMESPACE {

#if defined(POSENC_BF16_BY_AVX512BF16) || defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
// bf16 rows are rounded in registers, and so may go past the caches as whole 64-byte lines: by AVX-512 BF16
// (add_bf16_by_instruction) or by the baseline's and the AVX2 build's vectors (add_bf16_vectors).
#define POSENC_STREAMS_ROW_LINES 1
#endif

#if !defined(__CUDACC__)
// Rows given the same encoding per call of add_rows: batch rows of one position. Two measured 5-24% faster than
// one on every additive row of scripts/bench.py (fp32 and bf16, both orders of an interleaved A/B); four and eight
// were no faster than one (more streams than the prefetchers and the memory keep up with).
constexpr int64_t kRowsPerEncoding = 2;

// How add_rows stores its sums: as they are; past the caches (outputs larger than the last-level cache: float32,
// streaming.h, and fp16 in the AVX2 and AVX-512 builds); or, for bf16 in the AVX-512 build on a CPU with AVX-512 BF16,
// rounded by vcvtneps2bf16 (convert.h), and for outputs larger than the last-level cache stored past it as whole
// 64-byte lines from registers, as the baseline and AVX2 builds store them (add_bf16_vectors; kBf16ByInstruction is
// then kCached). The *ReadAhead kinds, for fp16 and bf16 rows streamed where the input rows follow one another in
// memory (the bytes past a row are the next row read), also ask for the input's lines kReadAheadBytes ahead of its
// loads.
enum class RowStores {
  kCached,
  kStreamed,
  kStreamedReadAhead,
  kBf16ByInstruction,
  kBf16Streamed,
  kBf16StreamedReadAhead
};

inline bool streamed(RowStores stores) {
  return stores == RowStores::kStreamed || stores == RowStores::kStreamedReadAhead;
}

inline bool bf16_streamed(RowStores stores) {
  return stores == RowStores::kBf16Streamed || stores == RowStores::kBf16StreamedReadAhead;
}

inline bool reads_ahead(RowStores stores) {
  return stores == RowStores::kStreamedReadAhead || stores == RowStores::kBf16StreamedReadAhead;
}

// With its stores going past the caches, a core running the bf16 rows (more instructions a line than a copy) left the
// input's lines to the hardware prefetchers, which fell behind: asking for each line 2 KiB ahead of its loads (one
// prefetch a line, spread over the loop) made the streamed bf16 rows 1.01-1.27x as fast (in-process A/B, 1 and 2
// threads, the memory in its faster and slower states: add_sinusoidal [8, 2048, 1024] 1.06-1.27, CogVideoX's grid
// 1.11-1.23, DINOv2-L's resampled rows 1.01-1.08, add_learned 1.03-1.11; 1, 1.5 and 4 KiB ahead alike, to L2 rather
// than L1 a little slower), and the streamed fp16 rows 1.02-1.20x. Asked for a whole row at a time: 0.83-0.95x. Not
// asked for: rows gathered by id (0.78-0.84x: the bytes past a row are another token's), rows kept in the caches
// (0.88-1.08x), float32 streamed rows (0.91-1.13x, uneven).
constexpr int64_t kReadAheadBytes = 2048;

#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
// x * scale + pe over the first channels of a bf16 row in the baseline and AVX2 builds, two vectors a step through
// convert.h's widening and rounding by SSE2 or AVX2: the same product, sum and rounding as add_rows' loop, so the same
// bits. NaNs are looked for once a step and selected only where a step has one. Returns the count added (a multiple
// of two vectors). Against GCC's vectorization of that loop, AVX2, in-process A/B, 2 threads, bf16 x [8, 2048, 1024]:
// add_sinusoidal 1.35x, add_learned 1.37x, embed_learned 1.37x (in cache, [2, 64, 1024]: 1.28-1.36x); the baseline's
// SSE2 form before the NaN test, one thread, separate processes: 1.12-1.15x (in cache 1.24-1.25x).
// kStream: y's whole 64-byte lines go past the caches (y on a line; the caller adds what is left of the row), x's
// lines asked for kReadAheadBytes ahead where `read_ahead`. kScaled false: scale is 1, and x * 1 is x (a NaN's
// payload aside, which the rounding drops): the same bits without the product.
template <bool kStream, bool kScaled>
inline int64_t add_bf16_vectors_as(const c10::BFloat16* x, const float* pe, c10::BFloat16* y, int64_t n, float scale,
                                   bool read_ahead) {
  using V = Bf16Vectors;
  constexpr int64_t kStep = kStream ? 64 / sizeof(c10::BFloat16) : 2 * V::kLanes;  // streamed: a line a step
  const V::Floats s = V::splat(scale);
  const auto scaled = [&](V::Floats v) { return kScaled ? v * s : v; };
  int64_t d = 0;
  for (; d < n - n % kStep; d += kStep) {
    // a hint, never a fault: past the tensor's end it asks for nothing of use
    if (kStream && read_ahead) _mm_prefetch(reinterpret_cast<const char*>(x + d) + kReadAheadBytes, _MM_HINT_T0);
    for (int64_t v = d; v < d + kStep; v += 2 * V::kLanes) {
      const V::Floats low = scaled(V::widen(x + v)) + V::load_floats(pe + v);
      const V::Floats high = scaled(V::widen(x + v + V::kLanes)) + V::load_floats(pe + v + V::kLanes);
      V::store_narrowed<kStream>(y + v, low, high);
    }
  }
  return d;
}

template <bool kStream = false>
inline int64_t add_bf16_vectors(const c10::BFloat16* x, const float* pe, c10::BFloat16* y, int64_t n, float scale,
                                bool read_ahead = false) {
  return scale == 1.0f ? add_bf16_vectors_as<kStream, false>(x, pe, y, n, scale, read_ahead)
                       : add_bf16_vectors_as<kStream, true>(x, pe, y, n, scale, read_ahead);
}
#endif

#if defined(POSENC_BF16_BY_AVX512BF16)
// x * scale + pe over the first channels of a bf16 row, rounded by AVX-512 BF16, which rounds as from_opmath does
// except on denormals (read as zero) and NaNs (payload kept): at the first sums holding one (vfpclassps: one
// instruction and a test per 16, against six for the integer rounding), it stops and leaves the rest of the row to
// add_rows' loop. 32 sums a step, both halves rounded by one vcvtne2ps2bf16 and stored as one 64-byte vector: in L1
// and L2, 1.4-1.5x the speed of 16 a step rounded by vcvtneps2bf16 (the test's mask and branch per 16 were the
// loop's limit). Streamed, the row goes by y's 64-byte lines: the part of a line before the first whole one by
// masked loads and store, then the whole lines past the caches. Returns the count added.
// pe is float32 (encodings) or bf16 (table rows, widened as they are read).
template <typename pe_t>
POSENC_TARGET_AVX512BF16 inline int64_t add_bf16_by_instruction(const c10::BFloat16* x, const pe_t* pe,
                                                                c10::BFloat16* y, int64_t n, float scale,
                                                                bool stream, bool read_ahead = false) {
  const __m512 s = _mm512_set1_ps(scale);
  // the sums of channels d.. d + 15 that `lanes` selects (the others 0, which both roundings give alike)
  const auto sum16 = [&](int64_t d, __mmask16 lanes) {
    __m512 e;
    if constexpr (std::is_same_v<pe_t, float>) {
      e = _mm512_maskz_loadu_ps(lanes, pe + d);
    } else {
      e = widen_bf16x16(pe + d, lanes);
    }
    return _mm512_add_ps(_mm512_mul_ps(widen_bf16x16(x + d, lanes), s), e);
  };
  int64_t d = 0;
  stream = stream && reinterpret_cast<uintptr_t>(y) % 2 == 0;
  if (stream) {
    const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(y) % 64) % 64 / 2);
    if (head > 0) {
      const auto lanes = static_cast<__mmask32>((uint64_t{1} << head) - 1);
      const __m512 low = sum16(0, static_cast<__mmask16>(lanes));
      const __m512 high = sum16(16, static_cast<__mmask16>(lanes >> 16));
      if ((rounds_apart(low) | rounds_apart(high)) != 0) return 0;
      _mm512_mask_storeu_epi16(y, lanes, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
      d = head;
    }
  }
  for (; d + 32 <= n; d += 32) {
    // a hint, never a fault: past the tensor's end it asks for nothing of use
    if (read_ahead) _mm_prefetch(reinterpret_cast<const char*>(x + d) + kReadAheadBytes, _MM_HINT_T0);
    const __m512 low = sum16(d, 0xFFFF), high = sum16(d + 16, 0xFFFF);
    if ((rounds_apart(low) | rounds_apart(high)) != 0) break;
    store_bf16x32_line(low, high, y + d, stream);
  }
  for (; d + 16 <= n; d += 16) {
    const __m512 sum = sum16(d, 0xFFFF);
    if (rounds_apart(sum) != 0) break;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
  }
  return d;
}
#endif

#if defined(POSENC_HAS_F16C)
// x * scale + pe over n fp16 channels in registers, widened by vcvtph2ps and rounded by vcvtps2ph (to nearest even,
// a NaN's payload kept): the conversions widen and narrow make (convert.h), so the same bits as add_rows' float
// chunk, without the chunk's pass through L1 and the scalar widening of x. AVX-512: 32 channels a step, stored as one
// 64-byte vector, the last step masked; `stream`: y's whole lines past the caches, the part of a line before the
// first by a masked store; `read_ahead`: x's lines asked for kReadAheadBytes ahead. AVX2: 16 a step; `stream`: the
// part of a line before the first value by value, then each whole line as two halves past the caches, what is left
// after the last whole step to the caller. Returns the count added. In-process A/B against the float chunk with
// ordinary stores, AVX-512, 2 threads: [8, 2048, 1024] add_sinusoidal 1.66x, add_learned 1.69x, the fused
// embeddings 1.41-1.43x, the resampled ViT-B and DINOv2-L rows 1.51x and 1.38x, PixArt's grid 1.53x, CogVideoX's
// 1.17x; 1.35-1.88x on one thread. AVX2, streamed against its ordinary stores (in-process A/B, 2 threads, on an
// Emerald Rapids guest): add_sinusoidal 1.52-1.62x, add_learned 1.62-1.91x, embed_learned and embed_sinusoidal
// 1.16x, DINOv2-L's resampled rows 1.41x; one thread 1.42-1.71x.
inline int64_t add_half_by_instruction(const c10::Half* x, const float* pe, c10::Half* y, int64_t n, float scale,
                                       bool stream, bool read_ahead) {
#if POSENC_CPU_CAPABILITY_INDEX == 2
  const __m512 s = _mm512_set1_ps(scale);
  // the rounded sums of channels d .. d + 31 that `lanes` selects
  const auto sum32 = [&](int64_t d, __mmask32 lanes) {
    const auto low_lanes = static_cast<__mmask16>(lanes), high_lanes = static_cast<__mmask16>(lanes >> 16);
    const __m512 low =
        _mm512_add_ps(_mm512_mul_ps(widen_halfx16(x + d, low_lanes), s), _mm512_maskz_loadu_ps(low_lanes, pe + d));
    const __m512 high = _mm512_add_ps(_mm512_mul_ps(widen_halfx16(x + d + 16, high_lanes), s),
                                      _mm512_maskz_loadu_ps(high_lanes, pe + d + 16));
    return narrow_halfx32(low, high);
  };
  const auto first_lanes = [](int64_t count) { return static_cast<__mmask32>((uint64_t{1} << count) - 1); };
  int64_t d = 0;
  if (stream) {
    const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(y) % 64) % 64 / 2);
    if (head > 0) _mm512_mask_storeu_epi16(y, first_lanes(head), sum32(0, first_lanes(head)));
    d = head;
  }
  for (; d + 32 <= n; d += 32) {
    // a hint, never a fault: past the tensor's end it asks for nothing of use
    if (read_ahead) _mm_prefetch(reinterpret_cast<const char*>(x + d) + kReadAheadBytes, _MM_HINT_T0);
    store_line(y + d, sum32(d, 0xFFFFFFFFu), stream);
  }
  if (d < n) _mm512_mask_storeu_epi16(y + d, first_lanes(n - d), sum32(d, first_lanes(n - d)));
  return n;
#else
  const __m256 s = _mm256_set1_ps(scale);
  const auto sum8 = [&](int64_t d) {
    return _mm256_add_ps(_mm256_mul_ps(widen_halfx8(x + d), s), _mm256_loadu_ps(pe + d));
  };
  const auto sum16 = [&](int64_t d) { return narrow_halfx16(sum8(d), sum8(d + 8)); };
  int64_t d = 0;
  if (stream) {
    const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(y) % 64) % 64 / 2);
    for (; d < head; ++d) y[d] = from_opmath<c10::Half>(to_opmath(x[d]) * scale + pe[d]);
    for (; d + 32 <= n; d += 32) {
      if (read_ahead) _mm_prefetch(reinterpret_cast<const char*>(x + d) + kReadAheadBytes, _MM_HINT_T0);
      store_half_line(y + d, sum16(d), true);
      store_half_line(y + d + 16, sum16(d + 16), true);
    }
  }
  for (; d + 16 <= n; d += 16) store_half_line(y + d, sum16(d), false);
  return d;
#endif
}
#endif

#if defined(POSENC_CPU_CAPABILITY_INDEX) && POSENC_CPU_CAPABILITY_INDEX >= 1 && (defined(__x86_64__) || defined(__i386__))
#define POSENC_F32_STREAMED_FROM_REGISTERS 1
// x * scale + pe over n float32 channels stored past the caches from registers in the AVX2 and AVX-512 builds: y's
// whole vectors by non-temporal stores, the parts of lines before and after them by ordinary stores (AVX-512: masked;
// AVX2: value by value, its masked store being microcoded on AMD's cores). Through a float chunk in L1 and
// store_streaming, the chunk's stores and loads cost 1-23% of the streamed rows (in-process A/B, AVX-512). A masked
// store with no lane selected still slowed the rows to 0.6-0.85x (it touches the line the non-temporal stores write
// next), so the ends are stored only where they hold a value. y holds whole floats.
inline void add_f32_streamed(const float* x, const float* pe, float* y, int64_t n, float scale) {
#if POSENC_CPU_CAPABILITY_INDEX == 2
  const __m512 s = _mm512_set1_ps(scale);
  const auto sum16 = [&](int64_t d, __mmask16 lanes) {
    return _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + d), s), _mm512_maskz_loadu_ps(lanes, pe + d));
  };
  const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(y) % 64) % 64 / 4);
  if (head > 0) {
    const auto first = static_cast<__mmask16>((1u << head) - 1);
    _mm512_mask_storeu_ps(y, first, sum16(0, first));
  }
  int64_t d = head;
  for (; d + 16 <= n; d += 16) _mm512_stream_ps(y + d, sum16(d, 0xFFFF));
  if (d < n) {
    const auto last = static_cast<__mmask16>((1u << (n - d)) - 1);
    _mm512_mask_storeu_ps(y + d, last, sum16(d, last));
  }
#else
  const __m256 s = _mm256_set1_ps(scale);
  const int64_t head = std::min<int64_t>(n, (32 - reinterpret_cast<uintptr_t>(y) % 32) % 32 / 4);
  int64_t d = 0;
  for (; d < head; ++d) y[d] = x[d] * scale + pe[d];
  for (; d + 8 <= n; d += 8) {
    _mm256_stream_ps(y + d, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), s), _mm256_loadu_ps(pe + d)));
  }
  for (; d < n; ++d) y[d] = x[d] * scale + pe[d];
#endif
}
#endif

// out[r] = in[r] * scale + pe for the `count` rows (at most kRowsPerEncoding) that share one encoding row pe
// (in == nullptr: out[r] = pe), over `width` channels, the first `encoded` with pe. A chunk of pe is read once
// for all the rows: the block of encodings sits in L2, and read again for every row it cost as much as the rows'
// own loads (fp32 encodings are twice the bytes of a bf16 row). fp16 sums go through a float chunk narrowed at
// once (eight values per instruction with F16C), the same bits as from_opmath value by value. Streamed float32
// sums go past the caches from registers in the AVX2 and AVX-512 builds (add_f32_streamed), through a float chunk
// in L1 in the baseline build.
template <typename scalar_t, typename pe_t>
void add_rows(int64_t count, const scalar_t* const* in, const pe_t* pe, scalar_t* const* out, int64_t encoded,
              int64_t width, opmath_t<scalar_t> scale, RowStores stores = RowStores::kCached) {
  using opmath = opmath_t<scalar_t>;
  constexpr int64_t kChunk = 256;
  constexpr bool kWidenPe = !std::is_same_v<pe_t, opmath>;
  constexpr bool kHalf = std::is_same_v<scalar_t, c10::Half>;
  constexpr bool kStreams = std::is_same_v<scalar_t, float> && !kWidenPe;
#if defined(POSENC_F32_STREAMED_FROM_REGISTERS)
  constexpr bool kStreamsThroughChunk = false;
#else
  constexpr bool kStreamsThroughChunk = kStreams;
#endif
  alignas(64) opmath sum[kHalf || kStreamsThroughChunk ? kChunk : 1];
  opmath pe_chunk[kWidenPe ? kChunk : 1];
  bool by_instruction = false;  // bf16 sums rounded by AVX-512 BF16, a bf16 pe widened as it is read
#if defined(POSENC_BF16_BY_AVX512BF16)
  by_instruction = std::is_same_v<scalar_t, c10::BFloat16> && in != nullptr &&
                   (stores == RowStores::kBf16ByInstruction || bf16_streamed(stores));
#endif
  for (int64_t d0 = 0; d0 < width; d0 += kChunk) {
    const int64_t n = std::min(kChunk, width - d0);
    const int64_t with_pe = std::clamp<int64_t>(encoded - d0, 0, n);
    const opmath* __restrict e = nullptr;
    const auto widen_pe = [&] {
      if constexpr (kWidenPe) {
        widen(pe + d0, pe_chunk, with_pe);
        e = pe_chunk;
      }
    };
    if constexpr (!kWidenPe) e = pe + d0;
    if (!by_instruction) widen_pe();  // else only for the channels the instruction leaves
    for (int64_t r = 0; r < count; ++r) {
      scalar_t* __restrict y = out[r] + d0;
      if constexpr (kStreams) {
        if (streamed(stores)) {
          if (in == nullptr) {
            store_streaming(e, y, with_pe);
            continue;
          }
          const scalar_t* __restrict x = in[r] + d0;
#if defined(POSENC_F32_STREAMED_FROM_REGISTERS)
          add_f32_streamed(x, e, y, with_pe, scale);
          for (int64_t d = with_pe; d < n; ++d) y[d] = x[d] * scale;
#else
          for (int64_t d = 0; d < with_pe; ++d) sum[d] = x[d] * scale + e[d];
          for (int64_t d = with_pe; d < n; ++d) sum[d] = x[d] * scale;
          store_streaming(sum, y, n);
#endif
          continue;
        }
      }
      if (in == nullptr) {
        narrow(e, y, with_pe);
        continue;
      }
      const scalar_t* __restrict x = in[r] + d0;
      if constexpr (kHalf) {
        int64_t done = 0;
#if defined(POSENC_HAS_F16C)
        done = add_half_by_instruction(x, e, y, with_pe, scale, streamed(stores), reads_ahead(stores));
#endif
        for (int64_t d = done; d < with_pe; ++d) sum[d] = to_opmath(x[d]) * scale + e[d];
        for (int64_t d = with_pe; d < n; ++d) sum[d] = to_opmath(x[d]) * scale;
        narrow(sum + done, y + done, n - done);
      } else {
        int64_t done = 0;
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (bf16_streamed(stores) && reinterpret_cast<uintptr_t>(y) % 64 == 0) {
            done = add_bf16_vectors<true>(x, e, y, with_pe, scale, reads_ahead(stores));
          }
          done += add_bf16_vectors(x + done, e + done, y + done, with_pe - done, scale);
        }
#endif
#if defined(POSENC_BF16_BY_AVX512BF16)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (by_instruction) {
            done = add_bf16_by_instruction(x, pe + d0, y, with_pe, scale, bf16_streamed(stores), reads_ahead(stores));
            if (done == n) continue;
            if (e == nullptr) widen_pe();
          }
        }
#endif
        for (int64_t d = done; d < with_pe; ++d) y[d] = from_opmath<scalar_t>(to_opmath(x[d]) * scale + e[d]);
        for (int64_t d = with_pe; d < n; ++d) y[d] = from_opmath<scalar_t>(to_opmath(x[d]) * scale);
      }
    }
  }
}
#endif

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
