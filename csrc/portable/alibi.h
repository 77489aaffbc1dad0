#pragma once
// ALiBi's bias: row (b, h, i) of a [B, H, Q, K] bias holds -m * d_j (causal) or -m * |d_j| (symmetric),
// d_j = i + (K - Q) - j (bottom-right aligned: the last query sits on the last key), m the head's slope.
// Distances are formed in the maths type: exact for every key index below 2^24 (float32 maths).
#include "portable/convert.h"

#include <cmath>
#include <cstdint>

namespace posenc::portable {
inline namespace POSENC_KERNEL_NAMESPACE {

POSENC_INLINE int64_t alibi_batch(const AlibiRows& rows, int64_t n) { return n / (rows.heads * rows.q_len); }
POSENC_INLINE int64_t alibi_head(const AlibiRows& rows, int64_t n) { return (n / rows.q_len) % rows.heads; }
POSENC_INLINE int64_t alibi_query(const AlibiRows& rows, int64_t n) { return n % rows.q_len; }

// Offset of row n's first element.
POSENC_INLINE int64_t alibi_row_offset(const AlibiRows& rows, int64_t n) {
  return alibi_batch(rows, n) * rows.stride_b + alibi_head(rows, n) * rows.stride_h +
         alibi_query(rows, n) * rows.stride_i;
}

// d_0 of row n: d_j = d_0 - j.
POSENC_INLINE int64_t alibi_distance0(const AlibiRows& rows, int64_t n) {
  return alibi_query(rows, n) + rows.k_len - rows.q_len;
}

template <AlibiMode kMode, typename T>
POSENC_INLINE T alibi_bias(T slope, T distance) {
  return -slope * (kMode == AlibiMode::Symmetric ? std::abs(distance) : distance);
}

#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
// The first keys of a contiguous bf16 row in the baseline and AVX2 builds (src null: the bias alone), two vectors a
// step through convert.h's widening and rounding by SSE2 or AVX2: the same distance, product, sum and rounding as
// alibi_row's loop, so the same bits. NaNs are looked for once a step and selected only where a step has one. The
// baseline's SSE2 form was 1.2-1.5x faster than GCC's vectorization of that loop there (in-process A/Bs, in cache and
// at [4, 16, 1024, 1024]); the AVX2 form, in-process A/B against GCC's loop, bf16, 2 threads: add_alibi 1.07x at
// [4, 16, 1024, 1024] (128 MiB each way), 1.21x in cache ([1, 16, 64, 256]); alibi_bias 1.16-1.22x. Returns the count
// done (a multiple of two vectors).
template <AlibiMode kMode>
inline int64_t alibi_row_bf16_vectors(const c10::BFloat16* src, c10::BFloat16* dst, int64_t k_len, float slope,
                                      float distance0, const float* key_pos) {
  using V = Bf16Vectors;
  const V::Floats minus_slope = V::splat(-slope);
  const V::Floats d0 = V::splat(distance0);
  const auto bias = [&](const float* keys) {
    const V::Floats d = d0 - V::load_floats(keys);
    return minus_slope * (kMode == AlibiMode::Symmetric ? V::abs(d) : d);
  };
  int64_t j = 0;
  for (; j < k_len - k_len % (2 * V::kLanes); j += 2 * V::kLanes) {
    V::Floats low = bias(key_pos + j), high = bias(key_pos + j + V::kLanes);
    if (src != nullptr) {
      low = V::widen(src + j) + low;
      high = V::widen(src + j + V::kLanes) + high;
    }
    V::store_narrowed<false>(dst + j, low, high);
  }
  return j;
}
#endif

#if defined(POSENC_HAS_F16C)
// The first keys of a contiguous fp16 row where the build has F16C (src null: the bias alone), eight a step, widened
// by vcvtph2ps and rounded by vcvtps2ph (to nearest even, as from_opmath rounds): the same distance, product, sum
// and rounding as alibi_row's loop, so the same bits. GCC's loop widened and rounded by to_opmath's and
// from_opmath's integer forms: fp16 add_alibi_ [4, 16, 1024, 1024] took 38.0 ms, 4.5x bf16's time; now 7.2 (Zen 2,
// 2 threads). Returns the count done (a multiple of eight).
template <AlibiMode kMode>
inline int64_t alibi_row_half_vectors(const c10::Half* src, c10::Half* dst, int64_t k_len, float slope,
                                      float distance0, const float* key_pos) {
  const __m256 minus_slope = _mm256_set1_ps(-slope);
  const __m256 d0 = _mm256_set1_ps(distance0);
  int64_t j = 0;
  for (; j + 8 <= k_len; j += 8) {
    __m256 d = _mm256_sub_ps(d0, _mm256_loadu_ps(key_pos + j));
    if constexpr (kMode == AlibiMode::Symmetric) d = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), d);
    __m256 v = _mm256_mul_ps(minus_slope, d);
    if (src != nullptr) v = _mm256_add_ps(widen_halfx8(src + j), v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  return j;
}
#endif

#if !defined(__CUDACC__)
// dst[j] = src[j] + bias_j over one row (src null: the bias alone). key_pos[j] = j in the maths type, so the
// loop is float arithmetic the compiler vectorizes; unit strides get their own loop. In place (add_alibi_)
// src and dst are the same row, so neither pointer is __restrict__.
template <AlibiMode kMode, typename scalar_t, typename opmath>
void alibi_row(const scalar_t* src, int64_t src_stride, scalar_t* dst, int64_t dst_stride, int64_t k_len,
               opmath slope, opmath distance0, const opmath* key_pos) {
  int64_t done = 0;
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (dst_stride == 1 && (src == nullptr || src_stride == 1)) {
      done = alibi_row_bf16_vectors<kMode>(src, dst, k_len, slope, distance0, key_pos);
    }
  }
#endif
#if defined(POSENC_HAS_F16C)
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    if (dst_stride == 1 && (src == nullptr || src_stride == 1)) {
      done = alibi_row_half_vectors<kMode>(src, dst, k_len, slope, distance0, key_pos);
    }
  }
#endif
  if (src == nullptr) {
    if (dst_stride == 1) {
      for (int64_t j = done; j < k_len; ++j) {
        dst[j] = from_opmath<scalar_t>(alibi_bias<kMode>(slope, distance0 - key_pos[j]));
      }
    } else {
      for (int64_t j = 0; j < k_len; ++j) {
        dst[j * dst_stride] = from_opmath<scalar_t>(alibi_bias<kMode>(slope, distance0 - key_pos[j]));
      }
    }
  } else if (src_stride == 1 && dst_stride == 1) {
    for (int64_t j = done; j < k_len; ++j) {
      dst[j] = from_opmath<scalar_t>(to_opmath(src[j]) + alibi_bias<kMode>(slope, distance0 - key_pos[j]));
    }
  } else {
    for (int64_t j = 0; j < k_len; ++j) {
      dst[j * dst_stride] =
          from_opmath<scalar_t>(to_opmath(src[j * src_stride]) + alibi_bias<kMode>(slope, distance0 - key_pos[j]));
    }
  }
}

