// CPU kernels of the T5 relative bias: bias[0, h, i, j] = weight[bucket(j - i - q_offset), h].
// The bias is constant along each diagonal j - i, so both directions work on Q + K - 1 diagonals.
#include "common/parallel.h"
#include "common/t5.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace posenc {
namespace {

// T5's bucketing (Mesh TensorFlow, Hugging Face `_relative_position_bucket`) with its float32 steps kept
// as they are: bucket edges land where T5's rounding puts them, not where exact maths would.
class T5Buckets {
 public:
  T5Buckets(bool bidirectional, int64_t num_buckets, int64_t max_distance)
      : bidirectional_(bidirectional),
        per_direction_(bidirectional ? num_buckets / 2 : num_buckets),
        exact_(per_direction_ / 2),
        max_distance_(max_distance),
        // T5 takes math.log(max_distance / max_exact) in float64; dividing a float32 tensor rounds it to float32.
        log_ratio_(static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(exact_)))),
        log_buckets_(static_cast<float>(per_direction_ - exact_)) {}

  int64_t operator()(int64_t relative_position) const {
    // |relative_position| as unsigned: exact even at INT64_MIN, where T5's torch.abs wraps.
    const uint64_t magnitude = relative_position < 0 ? 0 - static_cast<uint64_t>(relative_position)
                                                     : static_cast<uint64_t>(relative_position);
    int64_t bucket = 0;
    uint64_t n = 0;
    if (bidirectional_) {
      bucket = relative_position > 0 ? per_direction_ : 0;
      n = magnitude;
    } else if (relative_position < 0) {
      n = magnitude;
    }
    if (n < static_cast<uint64_t>(exact_)) return bucket + static_cast<int64_t>(n);
    // From max_distance on, T5's log term is at least N' - e and its min() gives the last bucket.
    if (n >= static_cast<uint64_t>(max_distance_)) return bucket + per_direction_ - 1;
    const float scaled = std::log(static_cast<float>(n) / static_cast<float>(exact_)) / log_ratio_ * log_buckets_;
    return bucket + std::min(exact_ + static_cast<int64_t>(scaled), per_direction_ - 1);
  }

 private:
  bool bidirectional_;
  int64_t per_direction_, exact_, max_distance_;
  float log_ratio_, log_buckets_;
};

// Relative positions j - i - q_offset must not overflow int64 (the sizes are far below 2^62).
void check_q_offset(const char* op, int64_t q_offset) {
  constexpr int64_t limit = int64_t{1} << 62;
  TORCH_CHECK(q_offset >= -limit && q_offset <= limit, "posenc.", op, ": q_offset ", q_offset,
              " is outside [-2^62, 2^62]");
}

// Bucket of diagonal r = j - i + (q_len - 1), whose relative position is r - (q_len - 1) - q_offset.
std::vector<int64_t> diagonal_buckets(const T5Buckets& bucket, int64_t q_len, int64_t k_len, int64_t q_offset) {
  std::vector<int64_t> out(q_len + k_len - 1);
  const int64_t first = -(q_len - 1) - q_offset;
  at::parallel_for(0, static_cast<int64_t>(out.size()), 2048, [&](int64_t begin, int64_t end) {
    for (const auto r : c10::irange(begin, end)) out[r] = bucket(first + r);
  });
  return out;
}

at::Tensor relative_position_bucket_cpu(const at::Tensor& relative_position, bool bidirectional, int64_t num_buckets,
                                        int64_t max_distance) {
  check_relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance);
  const T5Buckets bucket(bidirectional, num_buckets, max_distance);
  const auto input = relative_position.contiguous();
  auto out = at::empty(input.sizes(), input.options().dtype(at::kLong));
  AT_DISPATCH_INDEX_TYPES(input.scalar_type(), "posenc_relative_position_bucket", [&] {
    const index_t* src = input.const_data_ptr<index_t>();
    int64_t* dst = out.mutable_data_ptr<int64_t>();
    // A bucket can cost a log: a smaller grain than for plain copies.
    at::parallel_for(0, input.numel(), 2048, [&](int64_t begin, int64_t end) {
      for (const auto n : c10::irange(begin, end)) dst[n] = bucket(src[n]);
    });
  });
  return out;
}

