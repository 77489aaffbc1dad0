// CPU ops of ALiBi: checks, slopes, allocation, dtype dispatch; the loops are in cpu/kernels/alibi.cpp.
#include "common/alibi.h"
#include "cpu/kernels/alibi.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

namespace posenc {
namespace {

AlibiRows rows_of(const at::Tensor& t) {
  return {t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// The slopes a call uses, [B or 1][num_heads] in maths precision, head_offset applied.
template <typename opmath>
std::vector<opmath> local_slopes(const at::Tensor& slopes, int64_t head_offset, int64_t num_heads) {
  const auto values = slopes.to(at::kDouble).contiguous();
  const double* m = values.const_data_ptr<double>();
  const int64_t total = slopes.size(-1);
  const int64_t batch = slopes.dim() == 2 ? slopes.size(0) : 1;
  std::vector<opmath> out(batch * num_heads);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < num_heads; ++h) out[b * num_heads + h] = static_cast<opmath>(m[b * total + head_offset + h]);
  }
  return out;
}

// Writes every row of `out` as in + bias (in undefined: the bias alone); out may be in.
void add_bias(const at::Tensor& in, const at::Tensor& out, const at::Tensor& slopes, AlibiMode mode,
              int64_t head_offset) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "posenc_alibi", [&] {
    const auto m = local_slopes<opmath_t<scalar_t>>(slopes, head_offset, out.size(1));
    cpu::alibi_stub<scalar_t>({in.defined() ? in.const_data_ptr<scalar_t>() : nullptr,
                               in.defined() ? rows_of(in) : rows_of(out), out.mutable_data_ptr<scalar_t>(),
                               rows_of(out), out.numel() / out.size(3), m.data(), slopes.dim() == 2, mode});
  });
}

at::Tensor alibi_bias_cpu(const at::Tensor& slopes, int64_t q_len, int64_t k_len, c10::string_view mode,
                          int64_t head_offset, std::optional<int64_t> num_heads, std::optional<at::ScalarType> dtype) {
  const auto shape = check_alibi_bias(slopes, q_len, k_len, mode, head_offset,
                                      num_heads ? std::optional<c10::SymInt>(*num_heads) : std::nullopt, dtype);
  auto out = at::empty({shape.batch.expect_int(), shape.num_heads.expect_int(), q_len, k_len},
                       slopes.options().dtype(shape.dtype));
  if (out.numel() > 0) add_bias(at::Tensor(), out, slopes, parse_alibi_mode("alibi_bias", mode), head_offset);
  return out;
}

at::Tensor add_alibi_cpu(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode,
                         int64_t head_offset) {
  const auto alibi_mode = check_alibi_scores("add_alibi", "scores", scores, slopes, mode, head_offset);
  auto out = at::empty(scores.sizes(), scores.options());
  if (out.numel() > 0) add_bias(scores, out, slopes, alibi_mode, head_offset);
  return out;
}

// In place through scores' own strides: a view (e.g. a slice of a larger buffer) is updated where it lies.
void add_alibi__cpu(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode, int64_t head_offset) {
  const auto alibi_mode = check_add_alibi_inplace(scores, slopes, mode, head_offset);
  check_no_internal_overlap("add_alibi_", "scores", scores, "write into a tensor that owns each element, or use add_alibi");
  if (scores.numel() > 0) add_bias(scores, scores, slopes, alibi_mode, head_offset);
}

// d/d slopes[b?, head_offset + h] = -sum_{i, j} grad[b, h, i, j] * d_ij (|d_ij| symmetric), deterministic.
at::Tensor alibi_backward_cpu(const at::Tensor& grad, const at::Tensor& slopes, c10::string_view mode,
                              int64_t head_offset) {
  const auto alibi_mode = check_alibi_scores("alibi_backward", "grad", grad, slopes, mode, head_offset);
  auto acc = at::zeros(slopes.sizes(), slopes.options().dtype(at::kDouble));
  if (grad.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_alibi_backward", [&] {
      cpu::alibi_backward_stub<scalar_t>({grad.const_data_ptr<scalar_t>(), rows_of(grad), grad.numel() / grad.size(3),
                                          alibi_mode, slopes.dim() == 2, slopes.size(-1), head_offset,
                                          acc.mutable_data_ptr<double>()});
    });
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
