// Meta kernels of the rotary family: the CPU kernels' checks and output metadata (fresh, contiguous,
// the input's dtype), no data read. Value checks of cu_seqlens and pair_axis need data and run on real tensors
// only.
#include "common/kv_cache.h"
#include "common/qk_norm.h"
#include "common/rope.h"
#include "families.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

namespace posenc {
namespace {

at::Tensor rope_meta(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                     double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
                     const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis) {
  check_rope("rope", {{"x", &x}}, positions, inv_freq, layout, format, cu_seqlens, pair_axis);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor rope_backward_meta(const at::Tensor& grad, const std::optional<at::Tensor>& positions,
                              const at::Tensor& inv_freq, double attention_scale, c10::string_view layout,
                              c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                              const std::optional<at::Tensor>& pair_axis) {
  check_rope("rope_backward", {{"grad", &grad}}, positions, inv_freq, layout, format, cu_seqlens, pair_axis);
  return at::empty_symint(grad.sym_sizes(), grad.options());
}

std::tuple<at::Tensor, at::Tensor> rope_qk_meta(const at::Tensor& q, const at::Tensor& k,
                                                const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                                double attention_scale, c10::string_view layout,
                                                c10::string_view format, int64_t offset,
                                                const std::optional<at::Tensor>& cu_seqlens,
                                                const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
                                                int64_t q_scale_length, int64_t q_scale_shift) {
  check_rope_qk("rope_qk", {{"q", &q}, {"k", &k}}, positions, inv_freq, layout, format, cu_seqlens, pair_axis,
                q_scale_beta, q_scale_length, q_scale_shift);
  return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(k.sym_sizes(), k.options())};
}

std::tuple<at::Tensor, at::Tensor> rope_qk_backward_meta(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                         const std::optional<at::Tensor>& positions,
                                                         const at::Tensor& inv_freq, double attention_scale,
                                                         c10::string_view layout, c10::string_view format,
                                                         int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                                                         const std::optional<at::Tensor>& pair_axis,
                                                         double q_scale_beta, int64_t q_scale_length,
                                                         int64_t q_scale_shift) {
  check_rope_qk("rope_qk_backward", {{"grad_q", &grad_q}, {"grad_k", &grad_k}}, positions, inv_freq, layout, format,
                cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
  return {at::empty_symint(grad_q.sym_sizes(), grad_q.options()),
          at::empty_symint(grad_k.sym_sizes(), grad_k.options())};
}

void rope__meta(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
                const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis) {
  check_rope("rope_", {{"x", &x}}, positions, inv_freq, layout, format, cu_seqlens, pair_axis);
}

at::Tensor rope_cos_sin_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                             c10::string_view layout, c10::string_view format) {
  check_rope_cos_sin("rope_cos_sin", "x", x, cos, sin, layout, format);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor rope_cos_sin_backward_meta(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                                      c10::string_view layout, c10::string_view format) {
  check_rope_cos_sin("rope_cos_sin_backward", "grad", grad, cos, sin, layout, format);
  return at::empty_symint(grad.sym_sizes(), grad.options());
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope_meta(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight, const at::Tensor& k_weight,
    const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double eps, c10::string_view norm,
    double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
    int64_t q_scale_length, int64_t q_scale_shift) {
  check_qk_norm_rope("qk_norm_rope", {{"q", &q}, {"k", &k}}, q_weight, k_weight, positions, inv_freq, eps, norm,
                     layout, format, cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
  return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(k.sym_sizes(), k.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_backward_meta(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& q_weight, const at::Tensor& k_weight, const std::optional<at::Tensor>& positions,
    const at::Tensor& inv_freq, double eps, c10::string_view norm, double attention_scale, c10::string_view layout,
    c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& pair_axis, double q_scale_beta, int64_t q_scale_length,
    int64_t q_scale_shift) {
  check_qk_norm_rope("qk_norm_rope_backward", {{"grad_q", &grad_q}, {"grad_k", &grad_k}, {"q", &q}, {"k", &k}},
                     q_weight, k_weight, positions, inv_freq, eps, norm, layout, format, cu_seqlens, pair_axis,
                     q_scale_beta, q_scale_length, q_scale_shift);
  return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(k.sym_sizes(), k.options()),
          at::empty_symint(q_weight.sym_sizes(), q_weight.options()),
          at::empty_symint(k_weight.sym_sizes(), k_weight.options())};
}

void qk_norm_rope__meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_weight,
                        const at::Tensor& k_weight, const std::optional<at::Tensor>& positions,
                        const at::Tensor& inv_freq, double eps, c10::string_view norm, double attention_scale,
                        c10::string_view layout, c10::string_view format, int64_t offset,
                        const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis,
                        double q_scale_beta, int64_t q_scale_length, int64_t q_scale_shift) {
  check_qk_norm_rope("qk_norm_rope_", {{"q", &q}, {"k", &k}}, q_weight, k_weight, positions, inv_freq, eps, norm,
                     layout, format, cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
}

void rope_qk_cache__meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const std::optional<at::Tensor>& positions,
                         const at::Tensor& inv_freq, const std::optional<at::Tensor>& cache_positions,
                         c10::string_view cache_format, double attention_scale, c10::string_view layout,
                         c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                         const std::optional<at::Tensor>& pair_axis, double q_scale_beta, int64_t q_scale_length,
                         int64_t q_scale_shift) {
  check_rope_qk_cache("rope_qk_cache_", q, k, v, k_cache, v_cache, positions, inv_freq, cache_positions, cache_format,
                      layout, format, cu_seqlens, pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) {
  POSENC_ROPE_OPS(POSENC_IMPL_SUFFIXED, _meta)
  POSENC_QK_NORM_OPS(POSENC_IMPL_SUFFIXED, _meta)
  POSENC_KV_CACHE_OPS(POSENC_IMPL_SUFFIXED, _meta)
}

}  // namespace posenc
