#pragma once
// T5's relative-position bucketing (Mesh TensorFlow, Hugging Face `_relative_position_bucket`), with its
// float32 steps kept as they are: bucket edges land where T5's rounding puts them, not where exact maths would.
#include "kernels/macros.h"

#include <cmath>
#include <cstdint>

namespace posenc::kernels {

// T5 splits num_buckets into N' = num_buckets / 2 per direction (bidirectional) or N' = num_buckets (causal);
// the first e = N' / 2 buckets hold exact distances, the rest log-spaced ones up to max_distance.
struct T5Buckets {
  bool bidirectional;
  int64_t per_direction;
  int64_t exact;
  int64_t max_distance;
  float log_ratio;    // float32(log(max_distance / e)): T5 takes it in float64, dividing a float32 tensor rounds it
  float log_buckets;  // N' - e
};

inline namespace POSENC_KERNEL_NAMESPACE {

POSENC_INLINE T5Buckets make_t5_buckets(bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  const int64_t per_direction = bidirectional ? num_buckets / 2 : num_buckets;
  const int64_t exact = per_direction / 2;
  return {bidirectional, per_direction, exact, max_distance,
          static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(exact))),
          static_cast<float>(per_direction - exact)};
}

POSENC_INLINE int64_t t5_bucket(const T5Buckets& t5, int64_t relative_position) {
  // |relative_position| as unsigned: exact even at INT64_MIN, where T5's torch.abs wraps.
  const uint64_t magnitude = relative_position < 0 ? 0 - static_cast<uint64_t>(relative_position)
                                                   : static_cast<uint64_t>(relative_position);
  int64_t bucket = 0;
  uint64_t n = 0;
  if (t5.bidirectional) {
    bucket = relative_position > 0 ? t5.per_direction : 0;
    n = magnitude;
  } else if (relative_position < 0) {
    n = magnitude;
  }
  if (n < static_cast<uint64_t>(t5.exact)) return bucket + static_cast<int64_t>(n);
  // From max_distance on, T5's log term is at least N' - e and its min() gives the last bucket.
  if (n >= static_cast<uint64_t>(t5.max_distance)) return bucket + t5.per_direction - 1;
  const float scaled = std::log(static_cast<float>(n) / static_cast<float>(t5.exact)) / t5.log_ratio * t5.log_buckets;
  const int64_t log_bucket = t5.exact + static_cast<int64_t>(scaled);
  return bucket + (log_bucket < t5.per_direction - 1 ? log_bucket : t5.per_direction - 1);
}

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::kernels
