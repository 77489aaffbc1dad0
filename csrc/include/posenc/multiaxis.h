#pragma once
// Multi-axis rotary embeddings: image patches rotate by (row, column), video by (time, row, column), the text
// of multimodal models by Qwen2-VL's M-RoPE, diffusion transformers by Flux's axes. The rotation itself is
// posenc::rope / rope_qk with pair_axis; this header holds the frequency builders, the position grids and the
// modules. Twins of Python's posenc.frequencies, posenc.functional and posenc.nn.
#include <posenc/frequencies.h>

#include <posenc/find_op.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace posenc {
namespace frequencies {

// The frequencies of a multi-axis rotation: inv_freq float64 [pairs] and pair_axis int64 [pairs], the axis
// whose position drives each frequency pair (pass both to rope / rope_qk).
struct AxisFrequencies {
  at::Tensor inv_freq;
  at::Tensor pair_axis;
};

// Per-axis widths with their own frequencies: axis a rotates axes_dim[a] channels, its axes_dim[a] / 2 pairs
// following those of the axes before it, with inv_freq = base_a^(-2i / axes_dim[a]) (rope(axes_dim[a], base_a)).
// bases: one per axis, or one for all. Flux: axes_dim {16, 56, 56}, base 10000, layout "gptj".
AxisFrequencies multiaxis(const std::vector<int64_t>& axes_dim, const std::vector<double>& bases = {10000.0});

// The axial scheme of vision transformers: rotary_dim split evenly among n_axes axes (rotary_dim must divide
// by 2 * n_axes), every axis with the frequencies base^(-2 n_axes i / rotary_dim). Positions come as
// [n_axes, tokens], e.g. image_positions (row, column): the first rotary_dim / (2 n_axes) pairs follow the rows.
AxisFrequencies axial(int64_t rotary_dim, int64_t n_axes = 2, double base = 10000.0);

// M-RoPE's axis of each frequency pair, from mrope_section (pairs per axis, summing to the pair count).
// Consecutive sections (Qwen2-VL, Qwen2.5-VL): pairs [0, s0) follow axis 0, the next s1 axis 1, ...
// Interleaved (Qwen3-VL): with n axes, pair i follows axis a = i mod n when a > 0 and i < n * s_a, else axis 0.
at::Tensor mrope_pair_axis(const std::vector<int64_t>& mrope_section, bool interleaved = false);

// M-RoPE frequencies: those of rope(rotary_dim, base) with mrope_pair_axis(mrope_section, interleaved).
AxisFrequencies mrope(int64_t rotary_dim, const std::vector<int64_t>& mrope_section, double base = 10000.0,
                      bool interleaved = false);

// A multi-axis sincos table's convention (the fixed encodings added to image and video patch tokens): the
// frequencies and pair axes for sinusoidal / add_sinusoidal with pair_axis, and the layout of their channels.
// Each axis block of n pairs has inv_freq 1 / base^(k / n), k < n. Positions: (row, column) for 2-D conventions,
// (time, row, column) for 3-D ones.
//   "mae"              MAE, DiT, diffusers' 2-D table (PixArt, SD3): dim / 4 pairs on the column, then dim / 4 on
//                      the row; "half_per_axis" ([sin col, cos col, sin row, cos row]).
//   "timm"             timm's build_sincos2d_pos_embed: row, then column; "half" ([sin row, sin col, cos row, cos col]).
//   "timm_interleaved" the same with interleave_sin_cos: "half_per_axis" ([sin row, cos row, sin col, cos col]).
//   "cogvideox"        diffusers' 3-D table: dim / 8 pairs on time, 3 dim / 16 on the column, 3 dim / 16 on the row;
//                      "half_per_axis".
struct GridSinusoidal {
  at::Tensor inv_freq;
  at::Tensor pair_axis;
  std::string layout;
};
GridSinusoidal grid_sinusoidal(int64_t dim, std::string_view convention = "mae", double base = 10000.0);

}  // namespace frequencies

// Positions of an image's patches in row-major order, [2, height * width]: (row, column).
at::Tensor image_positions(int64_t height, int64_t width,
                           at::TensorOptions options = at::TensorOptions().dtype(at::kLong));

