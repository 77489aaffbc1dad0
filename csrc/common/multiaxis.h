#pragma once
// Checks of mrope_positions, shared by its CPU and Meta kernels (metadata only, SymInt-aware).
#include "common/checks.h"

namespace posenc {

// token_types [B, S] (integer), grids [N, 3] (integer), attention_mask [B, S] (any dtype: nonzero = real token),
// second_per_grid_ts [num_videos] (integer or floating).
inline void check_mrope_positions(const at::Tensor& token_types, const std::optional<at::Tensor>& image_grid_thw,
                                  const std::optional<at::Tensor>& video_grid_thw,
                                  const std::optional<at::Tensor>& attention_mask, int64_t spatial_merge_size,
                                  const std::optional<at::Tensor>& second_per_grid_ts) {
  constexpr const char* op = "mrope_positions";
  check_defined(op, "token_types", token_types);
  TORCH_CHECK(at::isIntegralType(token_types.scalar_type(), /*includeBool=*/false), "posenc.", op,
              ": token_types must be an integer tensor (0 text, 1 image, 2 video), got ", token_types.scalar_type());
  TORCH_CHECK(token_types.dim() == 2, "posenc.", op, ": token_types must be 2-D [batch, seq], got shape ",
              token_types.sym_sizes());
  const std::pair<const char*, const std::optional<at::Tensor>*> grids[] = {{"image_grid_thw", &image_grid_thw},
                                                                             {"video_grid_thw", &video_grid_thw}};
  for (const auto& [name, grid] : grids) {
    if (!grid->has_value()) continue;
    check_index(op, name, **grid);
    check_same_device(op, name, **grid, token_types);
    TORCH_CHECK((*grid)->dim() == 2 && (*grid)->sym_size(1) == 3, "posenc.", op, ": ", name,
                " must be [num_grids, 3] (t, h, w), got shape ", (*grid)->sym_sizes());
  }
  if (attention_mask) {
    check_defined(op, "attention_mask", *attention_mask);
    check_same_device(op, "attention_mask", *attention_mask, token_types);
    TORCH_CHECK(attention_mask->sym_sizes().equals(token_types.sym_sizes()), "posenc.", op,
                ": attention_mask has shape ", attention_mask->sym_sizes(), " but token_types has shape ", token_types.sym_sizes());
  }
  TORCH_CHECK(spatial_merge_size >= 1, "posenc.", op, ": spatial_merge_size must be at least 1, got ",
              spatial_merge_size);
  if (second_per_grid_ts) {
    check_defined(op, "second_per_grid_ts", *second_per_grid_ts);
    check_same_device(op, "second_per_grid_ts", *second_per_grid_ts, token_types);
    TORCH_CHECK(second_per_grid_ts->dim() == 1, "posenc.", op,
                ": second_per_grid_ts must be 1-D [num_videos], got shape ", second_per_grid_ts->sym_sizes());
    const auto dtype = second_per_grid_ts->scalar_type();
    TORCH_CHECK(at::isFloatingType(dtype) || at::isIntegralType(dtype, /*includeBool=*/false), "posenc.", op,
                ": second_per_grid_ts must be a floating or integer tensor, got ", dtype);
  }
}

}  // namespace posenc
