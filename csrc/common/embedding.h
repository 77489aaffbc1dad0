#pragma once
// Checks of embedding_backward, shared by its CPU and Meta kernels.
#include "common/checks.h"

namespace posenc {

// grad is [..., D]; indices cover its leading shape or a suffix of it ([S] shared by every batch row).
inline void check_embedding_backward(const at::Tensor& grad, const at::Tensor& indices, const c10::SymInt& num_rows,
                                     std::optional<int64_t> padding_idx) {
  constexpr const char* op = "embedding_backward";
  check_floating(op, "grad", grad);
  check_index(op, "indices", indices);
  check_same_device(op, "indices", indices, grad);
  TORCH_CHECK(grad.dim() >= 1, "posenc.", op, ": grad must be [..., D], got a 0-d tensor");
  TORCH_CHECK(num_rows >= 0, "posenc.", op, ": num_rows must be non-negative, got ", num_rows);
  check_padding_idx(op, padding_idx, num_rows);
  const auto leading = grad.sym_sizes().slice(0, grad.dim() - 1);
  const auto index_shape = indices.sym_sizes();
  TORCH_CHECK(index_shape.size() <= leading.size() &&
                  index_shape.equals(leading.slice(leading.size() - index_shape.size())),
              "posenc.", op, ": indices has shape ", index_shape, " which does not end grad's leading shape ", leading);
}

}  // namespace posenc
