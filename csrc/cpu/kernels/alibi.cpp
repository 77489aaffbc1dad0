// ALiBi kernels, compiled once per CPU capability.
#include "cpu/kernels/capability.h"
#include "cpu/kernels/alibi.h"

POSENC_KERNELS_BEGIN
#include "portable/alibi.h"
#include "portable/tiling.h"

namespace posenc::cpu {
inline namespace POSENC_CPU_CAPABILITY {
namespace {

using namespace posenc::portable;

// Key positions 0..K-1 in the maths type.
template <typename T>
ScratchVector<T> key_positions(int64_t k_len) {
  ScratchVector<T> out(k_len);
  for (int64_t j = 0; j < k_len; ++j) out[j] = static_cast<T>(j);
  return out;
}

template <AlibiMode kMode, typename scalar_t>
void alibi_rows(const AlibiProblem<scalar_t>& p) {
  using opmath = opmath_t<scalar_t>;
  const AlibiRows& out_rows = p.out_rows;
  const int64_t k_len = out_rows.k_len;
  const auto key_pos = key_positions<opmath>(k_len);
  parallel_for(0, p.num_rows, rows_per_task(k_len), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const opmath slope = p.slopes[(p.per_batch ? alibi_batch(out_rows, n) : 0) * out_rows.heads + alibi_head(out_rows, n)];
      const auto d0 = static_cast<opmath>(alibi_distance0(out_rows, n));
      const scalar_t* src = p.in == nullptr ? nullptr : p.in + alibi_row_offset(p.in_rows, n);
      alibi_row<kMode>(src, p.in_rows.stride_j, p.out + alibi_row_offset(out_rows, n), out_rows.stride_j, k_len, slope,
                       d0, key_pos.data());
    }
  });
}

template <typename scalar_t>
void alibi_kernel(const AlibiProblem<scalar_t>& p) {
  if (p.mode == AlibiMode::Symmetric) {
    alibi_rows<AlibiMode::Symmetric>(p);
  } else {
    alibi_rows<AlibiMode::Causal>(p);
  }
}

// Each row is summed in float64 by one thread, then rows are added in row order: the same bits for any
// thread count.
template <typename scalar_t>
void alibi_backward_kernel(const AlibiBackwardProblem<scalar_t>& p) {
  const AlibiRows& rows = p.rows;
  const int64_t k_len = rows.k_len;
  const auto key_pos = key_positions<double>(k_len);
  std::vector<double> row_sums(p.num_rows);
  parallel_for(0, p.num_rows, rows_per_task(k_len), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* row = p.grad + alibi_row_offset(rows, n);
      const auto d0 = static_cast<double>(alibi_distance0(rows, n));
      row_sums[n] = -(p.mode == AlibiMode::Symmetric
                          ? alibi_row_gradient<AlibiMode::Symmetric>(row, rows.stride_j, k_len, d0, key_pos.data())
                          : alibi_row_gradient<AlibiMode::Causal>(row, rows.stride_j, k_len, d0, key_pos.data()));
    }
  });
  for (int64_t n = 0; n < p.num_rows; ++n) {
    p.slope_grad[(p.per_batch ? alibi_batch(rows, n) * p.total_heads : 0) + p.head_offset + alibi_head(rows, n)] +=
        row_sums[n];
  }
}

}  // namespace
POSENC_KERNELS_END  // the registrations below run when the library loads, on any CPU

POSENC_REGISTER_FLOATING_KERNELS(alibi_stub, alibi_kernel);
POSENC_REGISTER_FLOATING_KERNELS(alibi_backward_stub, alibi_backward_kernel);
}  // namespace POSENC_CPU_CAPABILITY
}  // namespace posenc::cpu
