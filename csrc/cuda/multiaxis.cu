// CUDA kernel of mrope_positions: the CPU op on host copies of its inputs, its outputs copied to their device.
// The op walks runs of tokens and reads every grid and token type, sequential work a few hundred tokens long
// that runs once per batch, not per layer; its output sizes are known, but its errors depend on the data, so
// the data is read either way. The errors are the CPU's, word for word.
#include "common/find_op.h"
#include "common/multiaxis.h"

#include <torch/library.h>

#include <tuple>

namespace posenc::cuda {
namespace {

std::optional<at::Tensor> on_host(const std::optional<at::Tensor>& t) {
  return t ? std::optional<at::Tensor>(t->cpu()) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor> mrope_positions_cuda(const at::Tensor& token_types,
                                                        const std::optional<at::Tensor>& image_grid_thw,
                                                        const std::optional<at::Tensor>& video_grid_thw,
                                                        const std::optional<at::Tensor>& attention_mask,
                                                        int64_t spatial_merge_size,
                                                        std::optional<double> tokens_per_second,
                                                        const std::optional<at::Tensor>& second_per_grid_ts,
                                                        bool split_video_frames) {
  check_mrope_positions(token_types, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size,
                        second_per_grid_ts);  // the devices as given
  static const auto cpu_op = find_op<decltype(mrope_positions_cuda)>("posenc::mrope_positions");
  const auto [positions, deltas] =
      cpu_op.call(token_types.cpu(), on_host(image_grid_thw), on_host(video_grid_thw), on_host(attention_mask),
                      spatial_merge_size, tokens_per_second, on_host(second_per_grid_ts), split_video_frames);
  const auto device = token_types.device();
  return {positions.to(device), deltas.to(device)};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) { m.impl("mrope_positions", TORCH_FN(mrope_positions_cuda)); }

}  // namespace posenc::cuda