// sum_j row[j] * d_j (|d_j| symmetric) in float64. Unit-stride rows are summed in kLanes interleaved partial
// sums (lane l takes j = l mod kLanes), added in lane order at the end: vector registers hold the lanes, and
// the order is fixed by k_len alone, whatever thread or capability sums the row.
template <AlibiMode kMode, typename scalar_t>
double alibi_row_gradient(const scalar_t* row, int64_t stride, int64_t k_len, double distance0, const double* key_pos) {
  constexpr int64_t kLanes = 16;
  auto weight = [&](int64_t j) {
    const double d = distance0 - key_pos[j];
    return kMode == AlibiMode::Symmetric ? std::abs(d) : d;
  };
  double lanes[kLanes] = {};
  int64_t j = 0;
  if (stride == 1) {
#if defined(POSENC_HAS_F16C)
    // fp16 widened 256 keys at a time by F16C (widen) rather than value by value by to_opmath's integer form: the
    // same values in the same lanes. Zen 2, 2 threads, alibi_backward [4, 16, 1024, 1024]: 17.6 -> 9.5 ms.
    if constexpr (std::is_same_v<scalar_t, c10::Half>) {
      constexpr int64_t kBlock = 256;
      float block[kBlock];
      for (; j + kBlock <= k_len; j += kBlock) {
        widen(row + j, block, kBlock);
        for (int64_t b = 0; b < kBlock; b += kLanes) {
          for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(block[b + l]) * weight(j + b + l);
        }
      }
    }
#endif
    for (; j + kLanes <= k_len; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(to_opmath(row[j + l])) * weight(j + l);
    }
  }
  double tail = 0;
  for (; j < k_len; ++j) tail += static_cast<double>(to_opmath(row[j * stride])) * weight(j);
  double sum = 0;
  for (const double lane : lanes) sum += lane;
  return sum + tail;
}
#endif

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
