// Autograd of mrope_positions: integer outputs, nothing to differentiate.
#include <posenc/multiaxis.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

namespace posenc {
namespace {

std::tuple<at::Tensor, at::Tensor> mrope_positions_autograd(const at::Tensor& token_types,
                                                            const std::optional<at::Tensor>& image_grid_thw,
                                                            const std::optional<at::Tensor>& video_grid_thw,
                                                            const std::optional<at::Tensor>& attention_mask,
                                                            int64_t spatial_merge_size,
                                                            std::optional<double> tokens_per_second,
                                                            const std::optional<at::Tensor>& second_per_grid_ts,
                                                            bool split_video_frames) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return mrope_positions(token_types, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size,
                         tokens_per_second, second_per_grid_ts, split_video_frames);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) { m.impl("mrope_positions", TORCH_FN(mrope_positions_autograd)); }

}  // namespace posenc
