#pragma once
// The angle engine on the GPU, choosing per token as the CPU's sincos_row (sincos_row_axes) does: for float32
// maths, a token whose angles all lie within kFastAngle (|p| * max_i |inv_freq[i]| <= kFastAngle for each of
// its positions) takes the shared quarter-turn reduction (portable/angle.h), any other posenc's own sin and cos
// of the angle (portable/libm.h); float64 maths always takes those. Both are the CPU's code compiled for the
// device, without contraction into FMA: the CPU's bits on either path, in float32 and in float64.
#include "portable/angle.h"

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

// Whether a token takes float64 sin/cos: decided by the whole block from every thread's share of the
// frequencies, so every thread of the block must call it. `positions` holds the token's n_axes positions (one
// without pair_axis); as the CPU's sincos_row_axes, the token is fast only when every one of them is. The
// comparison is the CPU's (a NaN product is slow).
template <typename opmath>
__device__ __forceinline__ bool slow_angles(const double* positions, int64_t n_axes, double local_max) {
  if constexpr (std::is_same_v<opmath, float>) {
    bool slow = false;
    for (int64_t a = 0; a < n_axes; ++a) slow = slow || !(fabs(positions[a]) * local_max <= portable::kFastAngle);
    return __syncthreads_or(slow);
  } else {
    return true;
  }
}

// One position (sinusoidal encodings, one-axis rotary).
template <typename opmath>
__device__ __forceinline__ bool slow_angles(double position, double local_max) {
  return slow_angles<opmath>(&position, 1, local_max);
}

template <typename opmath>
__device__ __forceinline__ void angle_sincos(double angle, bool slow, opmath& sin_out, opmath& cos_out) {
  if constexpr (std::is_same_v<opmath, float>) {
    if (!slow) {
      portable::sincos_reduced(angle, sin_out, cos_out);
      return;
    }
  }
  portable::sincos_exact(angle, sin_out, cos_out);
}

}  // namespace posenc::cuda
