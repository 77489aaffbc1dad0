#pragma once
// Checks of the T5 relative bias, shared by its CPU and Meta kernels.
#include "common/checks.h"

namespace posenc {

// T5 splits num_buckets into N' = num_buckets / 2 per direction (bidirectional) or N' = num_buckets
// (causal); the first e = N' / 2 buckets hold exact distances, the rest log-spaced ones up to max_distance.
// e must be at least 1 and max_distance above e, or T5's formula divides by log(max_distance / e) <= 0.
inline void check_t5_buckets(const char* op, bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  TORCH_CHECK(num_buckets > 0, "posenc.", op, ": num_buckets must be positive, got ", num_buckets);
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

}  // namespace posenc
