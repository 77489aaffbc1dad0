#pragma once
// The angle engine on the GPU, choosing per position as the CPU's sincos_row does: for float32 maths, a
// position whose angles all lie within kFastAngle (|p| * max_i |inv_freq[i]| <= kFastAngle) takes the shared
// quarter-turn reduction (kernels/angle.h), any other the float64 sin and cos of the angle; float64 maths
// always takes float64 sin and cos. The fast path gives the CPU's bits; float64 sin/cos (CUDA's, within 2 ulp
// in float64) round to the CPU's float32 result but for rare ties, and are not bitwise float64 results.
#include "kernels/angle.h"

#include <type_traits>

namespace posenc::cuda {

// This thread's share of max |inv_freq[i]| over i = threadIdx.x, + blockDim.x, ... (NaN skipped, as the CPU's
// Frequencies skips it; 0 for a thread with no frequency).
__device__ __forceinline__ double max_frequency(const double* inv_freq, int64_t n) {
  double local = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double w = fabs(inv_freq[i]);
    local = local < w ? w : local;
  }
  return local;
}

// Whether a position takes float64 sin/cos: decided by the whole block from every thread's share of the
// frequencies, so every thread of the block must call it. The comparison is the CPU's (a NaN product is slow).
template <typename opmath>
__device__ __forceinline__ bool slow_angles(double position, double local_max) {
  if constexpr (std::is_same_v<opmath, float>) {
    return __syncthreads_or(!(fabs(position) * local_max <= kernels::kFastAngle));
  } else {
    return true;
  }
}

template <typename opmath>
__device__ __forceinline__ void angle_sincos(double angle, bool slow, opmath& sin_out, opmath& cos_out) {
  if constexpr (std::is_same_v<opmath, float>) {
    if (slow) {
      sin_out = static_cast<float>(sin(angle));
      cos_out = static_cast<float>(cos(angle));
    } else {
      kernels::sincos_reduced(angle, sin_out, cos_out);
    }
  } else {
    sin_out = sin(angle);
    cos_out = cos(angle);
  }
}

}  // namespace posenc::cuda
