#pragma once
// The checks that read index data (positions and their offset, token ids, cu_seqlens, pair_axis, cache slots) for
// the CUDA ops, and the device arrays of positions the kernels read.
//
// The CPU reads index tensors on the host and raises before any kernel runs. On the GPU the values live in device
// memory and the host never reads them: each check is a small kernel over the index tensor (the offset added, the
// range checked, the first bad element kept), followed by a report into the device's failure record (checks.cuh),
// raised later with the CPU's words. Positions left out (offset + arange) need no data: their two ends are checked
// on the host. Until a failure is raised, the kernels stay in bounds by themselves: an out-of-range table row or
// token id gives a NaN row, positions from bad cu_seqlens stay inside the packed tokens, a cache slot out of range
// is not stored.
#include "common/positions.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>

namespace posenc::cuda {

// Positions plus offset as float64 on x's device, for the angle engine ([count] for absent positions with
// cu_seqlens, else as many as positions holds), or an undefined tensor where positions and cu_seqlens are both
// absent: the kernels then use offset + s, whose range is checked here on the host. cu_seqlens, when given, is
// checked as the CPU checks it (its values must describe `count` tokens), whether or not positions are given.
// Every check runs on the device (see above).
// `domain`: angle_domain(), or rotary_domain() where NaN and infinite positions are refused.
at::Tensor angle_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count, int64_t offset,
                           const std::optional<at::Tensor>& cu_seqlens = std::nullopt,
                           const PositionDomain& domain = angle_domain());

// Positions as the angle kernels read them, the CPU's read_axis_positions on the device: cu_seqlens (when given),
// pair_axis (when given: int32, each checked against the n_axes = positions.size(0) axes of positions) and the
// positions (angle_positions), checked in the CPU's order; multi-axis positions reordered token by token, so that a
// token's n_axes positions lie side by side.
struct DeviceAxisPositions {
  at::Tensor values;     // float64, or undefined for offset + arange
  int64_t n_axes = 1;
  at::Tensor pair_axis;  // int32 [pairs], or undefined: one axis
};
DeviceAxisPositions axis_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                   int64_t offset, const PositionDomain& domain,
                                   const std::optional<at::Tensor>& pair_axis,
                                   const std::optional<at::Tensor>& cu_seqlens = std::nullopt);

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

// indices + offset as out_type (int32, int64 or float64) on their device, each sum that overflows or leaves [lo, hi]
// a failure: the first one raises error(flat index, value).
at::Tensor checked_indices(const at::Tensor& indices, int64_t offset, int64_t lo, int64_t hi, at::ScalarType out_type,
                           std::function<void(int64_t n, int64_t value)> error);

// cu_seqlens must start at 0, never decrease and end at `tokens` (check_cu_seqlens_values' errors).
void check_device_cu_seqlens(const char* op, const at::Tensor& cu_seqlens, int64_t tokens);

// Each packed token's index in its sequence plus offset ([count], out_type float64 or int64), checked against
// `domain` as read_positions checks them; cu_seqlens itself is not checked here.
at::Tensor packed_positions(const char* op, const at::Tensor& cu_seqlens, int64_t count, int64_t offset,
                            const PositionDomain& domain, at::ScalarType out_type);

// pair_axis as int32 on its device, each value checked to lie in [0, n_axes) (read_pair_axis' error).
at::Tensor device_pair_axis(const char* op, const at::Tensor& pair_axis, int64_t n_axes);

}  // namespace posenc::cuda
