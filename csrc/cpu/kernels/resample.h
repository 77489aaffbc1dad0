#pragma once
// Kernel interface of resample_learned and its adjoint (cpu/learned.cpp -> cpu/kernels/resample.cpp).
#include "cpu/dispatch.h"
#include "portable/types.h"

#include <cstdint>

namespace posenc::cpu {

// out [prefix + H * W, width] = table [prefix + Hs * Ws, width] resampled (portable/resample.h), in float64,
// rounded once.
template <typename scalar_t>
struct ResampleProblem {
  const scalar_t* table;  // contiguous
  scalar_t* out;          // contiguous
  int64_t width;
  ResampleGrid grid;
};

// out [prefix + Hs * Ws, width] = the adjoint of the resampling applied to the sum of grad's `leads` blocks of
// [prefix + H * W, width] rows (summed in block order), in float64, rounded once.
template <typename scalar_t>
struct ResampleAdjointProblem {
  const scalar_t* grad;  // contiguous [leads, prefix + H * W, width]
  int64_t leads;
  scalar_t* out;  // contiguous
  int64_t width;
  ResampleGrid grid;
};

template <typename scalar_t>
inline DispatchStub<void(const ResampleProblem<scalar_t>&)> resample_stub;
template <typename scalar_t>
inline DispatchStub<void(const ResampleAdjointProblem<scalar_t>&)> resample_adjoint_stub;

}  // namespace posenc::cpu
