// CPU kernels of ALiBi. Row (b, h, i) of a [B, H, Q, K] bias holds -m * d_j (causal) or -m * |d_j|
// (symmetric), d_j = i + (K - Q) - j, m = slopes[b or 0, head_offset + h].
#include "common/alibi.h"
#include "common/convert.h"
#include "common/parallel.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace posenc {
namespace {

// A [B, H, Q, K] tensor walked row by row (row n = (b * H + h) * Q + i), any strides.
struct Rows {
  int64_t heads, q_len, k_len;
  int64_t stride_b, stride_h, stride_i, stride_j;

  explicit Rows(const at::Tensor& t)
      : heads(t.size(1)), q_len(t.size(2)), k_len(t.size(3)), stride_b(t.stride(0)), stride_h(t.stride(1)),
        stride_i(t.stride(2)), stride_j(t.stride(3)) {}

  int64_t batch_of(int64_t n) const { return n / (heads * q_len); }
  int64_t head_of(int64_t n) const { return (n / q_len) % heads; }
  int64_t query_of(int64_t n) const { return n % q_len; }
  int64_t offset_of(int64_t n) const {
    return batch_of(n) * stride_b + head_of(n) * stride_h + query_of(n) * stride_i;
  }
  // d_j = distance0 - j: bottom-right alignment puts the last query on the last key.
  int64_t distance0(int64_t n) const { return query_of(n) + k_len - q_len; }
};

// The slopes a call uses, [B or 1][num_heads] in maths precision, head_offset applied.
template <typename opmath_t>
std::vector<opmath_t> local_slopes(const at::Tensor& slopes, int64_t head_offset, int64_t num_heads) {
  const auto values = slopes.to(at::kDouble).contiguous();
  const double* m = values.const_data_ptr<double>();
  const int64_t total = slopes.size(-1);
  const int64_t batch = slopes.dim() == 2 ? slopes.size(0) : 1;
  std::vector<opmath_t> out(batch * num_heads);
  for (const auto b : c10::irange(batch)) {
    for (const auto h : c10::irange(num_heads)) {
      out[b * num_heads + h] = static_cast<opmath_t>(m[b * total + head_offset + h]);
    }
  }
  return out;
}

// Key positions 0..K-1 as opmath_t, so that the inner loops are float arithmetic the compiler vectorizes.
template <typename T>
std::vector<T> key_positions(int64_t k_len) {
  std::vector<T> out(k_len);
  for (const auto j : c10::irange(k_len)) out[j] = static_cast<T>(j);
  return out;
}

// dst[j] = src[j] + bias_j over one row (src null: the bias alone); unit strides get their own loop.
template <bool kSymmetric, typename scalar_t, typename opmath_t>
void alibi_row(const scalar_t* src, int64_t src_stride, scalar_t* dst, int64_t dst_stride, int64_t k_len,
               opmath_t slope, opmath_t distance0, const opmath_t* key_pos) {
  const opmath_t neg_slope = -slope;
  auto bias = [&](int64_t j) {
    const opmath_t d = distance0 - key_pos[j];
    return neg_slope * (kSymmetric ? std::abs(d) : d);
  };
  if (src == nullptr) {
    if (dst_stride == 1) {
      for (int64_t j = 0; j < k_len; ++j) dst[j] = from_opmath<scalar_t>(bias(j));
    } else {
      for (int64_t j = 0; j < k_len; ++j) dst[j * dst_stride] = from_opmath<scalar_t>(bias(j));
    }
  } else if (src_stride == 1 && dst_stride == 1) {
    // In place (add_alibi_) src and dst are the same row, so neither pointer is __restrict__.
    for (int64_t j = 0; j < k_len; ++j) dst[j] = from_opmath<scalar_t>(to_opmath(src[j]) + bias(j));
  } else {
    for (int64_t j = 0; j < k_len; ++j) {
      dst[j * dst_stride] = from_opmath<scalar_t>(to_opmath(src[j * src_stride]) + bias(j));
    }
  }
}

// Writes every row of `out` (geometry `out_rows`) as src + bias, src read through `src_rows` (or absent).
template <typename scalar_t>
void alibi_rows(AlibiMode mode, const at::Tensor& slopes, int64_t head_offset, const scalar_t* src,
                const Rows& src_rows, scalar_t* out, const Rows& out_rows, int64_t num_rows) {
  using opmath_t = at::opmath_type<scalar_t>;
  const auto m = local_slopes<opmath_t>(slopes, head_offset, out_rows.heads);
  const bool per_batch = slopes.dim() == 2;
  const int64_t k_len = out_rows.k_len;
  const auto key_pos = key_positions<opmath_t>(k_len);
  at::parallel_for(0, num_rows, rows_per_task(k_len), [&](int64_t begin, int64_t end) {
    for (const auto n : c10::irange(begin, end)) {
      const opmath_t slope = m[(per_batch ? out_rows.batch_of(n) : 0) * out_rows.heads + out_rows.head_of(n)];
      const auto d0 = static_cast<opmath_t>(out_rows.distance0(n));
      const scalar_t* row_src = src == nullptr ? nullptr : src + src_rows.offset_of(n);
      scalar_t* row_out = out + out_rows.offset_of(n);
      if (mode == AlibiMode::Symmetric) {
        alibi_row<true>(row_src, src_rows.stride_j, row_out, out_rows.stride_j, k_len, slope, d0, key_pos.data());
      } else {
        alibi_row<false>(row_src, src_rows.stride_j, row_out, out_rows.stride_j, k_len, slope, d0, key_pos.data());
      }
    }
  });
}

at::Tensor alibi_bias_cpu(const at::Tensor& slopes, int64_t q_len, int64_t k_len, c10::string_view mode,
                          int64_t head_offset, std::optional<int64_t> num_heads, std::optional<at::ScalarType> dtype) {
  const auto shape = check_alibi_bias(slopes, q_len, k_len, mode, head_offset,
                                      num_heads ? std::optional<c10::SymInt>(*num_heads) : std::nullopt, dtype);
  const auto alibi_mode = parse_alibi_mode("alibi_bias", mode);
  auto out = at::empty({shape.batch.expect_int(), shape.num_heads.expect_int(), q_len, k_len},
                       slopes.options().dtype(shape.dtype));
  if (out.numel() == 0) return out;
  const Rows rows(out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, shape.dtype, "posenc_alibi_bias", [&] {
    alibi_rows<scalar_t>(alibi_mode, slopes, head_offset, nullptr, rows, out.mutable_data_ptr<scalar_t>(), rows,
                         out.numel() / k_len);
  });
  return out;
}

at::Tensor add_alibi_cpu(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode,
                         int64_t head_offset) {
  const auto alibi_mode = check_alibi_scores("add_alibi", "scores", scores, slopes, mode, head_offset);
  auto out = at::empty(scores.sizes(), scores.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "posenc_add_alibi", [&] {
    alibi_rows<scalar_t>(alibi_mode, slopes, head_offset, scores.const_data_ptr<scalar_t>(), Rows(scores),
                         out.mutable_data_ptr<scalar_t>(), Rows(out), out.numel() / out.size(3));
  });
  return out;
}

// In place through scores' own strides: a view (e.g. a slice of a larger buffer) is updated where it lies.
void add_alibi__cpu(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode, int64_t head_offset) {
  const auto alibi_mode = check_add_alibi_inplace(scores, slopes, mode, head_offset);
  if (scores.numel() == 0) return;
  const Rows rows(scores);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "posenc_add_alibi_", [&] {
    scalar_t* data = scores.mutable_data_ptr<scalar_t>();
    alibi_rows<scalar_t>(alibi_mode, slopes, head_offset, data, rows, data, rows, scores.numel() / scores.size(3));
  });
}

