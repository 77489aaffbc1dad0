// CPU op of the multi-axis positions: Qwen2-VL's M-RoPE positions of a text and vision sequence. A loop over
// runs of tokens with a few tensor ops per vision grid, not a hot path.
#include "common/multiaxis.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace posenc {
namespace {

constexpr const char* kOp = "mrope_positions";

// A vision grid (t, h, w) and the row of its *_grid_thw it came from.
struct Grid {
  int64_t t;
  int64_t h;
  int64_t w;
  int64_t source;
};

// Only the first `max_runs` grids can be read (one per run of vision tokens): a split video keeps no more frames.
std::vector<Grid> read_grids(const char* arg, const std::optional<at::Tensor>& grid_thw, bool split_frames,
                             int64_t max_runs) {
  std::vector<Grid> grids;
  if (!grid_thw) return grids;
  const auto values = grid_thw->to(at::kLong).contiguous();
  const int64_t* g = values.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < values.size(0); ++n) {
    const Grid grid{g[3 * n], g[3 * n + 1], g[3 * n + 2], n};
    TORCH_CHECK(grid.t >= 1 && grid.h >= 1 && grid.w >= 1, "posenc.", kOp, ": ", arg, "[", n, "] = (", grid.t, ", ",
                grid.h, ", ", grid.w, ") must be positive");
    if (split_frames) {
      const int64_t frames = std::min(grid.t, max_runs - static_cast<int64_t>(grids.size()));
      grids.insert(grids.end(), std::max<int64_t>(frames, 0), Grid{1, grid.h, grid.w, n});  // Qwen3-VL: a grid a frame
    } else {
      grids.push_back(grid);
    }
  }
  return grids;
}

// The time positions of a video grid's frames: trunc(frame * interval), formed as transformers forms them
// (in the dtype of second_per_grid_ts when it is given), so that the truncation agrees.
std::vector<int64_t> frame_times(int64_t frames, int64_t video, const std::optional<double>& tokens_per_second,
                                 const std::optional<at::Tensor>& second_per_grid_ts) {
  std::vector<int64_t> times(frames);
  if (second_per_grid_ts) {
    TORCH_CHECK(video < second_per_grid_ts->numel(), "posenc.", kOp, ": second_per_grid_ts has ",
                second_per_grid_ts->numel(), " values but video grid ", video, " needs one");
    const double tps = tokens_per_second.value_or(1.0);
    auto interval = (*second_per_grid_ts)[video];
    interval = tps == std::trunc(tps) ? interval.mul(static_cast<int64_t>(tps)) : interval.mul(tps);
    const auto t = at::arange(frames, at::kLong).mul(interval).to(at::kLong).contiguous();
    std::copy(t.const_data_ptr<int64_t>(), t.const_data_ptr<int64_t>() + frames, times.begin());
    return times;
  }
  const double tps = tokens_per_second.value_or(1.0);
  for (int64_t f = 0; f < frames; ++f) times[f] = static_cast<int64_t>(std::trunc(static_cast<double>(f) * tps));
  return times;
}

