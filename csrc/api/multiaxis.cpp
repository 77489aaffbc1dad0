#include <posenc/multiaxis.h>
#include <posenc/rope.h>
#include <posenc/sinusoidal.h>

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

SinusoidalGridEncodingImpl::SinusoidalGridEncodingImpl(int64_t dim, std::string convention, double base,
                                                       int64_t num_prefix_tokens, std::optional<int64_t> base_size,
                                                       std::vector<double> interpolation_scale,
                                                       std::optional<int64_t> max_size, double x_scale)
    : n_axes_(convention == "cogvideox" ? 3 : 2), num_prefix_tokens_(num_prefix_tokens), base_size_(base_size),
      interpolation_scale_(std::move(interpolation_scale)), max_size_(max_size), x_scale_(x_scale) {
  constexpr const char* op = "posenc.nn.SinusoidalGridEncoding";
  auto freqs = frequencies::grid_sinusoidal(dim, convention, base);  // checks them
  if (n_axes_ == 3 && interpolation_scale_.size() == 2) {  // diffusers' (temporal, spatial)
    interpolation_scale_.push_back(interpolation_scale_[1]);
  }
  const auto scales = static_cast<int64_t>(interpolation_scale_.size());
  TORCH_CHECK_VALUE(scales == 1 || scales == n_axes_, op, ": interpolation_scale has ", scales,
                    " values; give one, one per axis (", n_axes_, ")", n_axes_ == 3 ? " or (temporal, spatial)" : "");
  TORCH_CHECK_VALUE(scales == 1 || !base_size_, op, ": base_size takes one interpolation_scale, got ",
                    c10::ArrayRef<double>(interpolation_scale_));
  TORCH_CHECK_VALUE(num_prefix_tokens >= 0, op, ": num_prefix_tokens must not be negative, got ", num_prefix_tokens);
  inv_freq_ = std::move(freqs.inv_freq);
  pair_axis_ = std::move(freqs.pair_axis);
  layout_ = std::move(freqs.layout);
}

at::Tensor SinusoidalGridEncodingImpl::positions(const std::vector<int64_t>& grid) const {
  const auto axes = static_cast<int64_t>(grid.size());
  const int64_t spatial = axes - 2;  // the first spatial axis
  std::optional<std::vector<int64_t>> crop_from;
  if (max_size_) {
    crop_from = grid;
    for (int64_t a = spatial; a < axes; ++a) (*crop_from)[a] = *max_size_;
  }
  if (base_size_) {
    // diffusers: index / (size / base_size) / interpolation_scale, size that of the grid the table is made for
    const auto& sizes = crop_from ? *crop_from : grid;
    std::vector<double> scale(axes, 1.0);
    for (int64_t a = spatial; a < axes; ++a) scale[a] = static_cast<double>(sizes[a]) / static_cast<double>(*base_size_);
    return grid_positions(grid, crop_from, scale, interpolation_scale_[0]);
  }
  if (interpolation_scale_.size() > 1) return grid_positions(grid, crop_from, interpolation_scale_, 1.0);
  return grid_positions(grid, crop_from, std::nullopt, interpolation_scale_[0]);
}

at::Tensor SinusoidalGridEncodingImpl::forward(const at::Tensor& x, const std::vector<int64_t>& grid) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(grid.size()) == n_axes_, "posenc.nn.SinusoidalGridEncoding: grid ",
                    c10::IntArrayRef(grid), " needs ", n_axes_, " axes");
  if (inv_freq_.device() != x.device()) {
    inv_freq_ = inv_freq_.to(x.device());
    pair_axis_ = pair_axis_.to(x.device());
  }
  return add_sinusoidal(x, positions(grid).to(x.device()), inv_freq_, x_scale_, layout_, 0, pair_axis_,
                        num_prefix_tokens_);
}

}  // namespace nn
}  // namespace posenc
