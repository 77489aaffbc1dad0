// embedding_backward on the CPU: the kernel called under the op layer of common/embedding.h; the loop is in
// cpu/kernels/embedding.cpp.
#include "common/embedding.h"
#include "common/positions.h"
#include "cpu/device.h"
#include "cpu/kernels/embedding.h"

#include <torch/library.h>

namespace posenc {
namespace {

struct CpuEmbedding : CpuDevice {

  static constexpr auto check_indices = &check_indices_in_range;

  template <typename scalar_t>
  static void sum_rows(const at::Tensor& grad, const at::Tensor& ids, int64_t skip, double scale,
                       const at::Tensor& out) {
    const int64_t width = grad.size(-1);
    cpu::embedding_backward_stub<scalar_t>({grad.const_data_ptr<scalar_t>(), grad.numel() / width, width,
                                            ids.const_data_ptr<int64_t>(), ids.numel(), out.size(0), skip, scale,
                                            out.mutable_data_ptr<scalar_t>()});
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  EmbeddingOps<CpuEmbedding>::register_kernels(m);
}

}  // namespace posenc
