// Meta kernel of mrope_positions: its checks and output metadata ([3, B, S] and [B, 1], int64), no data read.
#include "common/multiaxis.h"
#include "families.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

namespace posenc {
namespace {

std::tuple<at::Tensor, at::Tensor> mrope_positions_meta(const at::Tensor& token_types,
                                                        const std::optional<at::Tensor>& image_grid_thw,
                                                        const std::optional<at::Tensor>& video_grid_thw,
                                                        const std::optional<at::Tensor>& attention_mask,
                                                        int64_t spatial_merge_size,
                                                        std::optional<double> tokens_per_second,
                                                        const std::optional<at::Tensor>& second_per_grid_ts,
                                                        bool split_video_frames) {
  check_mrope_positions(token_types, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size,
                        second_per_grid_ts);
  const auto options = token_types.options().dtype(at::kLong);
  const auto batch = token_types.sym_size(0);
  return {at::empty_symint({3, batch, token_types.sym_size(1)}, options), at::empty_symint({batch, 1}, options)};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Meta, m) { POSENC_MULTIAXIS_OPS(POSENC_IMPL_SUFFIXED, _meta) }

}  // namespace posenc
