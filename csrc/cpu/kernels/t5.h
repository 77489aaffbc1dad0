#pragma once
// Kernel interface of the T5 relative bias (cpu/t5.cpp -> cpu/kernels/t5.cpp).
#include "cpu/dispatch.h"

#include <cstdint>

namespace posenc::cpu {

struct T5BucketParams {
  bool bidirectional;
  int64_t num_buckets;
  int64_t max_distance;
};

// out[n] = bucket(relative_position[n]).
template <typename index_t>
struct RelativeBucketProblem {
  T5BucketParams params;
  const index_t* relative_position;
  int64_t* out;
  int64_t numel;
};

// out[0, h, i, j] = weight[bucket(j - i - q_offset), h] for weight [num_buckets, heads] (any strides).
template <typename scalar_t>
struct T5BiasProblem {
  T5BucketParams params;
  const scalar_t* weight;
  int64_t weight_stride_bucket;
  int64_t weight_stride_head;
  int64_t heads;
  int64_t q_len;
  int64_t k_len;
  int64_t q_offset;
  scalar_t* out;  // [1, heads, q_len, k_len], contiguous
};

// grad_weight[h][bucket] (float64, [heads, num_buckets], zero-initialized) = sum of grad over the (i, j) of each bucket.
template <typename scalar_t>
struct T5BiasBackwardProblem {
  T5BucketParams params;
  const scalar_t* grad;  // [1, heads, q_len, k_len], contiguous
  int64_t heads;
  int64_t q_len;
  int64_t k_len;
  int64_t q_offset;
  double* grad_weight;
};

template <typename index_t>
inline DispatchStub<void(const RelativeBucketProblem<index_t>&)> relative_bucket_stub;
template <typename scalar_t>
inline DispatchStub<void(const T5BiasProblem<scalar_t>&)> t5_bias_stub;
template <typename scalar_t>
inline DispatchStub<void(const T5BiasBackwardProblem<scalar_t>&)> t5_bias_backward_stub;

}  // namespace posenc::cpu
