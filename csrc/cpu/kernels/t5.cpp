// T5 relative-bias kernels, compiled once per CPU capability. The bias is constant along each diagonal
// j - i, so both directions work on the Q + K - 1 diagonals.
#include "cpu/kernels/capability.h"
#include "cpu/kernels/t5.h"

POSENC_KERNELS_BEGIN
#include "portable/convert.h"
#include "portable/t5.h"
#include "portable/tiling.h"

namespace posenc::cpu {
inline namespace POSENC_CPU_CAPABILITY {
namespace {

using namespace posenc::portable;

T5Buckets buckets_of(const T5BucketParams& params) {
  return make_t5_buckets(params.bidirectional, params.num_buckets, params.max_distance);
}

// A bucket costs a short bisection: a smaller grain than for plain copies.
constexpr int64_t kBucketGrain = 2048;

template <typename index_t>
void relative_bucket_kernel(const RelativeBucketProblem<index_t>& p) {
  const auto t5 = buckets_of(p.params);
  const auto& thresholds = t5_log_thresholds(t5);
  const auto count = static_cast<int64_t>(thresholds.size());
  parallel_for(0, p.numel, kBucketGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      p.out[n] = t5_bucket_tabulated(t5, thresholds.data(), count, static_cast<int64_t>(p.relative_position[n]));
    }
  });
}

// Bucket of diagonal r = j - i + (q_len - 1), whose relative position is r - (q_len - 1) - q_offset.
std::vector<int64_t> diagonal_buckets(const T5BucketParams& params, int64_t q_len, int64_t k_len, int64_t q_offset) {
  const auto t5 = buckets_of(params);
  const auto& thresholds = t5_log_thresholds(t5);
  const auto count = static_cast<int64_t>(thresholds.size());
  std::vector<int64_t> out(q_len + k_len - 1);
  const int64_t first = -(q_len - 1) - q_offset;
  parallel_for(0, static_cast<int64_t>(out.size()), kBucketGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = t5_bucket_tabulated(t5, thresholds.data(), count, first + r);
  });
  return out;
}

// Each head's Q + K - 1 diagonal values are gathered once; every output row is then a slice of them.
template <typename scalar_t>
void t5_bias_kernel(const T5BiasProblem<scalar_t>& p) {
  const auto buckets = diagonal_buckets(p.params, p.q_len, p.k_len, p.q_offset);
  const auto diagonals = static_cast<int64_t>(buckets.size());
  std::vector<scalar_t> diag(p.heads * diagonals);
  for (int64_t h = 0; h < p.heads; ++h) {
    for (int64_t r = 0; r < diagonals; ++r) {
      diag[h * diagonals + r] = p.weight[buckets[r] * p.weight_stride_bucket + h * p.weight_stride_head];
    }
  }
  const int64_t q_len = p.q_len;
  const int64_t k_len = p.k_len;
  parallel_for(0, p.heads * q_len, rows_per_task(k_len), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t h = n / q_len;
      const int64_t i = n % q_len;
      std::copy_n(diag.data() + h * diagonals + (q_len - 1 - i), k_len, p.out + n * k_len);
    }
  });
}

// First every diagonal is summed over its rows in row order (threads split the diagonals, never the rows),
// then each head adds its diagonals into their buckets in diagonal order: float64 sums in a fixed order, the
// same bits for any thread count.
template <typename scalar_t>
void t5_bias_backward_kernel(const T5BiasBackwardProblem<scalar_t>& p) {
  const auto buckets = diagonal_buckets(p.params, p.q_len, p.k_len, p.q_offset);
  const auto diagonals = static_cast<int64_t>(buckets.size());
  const int64_t q_len = p.q_len;
  const int64_t k_len = p.k_len;
  std::vector<double> diag_sum(p.heads * diagonals, 0.0);
  const int64_t grain = std::max<int64_t>(64, kGrainSize / q_len);
  parallel_for(0, p.heads * diagonals, grain, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin / diagonals; h * diagonals < end; ++h) {
      const int64_t r_begin = std::max(begin, h * diagonals) - h * diagonals;
      const int64_t r_end = std::min(end, (h + 1) * diagonals) - h * diagonals;
      double* sums = diag_sum.data() + h * diagonals;
      // Row i covers diagonals [q_len - 1 - i, q_len - 1 - i + k_len): only rows meeting [r_begin, r_end).
      const int64_t i_begin = std::max<int64_t>(0, q_len - r_end);
      const int64_t i_end = std::min<int64_t>(q_len, q_len - 1 + k_len - r_begin);
      for (int64_t i = i_begin; i < i_end; ++i) {
        const int64_t first = q_len - 1 - i;
        const scalar_t* row = p.grad + (h * q_len + i) * k_len;
        const int64_t lo = std::max(r_begin, first);
        const int64_t hi = std::min(r_end, first + k_len);
        int64_t r = lo;
#if defined(POSENC_HAS_F16C)
        // fp16 widened 256 at a time by F16C (widen), not value by value by to_opmath's integer form: the same
        // values. Zen 2, 2 threads, grad [1, 16, 1024, 1024]: 3.92-4.06 -> 2.93-3.22 ms.
        if constexpr (std::is_same_v<scalar_t, c10::Half>) {
          constexpr int64_t kBlock = 256;
          float block[kBlock];
          for (; r + kBlock <= hi; r += kBlock) {
            widen(row + (r - first), block, kBlock);
            for (int64_t b = 0; b < kBlock; ++b) sums[r + b] += static_cast<double>(block[b]);
          }
        }
#endif
        for (; r < hi; ++r) sums[r] += static_cast<double>(to_opmath(row[r - first]));
      }
    }
  });
  const int64_t num_buckets = p.params.num_buckets;
  parallel_for(0, p.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t r = 0; r < diagonals; ++r) p.grad_weight[h * num_buckets + buckets[r]] += diag_sum[h * diagonals + r];
    }
  });
}

}  // namespace
POSENC_KERNELS_END  // the registrations below run when the library loads, on any CPU

POSENC_REGISTER_KERNEL(relative_bucket_stub<int64_t>, &relative_bucket_kernel<int64_t>);
POSENC_REGISTER_KERNEL(relative_bucket_stub<int32_t>, &relative_bucket_kernel<int32_t>);
POSENC_REGISTER_FLOATING_KERNELS(t5_bias_stub, t5_bias_kernel);
POSENC_REGISTER_FLOATING_KERNELS(t5_bias_backward_stub, t5_bias_backward_kernel);
}  // namespace POSENC_CPU_CAPABILITY
}  // namespace posenc::cpu
