#pragma once
// The checks that read index data (positions and their offset, token ids, cu_seqlens) for the CUDA ops, and
// the device arrays of positions the kernels read.
//
// The CPU reads index tensors on the host and raises before any kernel runs. On the GPU the values live in
// device memory, so each call that is given an index tensor runs one small kernel over it (the offset added,
// the range checked, the first bad flat index kept with an atomic minimum) and reads an 8-byte flag back: one
// synchronization of the stream per call, none for positions left out (offset + arange, checked on the host
// from its two ends). When the flag is set, the index tensor is copied to the host and the CPU's own check
// runs on it, so the error message is the CPU's, word for word. Small tensors that the host needs anyway
// (cu_seqlens) are copied and checked there.
//
// While the stream is captured into a CUDA graph nothing can be read back: the checks are skipped, and the
// kernels stay in bounds by themselves (an out-of-range table row or token id gives a NaN row, positions
// from an unchecked cu_seqlens stay inside the packed tokens).
#include "common/positions.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace posenc::cuda {

// Positions plus offset as float64 on x's device, for the angle engine ([count] for absent positions with
// cu_seqlens, else as many as positions holds), or an undefined tensor where positions and cu_seqlens are both
// absent: the kernels then use offset + s, whose range is checked here on the host. cu_seqlens, when given, is
// checked as the CPU checks it (its values must describe `count` tokens), whether or not positions are given.
// `domain`: angle_domain(), or rotary_domain() where NaN and infinite positions are refused.
at::Tensor angle_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count, int64_t offset,
                           const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
                           const PositionDomain& domain = angle_domain());

// Table rows (positions plus offset, int64, each checked against `domain`) on the device, or an undefined tensor
// for absent positions (offset + s, checked on the host).
at::Tensor table_rows(const char* op, const std::optional<at::Tensor>& positions, int64_t count, int64_t offset,
                      const PositionDomain& domain);

// Positions as the additive kernels read them: values on the device (float64 angles or int64 table rows), or
// undefined values for offset + arange(count); count is how many there are.
struct DevicePositions {
  DevicePositions(at::Tensor values, int64_t absent_count, int64_t offset)
      : values(std::move(values)), count(this->values.defined() ? this->values.numel() : absent_count),
        offset(offset) {}

  at::Tensor values;
  int64_t count;
  int64_t offset;
};

// Every index (on the device) must lie in [0, limit); a bad one raises the error of the host's
// check_indices_in_range.
void check_device_indices_in_range(const char* op, const char* arg, const at::Tensor& indices, int64_t limit,
                                   const char* limit_name);

}  // namespace posenc::cuda
