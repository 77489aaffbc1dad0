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
