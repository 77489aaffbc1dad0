// T5 buckets from tabulated thresholds (what the CUDA kernels compute, portable/t5.h) equal T5's float32-log
// buckets (what the CPU kernels compute) for every distance of several configurations: the GPU's buckets are the
// CPU's whatever the device's logarithm.
#include "portable/t5.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using posenc::portable::make_t5_buckets;
using posenc::portable::t5_bucket;
using posenc::portable::t5_bucket_tabulated;
using posenc::portable::t5_log_thresholds;

void expect_same_buckets(bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  const auto t5 = make_t5_buckets(bidirectional, num_buckets, max_distance);
  const auto thresholds = t5_log_thresholds(t5);
  ASSERT_EQ(static_cast<int64_t>(thresholds.size()), t5.per_direction - 1 - t5.exact);
  std::vector<int64_t> distances;
  const int64_t scanned = std::min<int64_t>(2 * max_distance + 2, int64_t{1} << 18);  // every distance up to here
  for (int64_t n = -scanned; n <= scanned; ++n) distances.push_back(n);
  for (const int64_t threshold : thresholds) {  // and both sides of every threshold beyond
    for (int64_t d = -2; d <= 2; ++d) {
      distances.push_back(threshold + d);
      distances.push_back(-(threshold + d));
    }
  }
  for (const int64_t n : {std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), max_distance - 1,
                          max_distance, -max_distance, 1 - max_distance}) {
    distances.push_back(n);
  }
  for (const int64_t n : distances) {
    ASSERT_EQ(t5_bucket_tabulated(t5, thresholds.data(), static_cast<int64_t>(thresholds.size()), n), t5_bucket(t5, n))
        << "relative position " << n << ", bidirectional " << bidirectional << ", num_buckets " << num_buckets
        << ", max_distance " << max_distance;
  }
}

TEST(T5Tabulated, EqualsTheLogarithmForEveryDistance) {
  for (const auto& [bidirectional, num_buckets, max_distance] :
       std::vector<std::tuple<bool, int64_t, int64_t>>{{true, 32, 128},   {false, 32, 128},  {true, 64, 1000},
                                                       {false, 5, 7},     {true, 4, 3},      {true, 1200, 5000},
                                                       {false, 300, 100000}, {true, 8, int64_t{1} << 40},
                                                       {true, 32, 17},    {false, 2, 2}}) {
    expect_same_buckets(bidirectional, num_buckets, max_distance);
  }
}

}  // namespace
