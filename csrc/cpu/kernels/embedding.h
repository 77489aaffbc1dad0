#pragma once
// Kernel interface of embedding_backward (cpu/embedding.cpp -> cpu/kernels/embedding.cpp).
#include "cpu/dispatch.h"

#include <cstdint>

namespace posenc::cpu {

// out[r] = scale * sum of the gradient rows n with ids[n mod num_ids] == r (r != skip), [num_rows, width].
template <typename scalar_t>
struct EmbeddingBackwardProblem {
  const scalar_t* grad;  // [num_grad_rows, width], contiguous
  int64_t num_grad_rows;
  int64_t width;
  const int64_t* ids;  // every id in [0, num_rows)
  int64_t num_ids;
  int64_t num_rows;
  int64_t skip;  // the padding row (no gradient), or -1
  double scale;
  scalar_t* out;
};

template <typename scalar_t>
inline DispatchStub<void(const EmbeddingBackwardProblem<scalar_t>&)> embedding_backward_stub;

}  // namespace posenc::cpu