// Each head's Q + K - 1 diagonal values are gathered once; every output row is then a slice of them.
at::Tensor t5_bias_cpu(const at::Tensor& weight, int64_t q_len, int64_t k_len, bool bidirectional,
                       int64_t num_buckets, int64_t max_distance, int64_t q_offset) {
  check_t5_bias(weight, q_len, k_len, bidirectional, num_buckets, max_distance);
  check_q_offset("t5_bias", q_offset);
  const int64_t heads = weight.size(1);
  auto out = at::empty({1, heads, q_len, k_len}, weight.options());
  if (out.numel() == 0) return out;
  const auto buckets = diagonal_buckets(T5Buckets(bidirectional, num_buckets, max_distance), q_len, k_len, q_offset);
  const auto diagonals = static_cast<int64_t>(buckets.size());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_t5_bias", [&] {
    const scalar_t* table = weight.const_data_ptr<scalar_t>();
    const int64_t row_stride = weight.stride(0);
    const int64_t head_stride = weight.stride(1);
    std::vector<scalar_t> diag(heads * diagonals);
    for (const auto h : c10::irange(heads)) {
      for (const auto r : c10::irange(diagonals)) {
        diag[h * diagonals + r] = table[buckets[r] * row_stride + h * head_stride];
      }
    }
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, heads * q_len, rows_per_task(k_len), [&](int64_t begin, int64_t end) {
      for (const auto n : c10::irange(begin, end)) {
        const int64_t h = n / q_len;
        const int64_t i = n % q_len;
        std::copy_n(diag.data() + h * diagonals + (q_len - 1 - i), k_len, dst + n * k_len);
      }
    });
  });
  return out;
}

// grad [1, H, Q, K] -> [num_buckets, H]. First every diagonal is summed over its rows in row order
// (threads split the diagonals, never the rows), then each head adds its diagonals into their buckets in
// diagonal order: float64 sums in a fixed order, the same bits for any thread count.
at::Tensor t5_bias_backward_cpu(const at::Tensor& grad, bool bidirectional, int64_t num_buckets, int64_t max_distance,
                                int64_t q_offset) {
  check_t5_bias_backward(grad, bidirectional, num_buckets, max_distance);
  check_q_offset("t5_bias_backward", q_offset);
  const int64_t heads = grad.size(1);
  const int64_t q_len = grad.size(2);
  const int64_t k_len = grad.size(3);
  auto acc = at::zeros({heads, num_buckets}, grad.options().dtype(at::kDouble));
  if (grad.numel() == 0) return acc.t().contiguous().to(grad.scalar_type());
  const auto buckets = diagonal_buckets(T5Buckets(bidirectional, num_buckets, max_distance), q_len, k_len, q_offset);
  const auto diagonals = static_cast<int64_t>(buckets.size());
  std::vector<double> diag_sum(heads * diagonals, 0.0);
  const auto rows = grad.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_t5_bias_backward", [&] {
    const scalar_t* g = rows.const_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(64, kGrainSize / q_len);
    at::parallel_for(0, heads * diagonals, grain, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin / diagonals; h * diagonals < end; ++h) {
        const int64_t r_begin = std::max(begin, h * diagonals) - h * diagonals;
        const int64_t r_end = std::min(end, (h + 1) * diagonals) - h * diagonals;
        double* sums = diag_sum.data() + h * diagonals;
        // Row i covers diagonals [q_len - 1 - i, q_len - 1 - i + k_len): only rows meeting [r_begin, r_end).
        const int64_t i_begin = std::max<int64_t>(0, q_len - r_end);
        const int64_t i_end = std::min<int64_t>(q_len, q_len - 1 + k_len - r_begin);
        for (int64_t i = i_begin; i < i_end; ++i) {
          const int64_t first = q_len - 1 - i;
          const scalar_t* row = g + (h * q_len + i) * k_len;
          const int64_t lo = std::max(r_begin, first);
          const int64_t hi = std::min(r_end, first + k_len);
          for (int64_t r = lo; r < hi; ++r) sums[r] += static_cast<double>(row[r - first]);
        }
      }
    });
  });
  double* out = acc.mutable_data_ptr<double>();
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (const auto h : c10::irange(begin, end)) {
      for (const auto r : c10::irange(diagonals)) out[h * num_buckets + buckets[r]] += diag_sum[h * diagonals + r];
    }
  });
  return acc.t().contiguous().to(grad.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("relative_position_bucket", TORCH_FN(relative_position_bucket_cpu));
  m.impl("t5_bias", TORCH_FN(t5_bias_cpu));
  m.impl("t5_bias_backward", TORCH_FN(t5_bias_backward_cpu));
}

}  // namespace posenc
