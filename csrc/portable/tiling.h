#pragma once
// How the CPU kernels cut their work: grain sizes, position blocks that stay in L2, prefetches of gathered rows.
#include "portable/macros.h"

#include <algorithm>
#include <cstdint>

namespace posenc::portable {

// Elements per parallel task, as ATen's TensorIterator uses: below this, threading costs more than it saves.
constexpr int64_t kGrainSize = 32768;

// Rows of a per-position table (encodings, gathered table rows) that a task keeps hot while every leading
// index streams its rows past them: about 128 KiB, well inside L2, so that the table is read from memory
// (or computed) once per call rather than once per batch row, and each leading index reads a long
// contiguous run of its rows.
constexpr int64_t kBlockBytes = 128 * 1024;

// A page: the hardware prefetchers stop at its boundary, so every stream a loop keeps in flight starts each page
// with misses.
constexpr int64_t kPageBytes = 4096;

// The head of a row the loop will read next (a gathered table row: no hardware prefetcher can guess where it
// is) is requested one 64-byte line at a time, so that its first loads overlap the current row's work and the
// L2 streamer, which follows the loop into the row, fetches the rest. Requests for a whole row (32 to 64
// lines) fill the core's miss buffers and stall the current row's loads: measured 1.3-1.5x the copy bound for
// embed_learned, against 1.2-1.3x with 1 KiB.
constexpr int64_t kPrefetchBytes = 1024;

inline namespace POSENC_KERNEL_NAMESPACE {

inline int64_t rows_per_task(int64_t row_width) {
  return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(row_width, 1));
}

inline int64_t rows_per_block(int64_t row_bytes) {
  return std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(row_bytes, 1));
}

inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < std::min(bytes, kPrefetchBytes); b += 64) __builtin_prefetch(p + b);
}

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
