#include <posenc/qk_norm.h>
#include <posenc/rope.h>

#include "common/qk_norm.h"
#include "common/rope.h"
#include "config/rope_scaling.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/where.h>

#include <cmath>
#include <limits>
#include <utility>

namespace posenc {

at::Tensor frequencies::rope_for_length_op(int64_t rotary_dim, double base, const RopeScaling& scaling,
                                           const at::Tensor& seq_len) {
  using Signature = at::Tensor(const at::Tensor& seq_len, int64_t rotary_dim, double base,
                               c10::string_view rope_type POSENC_SCALING_PARAMETERS);
  static const auto op = detail::find_op<Signature>("posenc::rope_inv_freq_for_length");
  return op.call(seq_len, rotary_dim, base,
                 scaling.rope_type POSENC_ROPE_SCALING_KEYS(POSENC_SCALING_ARGUMENT, scaling));
}

namespace nn {

RotaryEmbeddingImpl::RotaryEmbeddingImpl(int64_t head_dim, std::optional<int64_t> rotary_dim, double base,
                                         std::string layout, frequencies::RopeScaling scaling, std::string format)
    : head_dim_(head_dim),
      rotary_dim_(rotary_dim.value_or(head_dim)),
      base_(base),
      layout_(std::move(layout)),
      scaling_(std::move(scaling)),
      format_(std::move(format)) {
  constexpr const char* op = "nn.RotaryEmbedding";
  TORCH_CHECK(rotary_dim_ <= head_dim_, "posenc.", op, ": rotary_dim ", rotary_dim_, " exceeds head_dim ", head_dim_);
  parse_rope_layout(op, layout_);
  parse_rope_format(op, format_);
  const auto freqs = frequencies::rope(rotary_dim_, base_, scaling_);
  inv_freq_ = freqs.inv_freq;
  attention_scale_ = freqs.attention_scale;
}

// The types whose frequencies may depend on each call's length (frequencies::rope decides whether they do:
// HunYuan's "dynamic" with an alpha is fixed NTK).
bool RotaryEmbeddingImpl::per_call_scaling() const {
  const auto& type = scaling_.rope_type;
  return type == "dynamic" || type == "longrope";
}

at::Tensor RotaryEmbeddingImpl::inv_freq(std::optional<int64_t> seq_len) const {
  if (!per_call_scaling() || !seq_len) return inv_freq_;
  return frequencies::rope(rotary_dim_, base_, scaling_, seq_len).inv_freq.to(inv_freq_.device());
}

// The length as a 0-d int64 tensor on q's device, computed there: max position + 1, the longest packed sequence, or
// the sequence dimension, plus offset.
at::Tensor RotaryEmbeddingImpl::seq_len_of(const at::Tensor& q, const std::optional<at::Tensor>& positions,
                                           int64_t offset, const std::optional<at::Tensor>& cu_seqlens) const {
  const auto on_q = q.options().dtype(at::kLong);
  if (positions && positions->numel() > 0) return positions->max().to(at::kLong).add(offset + 1);
  if (positions) return at::scalar_tensor(offset, on_q);
  if (cu_seqlens && cu_seqlens->numel() > 1) {
    const auto lengths = cu_seqlens->slice(0, 1).sub(cu_seqlens->slice(0, 0, -1));
    return lengths.max().to(at::kLong).add(offset);
  }
  const auto order = rope_dim_order(parse_rope_format("nn.RotaryEmbedding", format_));
  return at::scalar_tensor(q.size(order[1]) + offset, on_q);
}

at::Tensor RotaryEmbeddingImpl::inv_freq_for(const at::Tensor& q, const std::optional<at::Tensor>& positions,
                                             int64_t offset, const std::optional<at::Tensor>& cu_seqlens) {
  if (inv_freq_.device() != q.device()) inv_freq_ = inv_freq_.to(q.device());
  // A per-call length stays a tensor: on the GPU the frequencies are formed there, without a host read.
  return per_call_scaling() ? frequencies::rope_for_length_op(rotary_dim_, base_, scaling_,
                                                              seq_len_of(q, positions, offset, cu_seqlens))
                            : inv_freq_;
}

std::tuple<at::Tensor, at::Tensor> RotaryEmbeddingImpl::forward(const at::Tensor& q, const at::Tensor& k,
                                                                const std::optional<at::Tensor>& positions,
                                                                int64_t offset,
                                                                const std::optional<at::Tensor>& cu_seqlens) {
  return rope_qk(q, k, positions, inv_freq_for(q, positions, offset, cu_seqlens), attention_scale_, layout_, format_,
                 offset, cu_seqlens);
}

QKNormRotaryEmbeddingImpl::QKNormRotaryEmbeddingImpl(int64_t head_dim, std::optional<int64_t> rotary_dim,
                                                     double base, std::string layout,
                                                     frequencies::RopeScaling scaling, std::string format,
                                                     double eps, std::string norm, std::optional<int64_t> q_norm_dim,
                                                     std::optional<int64_t> k_norm_dim)
    : eps(eps), norm(std::move(norm)) {
  constexpr const char* op = "nn.QKNormRotaryEmbedding";
  parse_qk_norm(op, this->norm);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "posenc.", op, ": eps must be finite and >= 0, got ", eps);
  const int64_t q_width = q_norm_dim.value_or(head_dim), k_width = k_norm_dim.value_or(head_dim);
  for (const auto& [name, width] : {std::pair{"q_norm_dim", q_width}, std::pair{"k_norm_dim", k_width}}) {
    TORCH_CHECK(head_dim > 0 && width > 0 && width % head_dim == 0, "posenc.", op, ": ", name, " ", width,
                " must be head_dim ", head_dim, " (each head) or heads * head_dim (all heads of a token)");
  }
  rotary = register_module("rotary", RotaryEmbedding(head_dim, rotary_dim, base, std::move(layout),
                                                     std::move(scaling), std::move(format)));
  q_weight = register_parameter("q_weight", at::empty({q_width}));
  k_weight = register_parameter("k_weight", at::empty({k_width}));
  reset_parameters();
}

// The identity scale: w = 1, or w = 0 where the scale is 1 + w (Gemma).
void QKNormRotaryEmbeddingImpl::reset_parameters() {
  at::NoGradGuard no_grad;
  const double value = parse_qk_norm("nn.QKNormRotaryEmbedding", norm) == QkNorm::Gemma ? 0.0 : 1.0;
  q_weight.fill_(value);
  k_weight.fill_(value);
}

std::tuple<at::Tensor, at::Tensor> QKNormRotaryEmbeddingImpl::forward(const at::Tensor& q, const at::Tensor& k,
                                                                      const std::optional<at::Tensor>& positions,
                                                                      int64_t offset,
                                                                      const std::optional<at::Tensor>& cu_seqlens) {
  return qk_norm_rope(q, k, q_weight, k_weight, positions, rotary->inv_freq_for(q, positions, offset, cu_seqlens),
                      eps, norm, rotary->attention_scale(), rotary->layout(), rotary->format(), offset, cu_seqlens);
}

}  // namespace nn
}  // namespace posenc
