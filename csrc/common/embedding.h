#pragma once
// Checks of embedding_backward, shared by its CPU, CUDA and Meta kernels, and its op layer, shared by the CPU and
// CUDA kernels.
#include "common/checks.h"
#include "families.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

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

// embedding_backward on one device: checks, allocation and dtype dispatch, the same on every device. The device
// supplies the rest:
//   Guard, empty            CpuDevice or CudaDevice: the guard that makes a device current for the call
//                           (nothing to do on the CPU), and empty(sizes, options), a contiguous output;
//   check_indices(op, arg, indices, limit, limit_name)
//                           every index in [0, limit), with the CPU's message;
//   sum_rows<scalar_t>(grad, ids, skip, scale, out)
//                           out[r] = scale * (the sum of the rows of grad [rows, D] whose id (ids repeated over the
//                           leading indices) is r, in row order), zero for row `skip` and rows with none.
template <typename Device>
struct EmbeddingOps {
  static at::Tensor embedding_backward(const at::Tensor& grad, const at::Tensor& indices, int64_t num_rows,
                                       double scale, std::optional<int64_t> padding_idx) {
    constexpr const char* op = "embedding_backward";
    check_embedding_backward(grad, indices, num_rows, padding_idx);
    const typename Device::Guard guard(grad.device());
    Device::check_indices(op, "indices", indices, num_rows, "num_rows");
    const int64_t width = grad.size(-1);
    auto out = Device::empty({num_rows, width}, grad.options());
    if (out.numel() == 0) return out;
    const auto rows = grad.contiguous();
    const auto ids = indices.to(at::kLong).contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_embedding_backward", [&] {
      Device::template sum_rows<scalar_t>(rows, ids, padding_idx.value_or(-1), scale, out);
    });
    return out;
  }

  static void register_kernels(torch::Library& m) {
    POSENC_EMBEDDING_OPS(POSENC_IMPL_MEMBER, EmbeddingOps)
  }
};

}  // namespace posenc
