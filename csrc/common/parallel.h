#pragma once
#include <algorithm>
#include <cstdint>

namespace posenc {

// Elements per parallel task, as ATen's TensorIterator uses: below this, threading costs more than it saves.
constexpr int64_t kGrainSize = 32768;

inline int64_t rows_per_task(int64_t row_width) {
  return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(row_width, 1));
}

}  // namespace posenc