// sum_j row[j] * d_j (|d_j| symmetric), d_j = distance0 - j, in float64. Unit-stride rows are summed in
// kLanes interleaved partial sums (lane l takes j = l mod kLanes), added in lane order at the end: vector
// registers hold the lanes, and the order is fixed by k_len alone, whatever thread sums the row.
template <bool kSymmetric, typename scalar_t>
double alibi_row_gradient(const scalar_t* row, int64_t stride, int64_t k_len, double distance0, const double* key_pos) {
  constexpr int64_t kLanes = 16;
  auto weight = [&](int64_t j) {
    const double d = distance0 - key_pos[j];
    return kSymmetric ? std::abs(d) : d;
  };
  double lanes[kLanes] = {};
  int64_t j = 0;
  if (stride == 1) {
    for (; j + kLanes <= k_len; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        lanes[l] += static_cast<double>(to_opmath(row[j + l])) * weight(j + l);
      }
    }
  }
  double tail = 0;
  for (; j < k_len; ++j) tail += static_cast<double>(to_opmath(row[j * stride])) * weight(j);
  double sum = 0;
  for (const double lane : lanes) sum += lane;
  return sum + tail;
}

// d/d slopes[b?, head_offset + h] = -sum_{i, j} grad[b, h, i, j] * d_ij (|d_ij| symmetric). Each row is summed
// in float64 by one thread, then rows are added in row order: the same bits for any thread count.
at::Tensor alibi_backward_cpu(const at::Tensor& grad, const at::Tensor& slopes, c10::string_view mode,
                              int64_t head_offset) {
  const auto alibi_mode = check_alibi_scores("alibi_backward", "grad", grad, slopes, mode, head_offset);
  auto acc = at::zeros(slopes.sizes(), slopes.options().dtype(at::kDouble));
  if (grad.numel() == 0) return acc.to(slopes.scalar_type());
  const Rows rows(grad);
  const int64_t k_len = rows.k_len;
  const int64_t num_rows = grad.numel() / k_len;
  const auto key_pos = key_positions<double>(k_len);
  std::vector<double> row_sums(num_rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_alibi_backward", [&] {
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, rows_per_task(k_len), [&](int64_t begin, int64_t end) {
      for (const auto n : c10::irange(begin, end)) {
        const scalar_t* row = g + rows.offset_of(n);
        const auto d0 = static_cast<double>(rows.distance0(n));
        row_sums[n] = -(alibi_mode == AlibiMode::Symmetric
                            ? alibi_row_gradient<true>(row, rows.stride_j, k_len, d0, key_pos.data())
                            : alibi_row_gradient<false>(row, rows.stride_j, k_len, d0, key_pos.data()));
      }
    });
  });
  double* out = acc.mutable_data_ptr<double>();
  const bool per_batch = slopes.dim() == 2;
  const int64_t total = slopes.size(-1);
  for (const auto n : c10::irange(num_rows)) {
    out[(per_batch ? rows.batch_of(n) * total : 0) + head_offset + rows.head_of(n)] += row_sums[n];
  }
  return acc.to(slopes.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("alibi_bias", TORCH_FN(alibi_bias_cpu));
  m.impl("add_alibi", TORCH_FN(add_alibi_cpu));
  m.impl("add_alibi_", TORCH_FN(add_alibi__cpu));
  m.impl("alibi_backward", TORCH_FN(alibi_backward_cpu));
}

}  // namespace posenc