// Real coordinates of a grid's tokens in row-major order, float32 [n_axes, prod(grid)]: axis a at index i is
// (i + start_a) / scale[a] / interpolation_scale, each division rounded to float32, start_a = (crop_from[a] -
// grid[a]) // 2 (a centre crop of a larger grid, SD3's). diffusers' coordinates bit for bit: its 2-D table is
// scale {h / base_size, w / base_size}, its 3-D table scale {temporal, spatial, spatial} interpolation scales.
at::Tensor grid_positions(const std::vector<int64_t>& grid, const std::optional<std::vector<int64_t>>& crop_from = std::nullopt,
                          const std::optional<std::vector<double>>& scale = std::nullopt,
                          double interpolation_scale = 1.0, at::TensorOptions options = {});

// DINOv3's patch coordinates, float32 [2, num_prefix_tokens + height * width]: (row, column) of each patch centre,
// (i + 0.5) / n * 2 - 1 in float32, zeros for the prefix tokens (cls, registers: rotated by nothing). Training
// augmentations, each drawn from `generator` in this order as transformers' augment_patches_center_coordinates
// draws them: shift, both axes plus a uniform value in [-shift, shift]; jitter, each axis times exp(uniform in
// [-log jitter, log jitter]); rescale, both axes times one exp(uniform in [-log rescale, log rescale]).
at::Tensor patch_center_positions(int64_t height, int64_t width, int64_t num_prefix_tokens = 0,
                                  std::optional<double> shift = std::nullopt,
                                  std::optional<double> jitter = std::nullopt,
                                  std::optional<double> rescale = std::nullopt,
                                  std::optional<at::Generator> generator = std::nullopt,
                                  at::TensorOptions options = {});

// Positions of a video's patches, frame by frame in row-major order, [3, frames * height * width]:
// (time, row, column), time = trunc(frame * time_interval) (Qwen2.5-VL: tokens_per_second * seconds per frame).
at::Tensor video_positions(int64_t frames, int64_t height, int64_t width, double time_interval = 1.0,
                           at::TensorOptions options = at::TensorOptions().dtype(at::kLong));

// Qwen2-VL's M-RoPE positions of a batch of text and vision tokens (transformers 5.24's get_rope_index):
// token_types [B, S] is 0 for text, 1 for image and 2 for video tokens (the processor's mm_token_type_ids).
// Text tokens take one running position on all three axes; each run of image (video) tokens is the next grid
// (t, h, w) of image_grid_thw (video_grid_thw) [N, 3], merged spatial_merge_size^2 patches a token: its tokens
// take (start + trunc(frame * interval), start + row, start + column), and the text after it continues at
// start + max(h, w) / spatial_merge_size. Videos' interval is tokens_per_second * second_per_grid_ts[v]
// (1 without tokens_per_second: Qwen2-VL); split_video_frames makes every frame its own grid (Qwen3-VL).
// Tokens outside attention_mask get 0. Returns positions [3, B, S] int64 and rope_deltas [B, 1] (max position
// + 1 - the row's token count: decoding continues at cache length + delta).
inline std::tuple<at::Tensor, at::Tensor> mrope_positions(
    const at::Tensor& token_types, const std::optional<at::Tensor>& image_grid_thw = std::nullopt,
    const std::optional<at::Tensor>& video_grid_thw = std::nullopt,
    const std::optional<at::Tensor>& attention_mask = std::nullopt, int64_t spatial_merge_size = 2,
    std::optional<double> tokens_per_second = std::nullopt,
    const std::optional<at::Tensor>& second_per_grid_ts = std::nullopt, bool split_video_frames = false) {
  static const auto op = detail::find_op<decltype(mrope_positions)>("posenc::mrope_positions");
  return op.call(token_types, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size, tokens_per_second,
                 second_per_grid_ts, split_video_frames);
}

