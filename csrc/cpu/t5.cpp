// CPU ops of the T5 relative bias: checks, allocation, dtype dispatch; the loops are in cpu/kernels/t5.cpp.
#include "common/t5.h"
#include "cpu/kernels/t5.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

namespace posenc {
namespace {

// Relative positions j - i - q_offset must not overflow int64 (the sizes are far below 2^62).
void check_q_offset(const char* op, int64_t q_offset) {
  constexpr int64_t limit = int64_t{1} << 62;
  TORCH_CHECK(q_offset >= -limit && q_offset <= limit, "posenc.", op, ": q_offset ", q_offset,
              " is outside [-2^62, 2^62]");
}

at::Tensor relative_position_bucket_cpu(const at::Tensor& relative_position, bool bidirectional, int64_t num_buckets,
                                        int64_t max_distance) {
  check_relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance);
  const auto input = relative_position.contiguous();
  auto out = at::empty(input.sizes(), input.options().dtype(at::kLong));
  AT_DISPATCH_INDEX_TYPES(input.scalar_type(), "posenc_relative_position_bucket", [&] {
    cpu::relative_bucket_stub<index_t>({{bidirectional, num_buckets, max_distance}, input.const_data_ptr<index_t>(),
                                        out.mutable_data_ptr<int64_t>(), input.numel()});
  });
  return out;
}

at::Tensor t5_bias_cpu(const at::Tensor& weight, int64_t q_len, int64_t k_len, bool bidirectional,
                       int64_t num_buckets, int64_t max_distance, int64_t q_offset) {
  check_t5_bias(weight, q_len, k_len, bidirectional, num_buckets, max_distance);
  check_q_offset("t5_bias", q_offset);
  auto out = at::empty({1, weight.size(1), q_len, k_len}, weight.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_t5_bias", [&] {
    cpu::t5_bias_stub<scalar_t>({{bidirectional, num_buckets, max_distance}, weight.const_data_ptr<scalar_t>(),
                                 weight.stride(0), weight.stride(1), weight.size(1), q_len, k_len, q_offset,
                                 out.mutable_data_ptr<scalar_t>()});
  });
  return out;
}

// grad [1, H, Q, K] -> [num_buckets, H], summed in float64 in a fixed order.
at::Tensor t5_bias_backward_cpu(const at::Tensor& grad, bool bidirectional, int64_t num_buckets, int64_t max_distance,
                                int64_t q_offset) {
  check_t5_bias_backward(grad, bidirectional, num_buckets, max_distance);
  check_q_offset("t5_bias_backward", q_offset);
  auto acc = at::zeros({grad.size(1), num_buckets}, grad.options().dtype(at::kDouble));
  if (grad.numel() > 0) {
    const auto rows = grad.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_t5_bias_backward", [&] {
      cpu::t5_bias_backward_stub<scalar_t>({{bidirectional, num_buckets, max_distance}, rows.const_data_ptr<scalar_t>(),
                                            grad.size(1), grad.size(2), grad.size(3), q_offset,
                                            acc.mutable_data_ptr<double>()});
    });
  }
  return acc.t().contiguous().to(grad.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("relative_position_bucket", TORCH_FN(relative_position_bucket_cpu));
  m.impl("t5_bias", TORCH_FN(t5_bias_cpu));
  m.impl("t5_bias_backward", TORCH_FN(t5_bias_backward_cpu));
}

}  // namespace posenc
