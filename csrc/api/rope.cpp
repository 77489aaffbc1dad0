#include <posenc/rope.h>

#include "common/rope.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/where.h>

#include <limits>

namespace posenc {
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

int64_t RotaryEmbeddingImpl::seq_len_of(const at::Tensor& q, const std::optional<at::Tensor>& positions,
                                        int64_t offset, const std::optional<at::Tensor>& cu_seqlens) const {
  if (positions) return positions->numel() == 0 ? offset : positions->max().item<int64_t>() + offset + 1;
  if (cu_seqlens && cu_seqlens->numel() > 1) {
    const auto lengths = cu_seqlens->slice(0, 1).sub(cu_seqlens->slice(0, 0, -1));
    return lengths.max().item<int64_t>() + offset;
  }
  const auto order = rope_dim_order(parse_rope_format("nn.RotaryEmbedding", format_));
  return q.size(order[1]) + offset;
}

std::tuple<at::Tensor, at::Tensor> RotaryEmbeddingImpl::forward(const at::Tensor& q, const at::Tensor& k,
                                                                const std::optional<at::Tensor>& positions,
                                                                int64_t offset,
                                                                const std::optional<at::Tensor>& cu_seqlens) {
  if (inv_freq_.device() != q.device()) inv_freq_ = inv_freq_.to(q.device());
  const auto freq = per_call_scaling() ? inv_freq(seq_len_of(q, positions, offset, cu_seqlens)) : inv_freq_;
  return rope_qk(q, k, positions, freq, attention_scale_, layout_, format_, offset, cu_seqlens);
}

}  // namespace nn
}  // namespace posenc
