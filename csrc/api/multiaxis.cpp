#include <posenc/multiaxis.h>
#include <posenc/rope.h>

#include "common/rope.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace posenc {
namespace nn {

MultimodalRotaryEmbeddingImpl::MultimodalRotaryEmbeddingImpl(int64_t head_dim, std::vector<int64_t> mrope_section,
                                                             double base, bool interleaved, std::string layout,
                                                             frequencies::RopeScaling scaling, std::string format)
    : layout_(std::move(layout)), format_(std::move(format)) {
  constexpr const char* op = "nn.MultimodalRotaryEmbedding";
  parse_rope_layout(op, layout_);
  parse_rope_format(op, format_);
  const auto& type = scaling.rope_type;
  TORCH_CHECK(type != "dynamic" && type != "longrope", "posenc.", op, ": rope_type \"", type,
              "\" picks its frequencies per call, which M-RoPE does not do; use a fixed scaling type");
  pair_axis_ = frequencies::mrope_pair_axis(mrope_section, interleaved);
  TORCH_CHECK(pair_axis_.size(0) * 2 == head_dim, "posenc.", op, ": mrope_section ", c10::IntArrayRef(mrope_section),
              " holds ", pair_axis_.size(0), " frequency pairs but head_dim ", head_dim, " has ", head_dim / 2);
  const auto freqs = frequencies::rope(head_dim, base, scaling);
  inv_freq_ = freqs.inv_freq;
  attention_scale_ = freqs.attention_scale;
}

std::tuple<at::Tensor, at::Tensor> MultimodalRotaryEmbeddingImpl::forward(const at::Tensor& q, const at::Tensor& k,
                                                                          const std::optional<at::Tensor>& positions,
                                                                          int64_t offset,
                                                                          const std::optional<at::Tensor>& cu_seqlens) {
  if (inv_freq_.device() != q.device()) {
    inv_freq_ = inv_freq_.to(q.device());
    pair_axis_ = pair_axis_.to(q.device());
  }
  // Positions of two or more dimensions lead with their axis; [S] ([T]) or none are text alone, every axis
  // at the same position, which is the one-axis rotation.
  const bool per_axis = positions && positions->dim() >= 2;
  return rope_qk(q, k, positions, inv_freq_, attention_scale_, layout_, format_, offset, cu_seqlens,
                 per_axis ? std::optional<at::Tensor>(pair_axis_) : std::nullopt);
}

AxialRotaryEmbeddingImpl::AxialRotaryEmbeddingImpl(int64_t head_dim, int64_t n_axes, double base, std::string layout,
                                                   std::string format, std::vector<int64_t> axes_dim)
    : layout_(std::move(layout)), format_(std::move(format)) {
  constexpr const char* op = "nn.AxialRotaryEmbedding";
  parse_rope_layout(op, layout_);
  parse_rope_format(op, format_);
  const auto freqs =
      axes_dim.empty() ? frequencies::axial(head_dim, n_axes, base) : frequencies::multiaxis(axes_dim, {base});
  TORCH_CHECK(freqs.inv_freq.size(0) * 2 <= head_dim, "posenc.", op, ": axes_dim ", c10::IntArrayRef(axes_dim),
              " rotate ", freqs.inv_freq.size(0) * 2, " channels, more than head_dim ", head_dim);
  inv_freq_ = freqs.inv_freq;
  pair_axis_ = freqs.pair_axis;
}

std::tuple<at::Tensor, at::Tensor> AxialRotaryEmbeddingImpl::forward(const at::Tensor& q, const at::Tensor& k,
                                                                     const at::Tensor& positions, int64_t offset,
                                                                     const std::optional<at::Tensor>& cu_seqlens) {
  if (inv_freq_.device() != q.device()) {
    inv_freq_ = inv_freq_.to(q.device());
    pair_axis_ = pair_axis_.to(q.device());
  }
  return rope_qk(q, k, positions, inv_freq_, 1.0, layout_, format_, offset, cu_seqlens, pair_axis_);
}

}  // namespace nn
}  // namespace posenc
