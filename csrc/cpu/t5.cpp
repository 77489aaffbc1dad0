// The T5 relative bias on the CPU: the kernels called under the op layer of common/t5.h; the loops are in
// cpu/kernels/t5.cpp.
#include "common/t5.h"
#include "cpu/device.h"
#include "cpu/kernels/t5.h"

#include <torch/library.h>

namespace posenc {
namespace {

struct CpuT5 : CpuDevice {

  template <typename index_t>
  static void bucket(const at::Tensor& input, const at::Tensor& out, bool bidirectional, int64_t num_buckets,
                     int64_t max_distance) {
    cpu::relative_bucket_stub<index_t>({{bidirectional, num_buckets, max_distance}, input.const_data_ptr<index_t>(),
                                        out.mutable_data_ptr<int64_t>(), input.numel()});
  }

  template <typename scalar_t>
  static void bias(const at::Tensor& weight, const at::Tensor& out, bool bidirectional, int64_t num_buckets,
                   int64_t max_distance, int64_t q_offset) {
    cpu::t5_bias_stub<scalar_t>({{bidirectional, num_buckets, max_distance}, weight.const_data_ptr<scalar_t>(),
                                 weight.stride(0), weight.stride(1), weight.size(1), out.size(2), out.size(3),
                                 q_offset, out.mutable_data_ptr<scalar_t>()});
  }

  template <typename scalar_t>
  static void bias_grad(const at::Tensor& grad, const at::Tensor& acc, bool bidirectional, int64_t num_buckets,
                        int64_t max_distance, int64_t q_offset) {
    cpu::t5_bias_backward_stub<scalar_t>({{bidirectional, num_buckets, max_distance}, grad.const_data_ptr<scalar_t>(),
                                          grad.size(1), grad.size(2), grad.size(3), q_offset,
                                          acc.mutable_data_ptr<double>()});
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  T5Ops<CpuT5>::register_kernels(m);
}

}  // namespace posenc