namespace nn {

// Rotates q and k by M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL text): forward(q, k, positions, offset, cu_seqlens)
// with positions [3, S], [3, B, S] or [3, T] (mrope_positions: any positions of two or more dimensions lead with
// their axis) or, for text alone, none or [S] ([T]): every axis at the same position, the one-axis rotation.
// Frequencies are float64 members, out of reach of module->to(kBFloat16); they follow q's device.
class MultimodalRotaryEmbeddingImpl : public torch::nn::Module {
 public:
  explicit MultimodalRotaryEmbeddingImpl(int64_t head_dim, std::vector<int64_t> mrope_section, double base = 10000.0,
                                         bool interleaved = false, std::string layout = "neox",
                                         frequencies::RopeScaling scaling = {}, std::string format = "bshd");
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                             const std::optional<at::Tensor>& positions = std::nullopt,
                                             int64_t offset = 0,
                                             const std::optional<at::Tensor>& cu_seqlens = std::nullopt);
  const at::Tensor& inv_freq() const { return inv_freq_; }
  const at::Tensor& pair_axis() const { return pair_axis_; }
  double attention_scale() const { return attention_scale_; }

 private:
  std::string layout_;
  std::string format_;
  at::Tensor inv_freq_;
  at::Tensor pair_axis_;
  double attention_scale_;
};
TORCH_MODULE(MultimodalRotaryEmbedding);

// Rotates q and k by several position axes (axial RoPE of vision transformers, Flux's axes):
// forward(q, k, positions [n_axes, S], [n_axes, B, S] or [n_axes, T], offset, cu_seqlens). axes_dim empty: the
// head's rotary_dim channels split evenly among n_axes axes (frequencies::axial); else frequencies::multiaxis.
class AxialRotaryEmbeddingImpl : public torch::nn::Module {
 public:
  explicit AxialRotaryEmbeddingImpl(int64_t head_dim, int64_t n_axes = 2, double base = 10000.0,
                                    std::string layout = "neox", std::string format = "bshd",
                                    std::vector<int64_t> axes_dim = {});
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                             int64_t offset = 0,
                                             const std::optional<at::Tensor>& cu_seqlens = std::nullopt);
  const at::Tensor& inv_freq() const { return inv_freq_; }
  const at::Tensor& pair_axis() const { return pair_axis_; }

 private:
  std::string layout_;
  std::string format_;
  at::Tensor inv_freq_;
  at::Tensor pair_axis_;
};
TORCH_MODULE(AxialRotaryEmbedding);

// x * x_scale + PE for the patch tokens of an image or video, a fixed 2-D / 3-D sincos table in a convention of
// frequencies::grid_sinusoidal, added by add_sinusoidal: forward(x [B, num_prefix_tokens + prod(grid), dim], grid
// {h, w} or {t, h, w}); the prefix tokens get no encoding. Coordinates (grid_positions): index / (size / base_size)
// / interpolation_scale on each spatial axis with base_size (PixArt, SD3), index / interpolation_scale otherwise
// (one value, one per axis, or for video {temporal, spatial} as CogVideoX takes them); max_size: the table of a max_size square
// grid centre-cropped to grid (SD3's pos_embed_max_size). Twin of Python's posenc.nn.SinusoidalGridEncoding.
class SinusoidalGridEncodingImpl : public torch::nn::Module {
 public:
  explicit SinusoidalGridEncodingImpl(int64_t dim, std::string convention = "mae", double base = 10000.0,
                                      int64_t num_prefix_tokens = 0, std::optional<int64_t> base_size = std::nullopt,
                                      std::vector<double> interpolation_scale = {1.0},
                                      std::optional<int64_t> max_size = std::nullopt, double x_scale = 1.0);
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& grid);
  // The coordinates [n_axes, prod(grid)] (float32) of the grid's tokens.
  at::Tensor positions(const std::vector<int64_t>& grid) const;
  const at::Tensor& inv_freq() const { return inv_freq_; }
  const at::Tensor& pair_axis() const { return pair_axis_; }

 private:
  int64_t n_axes_;
  int64_t num_prefix_tokens_;
  std::optional<int64_t> base_size_;
  std::vector<double> interpolation_scale_;
  std::optional<int64_t> max_size_;
  double x_scale_;
  std::string layout_;
  at::Tensor inv_freq_;
  at::Tensor pair_axis_;
};
TORCH_MODULE(SinusoidalGridEncoding);

}  // namespace nn
}  // namespace posenc