std::tuple<at::Tensor, at::Tensor> mrope_positions_cpu(const at::Tensor& token_types,
                                                       const std::optional<at::Tensor>& image_grid_thw,
                                                       const std::optional<at::Tensor>& video_grid_thw,
                                                       const std::optional<at::Tensor>& attention_mask,
                                                       int64_t spatial_merge_size,
                                                       std::optional<double> tokens_per_second,
                                                       const std::optional<at::Tensor>& second_per_grid_ts,
                                                       bool split_video_frames) {
  check_mrope_positions(token_types, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size,
                        second_per_grid_ts);
  const int64_t batch = token_types.size(0);
  const int64_t seq = token_types.size(1);
  const auto types = token_types.to(at::kLong).contiguous();
  const int64_t* type = types.const_data_ptr<int64_t>();
  const auto mask = attention_mask ? attention_mask->ne(0).contiguous() : at::Tensor();
  const bool* real = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  const auto images = read_grids("image_grid_thw", image_grid_thw, false, batch * seq);
  const auto videos = read_grids("video_grid_thw", video_grid_thw, split_video_frames, batch * seq);

  auto positions = at::zeros({3, batch, seq}, at::kLong);
  auto deltas = at::zeros({batch, 1}, at::kLong);
  int64_t* pos = positions.mutable_data_ptr<int64_t>();
  const int64_t axis_stride = batch * seq;
  size_t next_image = 0;
  size_t next_video = 0;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<int64_t> tokens;  // the row's real tokens, in order
    for (int64_t s = 0; s < seq; ++s) {
      if (real == nullptr || real[b * seq + s]) tokens.push_back(b * seq + s);
    }
    const auto set = [&](int64_t token, int64_t t, int64_t h, int64_t w) {
      pos[token] = t;
      pos[axis_stride + token] = h;
      pos[2 * axis_stride + token] = w;
    };
    int64_t current = 0;
    int64_t max_position = -1;
    for (size_t start = 0; start < tokens.size();) {
      const int64_t kind = type[tokens[start]];
      size_t end = start;
      while (end < tokens.size() && type[tokens[end]] == kind) ++end;
      const int64_t run = static_cast<int64_t>(end - start);
      TORCH_CHECK(kind >= 0 && kind <= 2, "posenc.", kOp, ": token_types holds ", kind, " at [", b, ", ",
                  tokens[start] - b * seq, "]; expected 0 (text), 1 (image) or 2 (video)");
      if (kind == 0) {
        for (int64_t j = 0; j < run; ++j) set(tokens[start + j], current + j, current + j, current + j);
        max_position = std::max(max_position, current + run - 1);
        current += run;
      } else {
        const bool image = kind == 1;
        const auto& grids = image ? images : videos;
        size_t& next = image ? next_image : next_video;
        TORCH_CHECK(next < grids.size(), "posenc.", kOp, ": row ", b, " has more runs of ", image ? "image" : "video",
                    " tokens than the ", grids.size(), " grids of ", image ? "image_grid_thw" : "video_grid_thw");
        const Grid grid = grids[next++];
        const int64_t height = grid.h / spatial_merge_size;
        const int64_t width = grid.w / spatial_merge_size;
        // A grid whose token count overflows int64 holds more tokens than any run.
        int64_t grid_tokens = 0;
        const bool overflows = c10::mul_overflows(grid.t, height, &grid_tokens) ||
                               c10::mul_overflows(grid_tokens, width, &grid_tokens);
        TORCH_CHECK(!overflows && run == grid_tokens, "posenc.", kOp, ": row ", b, " has a run of ", run, " ",
                    image ? "image" : "video", " tokens at position ", tokens[start] - b * seq, " but its grid (",
                    grid.t, ", ", grid.h, ", ", grid.w, ") with spatial_merge_size ", spatial_merge_size, " has ",
                    overflows ? "more than 2^63" : std::to_string(grid_tokens), " tokens");
        // Images' frames are one apart; videos' are spaced by their interval.
        const auto times = image ? frame_times(grid.t, grid.source, std::nullopt, std::nullopt)
                                 : frame_times(grid.t, grid.source, tokens_per_second, second_per_grid_ts);
        int64_t j = 0;
        for (int64_t f = 0; f < grid.t; ++f) {
          for (int64_t h = 0; h < height; ++h) {
            for (int64_t w = 0; w < width; ++w) set(tokens[start + j++], current + times[f], current + h, current + w);
          }
          max_position = std::max({max_position, current + times[f], current + height - 1, current + width - 1});
        }
        current += std::max(grid.h, grid.w) / spatial_merge_size;
      }
      start = end;
    }
    deltas.mutable_data_ptr<int64_t>()[b] = max_position + 1 - static_cast<int64_t>(tokens.size());
  }
  return {positions, deltas};
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) { m.impl("mrope_positions", TORCH_FN(mrope_positions_cpu)); }

}  // namespace posenc
