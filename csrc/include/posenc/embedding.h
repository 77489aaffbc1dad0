#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

namespace posenc {

// Sum of the rows of grad [..., D] into a [num_rows, D] table at `indices` (grad's leading shape or a
// suffix of it), times `scale`; the padding_idx row stays zero. Deterministic for any thread count.
at::Tensor embedding_backward(const at::Tensor& grad, const at::Tensor& indices, int64_t num_rows, double scale = 1.0,
                              std::optional<int64_t> padding_idx = std::nullopt);

// The same with a symbolic row count, for callers inside traced graphs (the autograd kernels).
at::Tensor embedding_backward_symint(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_rows,
                                     double scale = 1.0, std::optional<int64_t> padding_idx = std::nullopt);

}  // namespace posenc
