#pragma once
// Kernel interface of ALiBi (cpu/alibi.cpp -> cpu/kernels/alibi.cpp).
#include "cpu/dispatch.h"
#include "portable/types.h"

namespace posenc::cpu {

// Every row of out (geometry out_rows) = in + bias, in read through in_rows (in null: the bias alone).
template <typename scalar_t>
struct AlibiProblem {
  const scalar_t* in;
  AlibiRows in_rows;
  scalar_t* out;
  AlibiRows out_rows;
  int64_t num_rows;
  const opmath_t<scalar_t>* slopes;  // [B or 1][out_rows.heads]: the call's heads, in maths precision
  bool per_batch;
  AlibiMode mode;
};

// slope_grad[(per_batch ? b * total_heads : 0) + head_offset + h] -= sum over row (b, h, i) of grad * d
// (|d| symmetric), in float64: rows summed in parallel, then added in row order.
template <typename scalar_t>
struct AlibiBackwardProblem {
  const scalar_t* grad;
  AlibiRows rows;
  int64_t num_rows;
  AlibiMode mode;
  bool per_batch;
  int64_t total_heads;
  int64_t head_offset;
  double* slope_grad;  // zero-initialized, [B or 1, total_heads]
};

template <typename scalar_t>
inline DispatchStub<void(const AlibiProblem<scalar_t>&)> alibi_stub;
template <typename scalar_t>
inline DispatchStub<void(const AlibiBackwardProblem<scalar_t>&)> alibi_backward_stub;

}  // namespace posenc::cpu
