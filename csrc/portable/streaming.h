#pragma once
// Stores past the caches (non-temporal) for CPU kernels whose output is larger than the last-level cache: such
// an output leaves the cache before it is read, and an ordinary store first reads every line it writes. The
// same bits as ordinary stores; only where they go differs.
#include "portable/macros.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace posenc::portable {
inline namespace POSENC_KERNEL_NAMESPACE {

#if !defined(__CUDACC__)
// n values from src to dst with non-temporal stores (past the caches) where dst's vectors are whole; the
// unaligned ends with ordinary stores. The caller fences (store_fence) before its results are handed on.
template <typename T>
POSENC_INLINE void store_streaming(const T* src, T* dst, int64_t n) {
#if defined(__x86_64__) && defined(POSENC_CPU_CAPABILITY_INDEX)
  constexpr int64_t kVector = POSENC_CPU_CAPABILITY_INDEX == 2 ? 64 : POSENC_CPU_CAPABILITY_INDEX == 1 ? 32 : 16;
  const auto* s = reinterpret_cast<const char*>(src);
  auto* d = reinterpret_cast<char*>(dst);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  const int64_t head = std::min<int64_t>(bytes, (kVector - reinterpret_cast<uintptr_t>(d) % kVector) % kVector);
  std::memcpy(d, s, head);
  int64_t i = head;
  for (; i + kVector <= bytes; i += kVector) {
#if POSENC_CPU_CAPABILITY_INDEX == 2
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
#elif POSENC_CPU_CAPABILITY_INDEX == 1
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
#else
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
#endif
  }
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::copy(src, src + n, dst);
#endif
}

POSENC_INLINE void store_fence() {
#if defined(__x86_64__) && defined(POSENC_CPU_CAPABILITY_INDEX)
  _mm_sfence();
#endif
}

#endif

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
