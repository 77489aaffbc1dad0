#include <posenc/learned.h>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace posenc {
namespace nn {
namespace {

// nn.Embedding accepts a negative padding_idx counted from the end; the ops take the row itself.
std::optional<int64_t> table_row(const char* module, std::optional<int64_t> padding_idx, int64_t rows) {
  if (!padding_idx) return padding_idx;
  const int64_t row = *padding_idx < 0 ? *padding_idx + rows : *padding_idx;
  TORCH_CHECK(row >= 0 && row < rows, "posenc.nn.", module, ": padding_idx ", *padding_idx, " is outside [-", rows,
              ", ", rows, ")");
  return row;
}

// N(0, std^2) with a zero padding row, without recording the initialisation in autograd.
void init_table(at::Tensor& table, double std, std::optional<int64_t> padding_idx) {
  at::NoGradGuard no_grad;
  table.normal_(0.0, std);
  if (padding_idx) table[*padding_idx].zero_();
}

}  // namespace

LearnedPositionalEmbeddingImpl::LearnedPositionalEmbeddingImpl(int64_t max_positions, int64_t dim,
                                                               std::optional<int64_t> padding_idx, int64_t offset,
                                                               double init_std)
    : offset(offset), init_std(init_std) {
  TORCH_CHECK(max_positions >= 0 && dim >= 0 && offset >= 0, "posenc.nn.LearnedPositionalEmbedding: max_positions ",
              max_positions, ", dim ", dim, " and offset ", offset, " must be non-negative");
  this->padding_idx = table_row("LearnedPositionalEmbedding", padding_idx, max_positions + offset);
  weight = register_parameter("weight", at::empty({max_positions + offset, dim}));
  reset_parameters();
}

void LearnedPositionalEmbeddingImpl::reset_parameters() { init_table(weight, init_std, padding_idx); }

at::Tensor LearnedPositionalEmbeddingImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                                   int64_t offset) {
  return add_learned(x, weight, positions, this->offset + offset, padding_idx);
}

LearnedEmbeddingImpl::LearnedEmbeddingImpl(int64_t num_embeddings, int64_t max_positions, int64_t dim,
                                           std::optional<int64_t> padding_idx, double token_scale, int64_t offset,
                                           double init_std)
    : token_scale(token_scale), offset(offset), init_std(init_std) {
  TORCH_CHECK(num_embeddings >= 0 && max_positions >= 0 && dim >= 0 && offset >= 0,
              "posenc.nn.LearnedEmbedding: num_embeddings ", num_embeddings, ", max_positions ", max_positions,
              ", dim ", dim, " and offset ", offset, " must be non-negative");
  this->padding_idx = table_row("LearnedEmbedding", padding_idx, num_embeddings);
  token_weight = register_parameter("token_weight", at::empty({num_embeddings, dim}));
  pos_weight = register_parameter("pos_weight", at::empty({max_positions + offset, dim}));
  reset_parameters();
}

void LearnedEmbeddingImpl::reset_parameters() {
  init_table(token_weight, init_std, padding_idx);
  init_table(pos_weight, init_std, std::nullopt);
}

at::Tensor LearnedEmbeddingImpl::forward(const at::Tensor& tokens, const std::optional<at::Tensor>& positions,
                                         int64_t offset) {
  return embed_learned(tokens, token_weight, pos_weight, positions, token_scale, padding_idx, this->offset + offset);
}

}  // namespace nn
}  // namespace posenc
