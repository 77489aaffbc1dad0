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

// out [leads, prefix + H * W, width] = in + the table resampled (ResampleProblem's out, rounded to scalar_t), each
// sum rounded once: add_learned of the resampled table, its rows formed block by block as the input streams past.
template <typename scalar_t>
struct AddResampledProblem {
  const scalar_t* in;     // contiguous
  scalar_t* out;          // contiguous
  int64_t rows;           // leads * (prefix + H * W)
  const scalar_t* table;  // contiguous [prefix + Hs * Ws, width]
  int64_t width;
  ResampleGrid grid;
};

template <typename scalar_t>
inline DispatchStub<void(const ResampleProblem<scalar_t>&)> resample_stub;
template <typename scalar_t>
inline DispatchStub<void(const AddResampledProblem<scalar_t>&)> add_resampled_stub;
template <typename scalar_t>
inline DispatchStub<void(const ResampleAdjointProblem<scalar_t>&)> resample_adjoint_stub;

}  // namespace posenc::cpu
