#pragma once
// T5's relative-position bucketing (Mesh TensorFlow, Hugging Face `_relative_position_bucket`), with its
// float32 steps kept as they are: bucket edges land where T5's rounding puts them, not where exact maths would.
#include "portable/libm.h"
#include "portable/macros.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace posenc::portable {

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
          static_cast<float>(libm::log(static_cast<double>(max_distance) / static_cast<double>(exact))),
          static_cast<float>(per_direction - exact)};
}

// The first bucket of relative_position's direction and the distance n that selects a bucket within it.
struct T5Direction {
  int64_t first_bucket;
  uint64_t n;
};

POSENC_INLINE T5Direction t5_direction(const T5Buckets& t5, int64_t relative_position) {
  // |relative_position| as unsigned: exact even at INT64_MIN, where T5's torch.abs wraps.
  const uint64_t magnitude = relative_position < 0 ? 0 - static_cast<uint64_t>(relative_position)
                                                   : static_cast<uint64_t>(relative_position);
  if (t5.bidirectional) return {relative_position > 0 ? t5.per_direction : 0, magnitude};
  return {0, relative_position < 0 ? magnitude : 0};
}

POSENC_INLINE int64_t t5_bucket(const T5Buckets& t5, int64_t relative_position) {
  const auto [bucket, n] = t5_direction(t5, relative_position);
  if (n < static_cast<uint64_t>(t5.exact)) return bucket + static_cast<int64_t>(n);
  // From max_distance on, T5's log term is at least N' - e and its min() gives the last bucket.
  if (n >= static_cast<uint64_t>(t5.max_distance)) return bucket + t5.per_direction - 1;
  const float scaled = libm::logf(static_cast<float>(n) / static_cast<float>(t5.exact)) / t5.log_ratio * t5.log_buckets;
  const int64_t log_bucket = t5.exact + static_cast<int64_t>(scaled);
  return bucket + (log_bucket < t5.per_direction - 1 ? log_bucket : t5.per_direction - 1);
}

// T5's bucket without a logarithm, as every device computes it: the bucket of a log-spaced distance n
// (exact <= n < max_distance) is exact + the count of thresholds <= n, where thresholds[k] is the least n whose
// bucket is at least exact + k + 1: t5_bucket is nondecreasing in n, so the count reproduces it. A bisection over
// at most N' - e thresholds costs less than a correctly rounded log per element.
POSENC_INLINE int64_t t5_bucket_tabulated(const T5Buckets& t5, const int64_t* thresholds, int64_t num_thresholds,
                                          int64_t relative_position) {
  const auto [bucket, n] = t5_direction(t5, relative_position);
  if (n < static_cast<uint64_t>(t5.exact)) return bucket + static_cast<int64_t>(n);
  if (n >= static_cast<uint64_t>(t5.max_distance)) return bucket + t5.per_direction - 1;
  int64_t lo = 0;  // the count of thresholds <= n, by bisection
  int64_t hi = num_thresholds;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<uint64_t>(thresholds[mid]) <= n) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return bucket + t5.exact + lo;
}

// The thresholds of t5_bucket_tabulated, found by bisection over [exact, max_distance) with t5_bucket (a distance
// n of either direction has the log bucket t5_bucket(-n)); max_distance where no distance reaches a bucket. A
// model uses one bucketing: each thread keeps the last one's thresholds (about 60 logarithms).
inline const std::vector<int64_t>& t5_log_thresholds(const T5Buckets& t5) {
  thread_local int64_t cached_per_direction = -1;
  thread_local int64_t cached_max_distance = -1;
  thread_local std::vector<int64_t> thresholds;
  if (cached_per_direction == t5.per_direction && cached_max_distance == t5.max_distance) return thresholds;
  thresholds.clear();
  for (int64_t target = t5.exact + 1; target < t5.per_direction; ++target) {
    int64_t lo = t5.exact;
    int64_t hi = t5.max_distance;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (t5_bucket(t5, -mid) >= target) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    thresholds.push_back(lo);
  }
  cached_per_direction = t5.per_direction;
  cached_max_distance = t5.max_distance;
  return thresholds;
}

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
