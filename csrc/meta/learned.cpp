// Meta kernels of the learned family: the same checks and output metadata as CPU, no data read.
#include "common/learned.h"
#include "families.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace posenc {
namespace {

at::Tensor learned_meta(const at::Tensor& weight, const at::Tensor& positions, int64_t offset,
                        std::optional<int64_t> padding_idx) {
  check_learned(weight, positions, padding_idx);
  auto sizes = positions.sym_sizes().vec();
  sizes.push_back(weight.sym_size(1));
  return at::empty_symint(sizes, weight.options());
}

at::Tensor add_learned_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& positions,
                            int64_t offset, std::optional<int64_t> padding_idx) {
  check_add_learned(x, weight, positions, padding_idx);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor embed_learned_meta(const at::Tensor& tokens, const at::Tensor& token_weight, const at::Tensor& pos_weight,
                              const std::optional<at::Tensor>& positions, double token_scale,
                              std::optional<int64_t> padding_idx, int64_t offset,
                              std::optional<int64_t> pos_padding_idx) {
  check_embed_learned(tokens, token_weight, pos_weight, positions, padding_idx, pos_padding_idx);
  auto sizes = tokens.sym_sizes().vec();
  sizes.push_back(token_weight.sym_size(1));
  return at::empty_symint(sizes, token_weight.options());
}

at::Tensor make_positions_meta(const at::Tensor& tokens, int64_t padding_idx) {
  check_make_positions(tokens, padding_idx);
  return at::empty_symint(tokens.sym_sizes(), tokens.options().dtype(at::kLong));
}

at::Tensor positions_from_mask_meta(const at::Tensor& attention_mask, int64_t pad_position) {
  check_positions_from_mask(attention_mask);
  return at::empty_symint(attention_mask.sym_sizes(), attention_mask.options().dtype(at::kLong));
}

// The grid may be symbolic (an image's size under torch.compile and torch.export), and the output's rows with it.
at::Tensor resample_learned_meta(const at::Tensor& weight, at::IntArrayRef source_grid, c10::SymIntArrayRef grid,
                                 c10::string_view mode, bool align_corners, bool antialias,
                                 std::optional<at::ArrayRef<double>> scale_factor, int64_t num_prefix_tokens) {
  check_resample_learned(weight, source_grid, grid, mode, scale_factor, num_prefix_tokens);
  return at::empty_symint({grid_tokens(grid, num_prefix_tokens), weight.sym_size(1)}, weight.options());
}

at::Tensor add_resampled_learned_meta(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef source_grid,
                                      c10::SymIntArrayRef grid, c10::string_view mode, bool align_corners,
                                      bool antialias, std::optional<at::ArrayRef<double>> scale_factor,
                                      int64_t num_prefix_tokens) {
  check_add_resampled_learned(x, weight, source_grid, grid, mode, scale_factor, num_prefix_tokens);
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor resample_learned_backward_meta(const at::Tensor& grad, at::IntArrayRef source_grid,
                                          c10::SymIntArrayRef grid, c10::string_view mode, bool align_corners,
                                          bool antialias, std::optional<at::ArrayRef<double>> scale_factor,
                                          int64_t num_prefix_tokens) {
  check_resample_learned_backward(grad, source_grid, grid, mode, scale_factor, num_prefix_tokens);
  return at::empty_symint({c10::SymInt(grid_tokens(source_grid, num_prefix_tokens)), grad.sym_size(-1)},
                          grad.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) { POSENC_LEARNED_OPS(POSENC_IMPL_SUFFIXED, _meta) }

}  // namespace posenc
