#pragma once
// Position handling on real data: bounds checks and the float64 position vector every family reads.
#include "common/checks.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/arange.h>

namespace posenc {

// Positions as a contiguous float64 tensor, offset included; absent positions are offset + arange(seq_len).
inline at::Tensor positions_as_double(const std::optional<at::Tensor>& positions, int64_t seq_len, int64_t offset) {
  if (!positions.has_value()) {
    return at::arange(static_cast<double>(offset), static_cast<double>(offset + seq_len), 1.0,
                      at::TensorOptions().dtype(at::kDouble));
  }
  auto values = positions->to(at::kDouble).contiguous();
  return offset == 0 ? values : values.add(static_cast<double>(offset));
}

// Every index must lie in [0, limit): checked before any kernel reads with it.
inline void check_indices_in_range(const char* op, const char* arg, const at::Tensor& indices, int64_t limit,
                                   const char* limit_name) {
  const auto contiguous = indices.contiguous();
  AT_DISPATCH_INDEX_TYPES(contiguous.scalar_type(), "posenc_check_indices", [&] {
    const index_t* data = contiguous.const_data_ptr<index_t>();
    for (const auto n : c10::irange(contiguous.numel())) {
      TORCH_CHECK(data[n] >= 0 && data[n] < limit, "posenc.", op, ": ", arg, " holds ", data[n], " at flat index ",
                  n, ", outside [0, ", limit, ") of ", limit_name, " ", limit);
    }
  });
}

}  // namespace posenc
