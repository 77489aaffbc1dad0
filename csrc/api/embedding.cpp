#include <posenc/embedding.h>

#include "common/find_op.h"

namespace posenc {

at::Tensor embedding_backward_symint(const at::Tensor& grad, const at::Tensor& indices, c10::SymInt num_rows,
                                     double scale, std::optional<int64_t> padding_idx) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, double,
                                            std::optional<int64_t>)>("posenc::embedding_backward");
  return op.call(grad, indices, std::move(num_rows), scale, padding_idx);
}

at::Tensor embedding_backward(const at::Tensor& grad, const at::Tensor& indices, int64_t num_rows, double scale,
                              std::optional<int64_t> padding_idx) {
  return embedding_backward_symint(grad, indices, c10::SymInt(num_rows), scale, padding_idx);
}

}  // namespace posenc
