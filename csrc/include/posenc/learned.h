#pragma once
// Learned absolute position embeddings and fused input embeddings.
//
// A position p reads row p + offset of its table; every row must lie in [0, L_max), L_max = the
// table's row count, or the op raises an error naming the op, the position and L_max. Positions are
// absent (offset + arange(S)), [S] (shared by every leading index) or one per row; int64 or int32.
#include <posenc/find_op.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string_view>

namespace posenc {

// weight[positions + offset]: shape positions.shape + [D]. Gradient into weight; the padding_idx row
// gets none.
inline at::Tensor learned(const at::Tensor& weight, const at::Tensor& positions, int64_t offset = 0,
                          std::optional<int64_t> padding_idx = std::nullopt) {
  static const auto op = detail::find_op<decltype(learned)>("posenc::learned");
  return op.call(weight, positions, offset, padding_idx);
}

// x [..., S, D] + weight[positions + offset]. Gradients into x and weight (not its padding_idx row).
inline at::Tensor add_learned(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& positions = std::nullopt, int64_t offset = 0,
                              std::optional<int64_t> padding_idx = std::nullopt) {
  static const auto op = detail::find_op<decltype(add_learned)>("posenc::add_learned");
  return op.call(x, weight, positions, offset, padding_idx);
}

// token_weight[tokens] * token_scale + pos_weight[positions + offset] in one pass (GPT-2/BERT wte + wpe).
// Gradients into both tables; padding_idx is a row of token_weight, pos_padding_idx one of pos_weight,
// and neither receives a gradient.
inline at::Tensor embed_learned(const at::Tensor& tokens, const at::Tensor& token_weight, const at::Tensor& pos_weight,
                                const std::optional<at::Tensor>& positions = std::nullopt, double token_scale = 1.0,
                                std::optional<int64_t> padding_idx = std::nullopt, int64_t offset = 0,
                                std::optional<int64_t> pos_padding_idx = std::nullopt) {
  static const auto op = detail::find_op<decltype(embed_learned)>("posenc::embed_learned");
  return op.call(tokens, token_weight, pos_weight, positions, token_scale, padding_idx, offset, pos_padding_idx);
}

// fairseq's make_positions over the last dimension: padding keeps padding_idx, real tokens are
// numbered padding_idx + 1, padding_idx + 2, ... (int64).
inline at::Tensor make_positions(const at::Tensor& tokens, int64_t padding_idx) {
  static const auto op = detail::find_op<decltype(make_positions)>("posenc::make_positions");
  return op.call(tokens, padding_idx);
}

// Positions of a left-padded batch from its attention mask [..., S] (nonzero = real token): real tokens
// count from 0 (cumsum(mask) - 1), masked ones get pad_position (int64). OPT: pad_position = -1 with
// offset 2, so padding reads row 1. With a cache, the new tokens' positions are the last S columns.
inline at::Tensor positions_from_mask(const at::Tensor& attention_mask, int64_t pad_position = 0) {
  static const auto op = detail::find_op<decltype(positions_from_mask)>("posenc::positions_from_mask");
  return op.call(attention_mask, pad_position);
}

// A learned table of a source patch grid resampled to another grid, as vision transformers (ViT, DINOv2, SigLIP;
// timm's resample_abs_pos_embed) resize theirs to an image's grid. weight [P + Hs * Ws, D]: P = num_prefix_tokens
// rows (cls, registers) kept as they are, then the grid rows, row-major over source_grid (Hs, Ws). Returns
// [P + H * W, D] for grid (H, W): the grid rows interpolated as F.interpolate(mode, align_corners, antialias,
// scale_factor with recompute_scale_factor=False) interpolates an image ("bicubic": A = -0.75, clamped border taps;
// "bilinear"; antialias: the separable filter, cubic a = -0.5 or triangle, widened by the downscale, normalized).
// The weights and sums are float64, rounded once to weight's dtype. Gradient into weight
// (resample_learned_backward).
inline at::Tensor resample_learned_symint(const at::Tensor& weight, at::IntArrayRef source_grid,
                                          c10::SymIntArrayRef grid, std::string_view mode = "bicubic",
                                          bool align_corners = false, bool antialias = false,
                                          std::optional<at::ArrayRef<double>> scale_factor = std::nullopt,
                                          int64_t num_prefix_tokens = 0) {
  static const auto op = detail::find_op<decltype(resample_learned_symint)>("posenc::resample_learned");
  return op.call(weight, source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens);
}

inline at::Tensor resample_learned(const at::Tensor& weight, at::IntArrayRef source_grid, at::IntArrayRef grid,
                                   std::string_view mode = "bicubic", bool align_corners = false,
                                   bool antialias = false,
                                   std::optional<at::ArrayRef<double>> scale_factor = std::nullopt,
                                   int64_t num_prefix_tokens = 0) {
  return resample_learned_symint(weight, source_grid, c10::fromIntArrayRefSlow(grid), mode, align_corners, antialias,
                                 scale_factor, num_prefix_tokens);
}

// x [..., P + H * W, D] + resample_learned(weight, ...) (broadcast over the leading dimensions), in float32 maths
// (float64 for float64) of x and the table rounded to x's dtype, rounded once. Gradients into x and weight.
inline at::Tensor add_resampled_learned_symint(const at::Tensor& x, const at::Tensor& weight,
                                               at::IntArrayRef source_grid, c10::SymIntArrayRef grid,
                                               std::string_view mode = "bicubic", bool align_corners = false,
                                               bool antialias = false,
                                               std::optional<at::ArrayRef<double>> scale_factor = std::nullopt,
                                               int64_t num_prefix_tokens = 0) {
  static const auto op = detail::find_op<decltype(add_resampled_learned_symint)>("posenc::add_resampled_learned");
  return op.call(x, weight, source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens);
}

inline at::Tensor add_resampled_learned(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef source_grid,
                                        at::IntArrayRef grid, std::string_view mode = "bicubic",
                                        bool align_corners = false, bool antialias = false,
                                        std::optional<at::ArrayRef<double>> scale_factor = std::nullopt,
                                        int64_t num_prefix_tokens = 0) {
  return add_resampled_learned_symint(x, weight, source_grid, c10::fromIntArrayRefSlow(grid), mode, align_corners,
                                      antialias, scale_factor, num_prefix_tokens);
}

// The adjoint of resample_learned: grad [..., P + H * W, D] summed over its leading dimensions (in order), then the
// transposed interpolation, to [P + Hs * Ws, D] (prefix rows straight through); float64, rounded once, the same bits
// for any thread count. Differentiable (its derivative is resample_learned).
inline at::Tensor resample_learned_backward_symint(
    const at::Tensor& grad, at::IntArrayRef source_grid, c10::SymIntArrayRef grid, std::string_view mode = "bicubic",
    bool align_corners = false, bool antialias = false, std::optional<at::ArrayRef<double>> scale_factor = std::nullopt,
    int64_t num_prefix_tokens = 0) {
  static const auto op =
      detail::find_op<decltype(resample_learned_backward_symint)>("posenc::resample_learned_backward");
  return op.call(grad, source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens);
}

inline at::Tensor resample_learned_backward(const at::Tensor& grad, at::IntArrayRef source_grid, at::IntArrayRef grid,
                                            std::string_view mode = "bicubic", bool align_corners = false,
                                            bool antialias = false,
                                            std::optional<at::ArrayRef<double>> scale_factor = std::nullopt,
                                            int64_t num_prefix_tokens = 0) {
  return resample_learned_backward_symint(grad, source_grid, c10::fromIntArrayRefSlow(grid), mode, align_corners,
                                          antialias, scale_factor, num_prefix_tokens);
}

namespace nn {

// x [..., S, dim] + weight[positions + offset]: a [max_positions + offset, dim] table whose first
// `offset` rows hold no position of their own (OPT: offset 2). weight ~ N(0, init_std^2) (GPT-2, BERT,
// OPT use 0.02) with the padding_idx row zero; that row gets no gradient. forward's offset (the
// length of a cache) adds to the module's.
class LearnedPositionalEmbeddingImpl : public torch::nn::Module {
 public:
  LearnedPositionalEmbeddingImpl(int64_t max_positions, int64_t dim, std::optional<int64_t> padding_idx = std::nullopt,
                                 int64_t offset = 0, double init_std = 0.02);
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& positions = std::nullopt,
                     int64_t offset = 0);
  void reset_parameters();

  at::Tensor weight;
  std::optional<int64_t> padding_idx;
  int64_t offset;
  double init_std;
};
TORCH_MODULE(LearnedPositionalEmbedding);

// token_weight[tokens] * token_scale + pos_weight[positions + offset] (GPT-2/BERT input embeddings).
// Tables as in LearnedPositionalEmbedding: N(0, init_std^2), zero padding_idx row of token_weight.
class LearnedEmbeddingImpl : public torch::nn::Module {
 public:
  LearnedEmbeddingImpl(int64_t num_embeddings, int64_t max_positions, int64_t dim,
                       std::optional<int64_t> padding_idx = std::nullopt, double token_scale = 1.0,
                       int64_t offset = 0, double init_std = 0.02);
  at::Tensor forward(const at::Tensor& tokens, const std::optional<at::Tensor>& positions = std::nullopt,
                     int64_t offset = 0);
  void reset_parameters();

  at::Tensor token_weight;
  at::Tensor pos_weight;
  std::optional<int64_t> padding_idx;
  double token_scale;
  int64_t offset;
  double init_std;
};
TORCH_MODULE(LearnedEmbedding);

}  // namespace nn
}  // namespace posenc
