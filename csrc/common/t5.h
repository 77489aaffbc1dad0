#pragma once
// Checks of the T5 relative bias, shared by its CPU, CUDA and Meta kernels, and its op layer, shared by the CPU
// and CUDA kernels.
#include "common/checks.h"
#include "families.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

namespace posenc {

// T5 splits num_buckets into N' = num_buckets / 2 per direction (bidirectional) or N' = num_buckets
// (causal); the first e = N' / 2 buckets hold exact distances, the rest log-spaced ones up to max_distance.
// e must be at least 1 and max_distance above e, or T5's formula divides by log(max_distance / e) <= 0. The
// log-spaced buckets' edges are tabulated once per bucketing (portable/t5.h), N' - e of them: kMaxT5Buckets keeps
// that to a few milliseconds (T5's models use 32 buckets; 2^31 took hours and gigabytes).
constexpr int64_t kMaxT5Buckets = 65536;

inline void check_t5_buckets(const char* op, bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  TORCH_CHECK(num_buckets > 0, "posenc.", op, ": num_buckets must be positive, got ", num_buckets);
  TORCH_CHECK(num_buckets <= kMaxT5Buckets, "posenc.", op, ": num_buckets must be at most ", kMaxT5Buckets, ", got ",
              num_buckets);
  TORCH_CHECK(max_distance > 0, "posenc.", op, ": max_distance must be positive, got ", max_distance);
  const int64_t exact = (bidirectional ? num_buckets / 2 : num_buckets) / 2;
  TORCH_CHECK(exact >= 1, "posenc.", op, ": num_buckets ", num_buckets, " is too few; ",
              bidirectional ? "bidirectional" : "causal", " buckets need at least ", bidirectional ? 4 : 2);
  TORCH_CHECK(max_distance > exact, "posenc.", op, ": max_distance ", max_distance, " must exceed the ", exact,
              " exact buckets of num_buckets ", num_buckets, bidirectional ? " (bidirectional)" : " (causal)");
}

inline void check_relative_position_bucket(const at::Tensor& relative_position, bool bidirectional,
                                           int64_t num_buckets, int64_t max_distance) {
  constexpr const char* op = "relative_position_bucket";
  check_index(op, "relative_position", relative_position);
  check_t5_buckets(op, bidirectional, num_buckets, max_distance);
}

inline void check_t5_bias(const at::Tensor& weight, const c10::SymInt& q_len, const c10::SymInt& k_len,
                          bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  constexpr const char* op = "t5_bias";
  check_floating(op, "weight", weight);
  TORCH_CHECK(weight.dim() == 2, "posenc.", op, ": weight must be [num_buckets, H], got shape ", weight.sym_sizes());
  check_t5_buckets(op, bidirectional, num_buckets, max_distance);
  TORCH_CHECK(weight.sym_size(0) == num_buckets, "posenc.", op, ": weight has ", weight.sym_size(0),
              " rows but num_buckets is ", num_buckets);
  TORCH_CHECK(q_len >= 0, "posenc.", op, ": q_len must be non-negative, got ", q_len);
  TORCH_CHECK(k_len >= 0, "posenc.", op, ": k_len must be non-negative, got ", k_len);
}

inline void check_t5_bias_backward(const at::Tensor& grad, bool bidirectional, int64_t num_buckets,
                                   int64_t max_distance) {
  constexpr const char* op = "t5_bias_backward";
  check_floating(op, "grad", grad);
  TORCH_CHECK(grad.dim() == 4 && grad.sym_size(0) == 1, "posenc.", op, ": grad must be [1, H, Q, K], got shape ",
              grad.sym_sizes());
  check_t5_buckets(op, bidirectional, num_buckets, max_distance);
}

// Relative positions j - i - q_offset must not overflow int64 (the sizes are far below 2^62).
inline void check_q_offset(const char* op, int64_t q_offset) {
  constexpr int64_t limit = int64_t{1} << 62;
  TORCH_CHECK(q_offset >= -limit && q_offset <= limit, "posenc.", op, ": q_offset ", q_offset,
              " is outside [-2^62, 2^62]");
}

// The ops of the T5 relative bias on one device: checks, allocation and dtype dispatch, the same on every
// device. The device supplies the rest, each given T5's bidirectional, num_buckets and max_distance:
//   Guard, empty            CpuDevice or CudaDevice: the guard that makes a device current for the call
//                           (nothing to do on the CPU), and empty(sizes, options), a contiguous output;
//   bucket<index_t>(relative_position, out, ...)
//                           out[n] = the bucket of relative_position[n] (contiguous, not empty);
//   bias<scalar_t>(weight, out, ..., q_offset)
//                           out [1, H, Q, K] = weight[bucket(j - i - q_offset), h];
//   bias_grad<scalar_t>(grad, acc, ..., q_offset)
//                           acc [H, num_buckets] (float64, zeros) = the sums of grad (contiguous) per bucket, in
//                           the CPU's order.
template <typename Device>
struct T5Ops {
  static at::Tensor relative_position_bucket(const at::Tensor& relative_position, bool bidirectional,
                                             int64_t num_buckets, int64_t max_distance) {
    check_relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance);
    const typename Device::Guard guard(relative_position.device());
    const auto input = relative_position.contiguous();
    auto out = Device::empty(input.sizes(), input.options().dtype(at::kLong));
    if (out.numel() == 0) return out;
    AT_DISPATCH_INDEX_TYPES(input.scalar_type(), "posenc_relative_position_bucket", [&] {
      Device::template bucket<index_t>(input, out, bidirectional, num_buckets, max_distance);
    });
    return out;
  }

  static at::Tensor t5_bias(const at::Tensor& weight, int64_t q_len, int64_t k_len, bool bidirectional,
                            int64_t num_buckets, int64_t max_distance, int64_t q_offset) {
    check_t5_bias(weight, q_len, k_len, bidirectional, num_buckets, max_distance);
    check_q_offset("t5_bias", q_offset);
    auto out = Device::empty({1, weight.size(1), q_len, k_len}, weight.options());
    if (out.numel() == 0) return out;
    const typename Device::Guard guard(weight.device());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_t5_bias", [&] {
      Device::template bias<scalar_t>(weight, out, bidirectional, num_buckets, max_distance, q_offset);
    });
    return out;
  }

  // grad [1, H, Q, K] -> [num_buckets, H], summed in float64 in a fixed order.
  static at::Tensor t5_bias_backward(const at::Tensor& grad, bool bidirectional, int64_t num_buckets,
                                     int64_t max_distance, int64_t q_offset) {
    check_t5_bias_backward(grad, bidirectional, num_buckets, max_distance);
    check_q_offset("t5_bias_backward", q_offset);
    auto acc = at::zeros({grad.size(1), num_buckets}, grad.options().dtype(at::kDouble));
    if (grad.numel() > 0) {
      const typename Device::Guard guard(grad.device());
      const auto rows = grad.contiguous();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_t5_bias_backward", [&] {
        Device::template bias_grad<scalar_t>(rows, acc, bidirectional, num_buckets, max_distance, q_offset);
      });
    }
    return acc.t().contiguous().to(grad.scalar_type());
  }

  static void register_kernels(torch::Library& m) {
    POSENC_T5_OPS(POSENC_IMPL_MEMBER, T5Ops)
  }
};

}  // namespace posenc
