#pragma once
#include <posenc/find_op.h>

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>

namespace posenc {

// Sum of the rows of grad [..., D] into a [num_rows, D] table at `indices` (grad's leading shape or a
// suffix of it), times `scale`; the padding_idx row stays zero. Deterministic for any thread count. The row count
// is symbolic for callers inside traced graphs (the autograd kernels); embedding_backward takes an integer.
inline at::Tensor embedding_backward_symint(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_rows,
                                            double scale = 1.0, std::optional<int64_t> padding_idx = std::nullopt) {
  static const auto op = detail::find_op<decltype(embedding_backward_symint)>("posenc::embedding_backward");
  return op.call(grad, indices, std::move(num_rows), scale, padding_idx);
}

inline at::Tensor embedding_backward(const at::Tensor& grad, const at::Tensor& indices, int64_t num_rows,
                                     double scale = 1.0, std::optional<int64_t> padding_idx = std::nullopt) {
  return embedding_backward_symint(grad, indices, c10::SymInt(num_rows), scale, padding_idx);
}

}  // namespace posenc
