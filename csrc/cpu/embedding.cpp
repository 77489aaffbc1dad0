// CPU op of embedding_backward: checks, allocation, dtype dispatch; the loop is in cpu/kernels/embedding.cpp.
#include "common/embedding.h"
#include "common/positions.h"
#include "cpu/kernels/embedding.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace posenc {
namespace {

at::Tensor embedding_backward_cpu(const at::Tensor& grad, const at::Tensor& indices, int64_t num_rows, double scale,
                                  std::optional<int64_t> padding_idx) {
  constexpr const char* op = "embedding_backward";
  check_embedding_backward(grad, indices, num_rows, padding_idx);
  check_indices_in_range(op, "indices", indices, num_rows, "num_rows");
  const int64_t width = grad.size(-1);
  auto out = at::empty({num_rows, width}, grad.options());
  if (out.numel() == 0) return out;
  const auto rows = grad.contiguous();
  const auto ids = indices.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_embedding_backward", [&] {
    cpu::embedding_backward_stub<scalar_t>({rows.const_data_ptr<scalar_t>(), rows.numel() / width, width,
                                            ids.const_data_ptr<int64_t>(), ids.numel(), num_rows,
                                            padding_idx.value_or(-1), scale, out.mutable_data_ptr<scalar_t>()});
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("embedding_backward", TORCH_FN(embedding_backward_cpu));
}

}  // namespace posenc
