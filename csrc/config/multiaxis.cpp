// Multi-axis rotary's configuration: the frequencies and pair axes of M-RoPE and axial (2-D/3-D) rotary, and the
// position grids of images and video.
#include <posenc/multiaxis.h>
#include <posenc/rope.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/meshgrid.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace posenc {

namespace frequencies {

AxisFrequencies multiaxis(const std::vector<int64_t>& axes_dim, const std::vector<double>& bases) {
  constexpr const char* op = "posenc.frequencies.multiaxis";
  TORCH_CHECK_VALUE(!axes_dim.empty(), op, ": axes_dim is empty; at least one axis is needed");
  TORCH_CHECK_VALUE(bases.size() == 1 || bases.size() == axes_dim.size(), op, ": got ", bases.size(), " bases for ",
                    axes_dim.size(), " axes; give one base or one per axis");
  std::vector<at::Tensor> inv_freq;
  std::vector<at::Tensor> pair_axis;
  for (size_t a = 0; a < axes_dim.size(); ++a) {
    TORCH_CHECK_VALUE(axes_dim[a] >= 2 && axes_dim[a] % 2 == 0, op, ": axes_dim[", a,
                      "] must be even and at least 2, got ", axes_dim[a]);
    inv_freq.push_back(rope(axes_dim[a], bases.size() == 1 ? bases[0] : bases[a]).inv_freq);
    pair_axis.push_back(at::full({axes_dim[a] / 2}, static_cast<int64_t>(a), at::TensorOptions().dtype(at::kLong)));
  }
  return {at::cat(inv_freq), at::cat(pair_axis)};
}

AxisFrequencies axial(int64_t rotary_dim, int64_t n_axes, double base) {
  TORCH_CHECK_VALUE(n_axes >= 1, "posenc.frequencies.axial: n_axes must be at least 1, got ", n_axes);
  TORCH_CHECK_VALUE(rotary_dim > 0 && rotary_dim % (2 * n_axes) == 0, "posenc.frequencies.axial: rotary_dim ",
                    rotary_dim, " must be a positive multiple of 2 * n_axes = ", 2 * n_axes);
  return multiaxis(std::vector<int64_t>(n_axes, rotary_dim / n_axes), {base});
}

at::Tensor mrope_pair_axis(const std::vector<int64_t>& mrope_section, bool interleaved) {
  constexpr const char* op = "posenc.frequencies.mrope_pair_axis";
  TORCH_CHECK_VALUE(!mrope_section.empty(), op, ": mrope_section is empty; at least one axis is needed");
  for (size_t a = 0; a < mrope_section.size(); ++a) {
    TORCH_CHECK_VALUE(mrope_section[a] >= 0, op, ": mrope_section[", a, "] must not be negative, got ",
                      mrope_section[a]);
  }
  const int64_t pairs = std::accumulate(mrope_section.begin(), mrope_section.end(), int64_t{0});
  TORCH_CHECK_VALUE(pairs > 0, op, ": mrope_section ", c10::IntArrayRef(mrope_section), " holds no frequency pair");
  const int64_t n_axes = static_cast<int64_t>(mrope_section.size());
  auto pair_axis = at::zeros({pairs}, at::TensorOptions().dtype(at::kLong));
  int64_t* axis = pair_axis.mutable_data_ptr<int64_t>();
  if (interleaved) {
    // Axis 0 keeps every pair that no other axis takes (Qwen3-VL's apply_interleaved_mrope).
    for (int64_t a = 1; a < n_axes; ++a) {
      for (int64_t i = a; i < std::min(pairs, n_axes * mrope_section[a]); i += n_axes) axis[i] = a;
    }
  } else {
    int64_t i = 0;
    for (int64_t a = 0; a < n_axes; ++a) {
      for (int64_t j = 0; j < mrope_section[a]; ++j) axis[i++] = a;
    }
  }
  return pair_axis;
}

AxisFrequencies mrope(int64_t rotary_dim, const std::vector<int64_t>& mrope_section, double base, bool interleaved) {
  auto pair_axis = mrope_pair_axis(mrope_section, interleaved);
  TORCH_CHECK_VALUE(pair_axis.size(0) * 2 == rotary_dim, "posenc.frequencies.mrope: mrope_section ",
                    c10::IntArrayRef(mrope_section), " holds ", pair_axis.size(0), " frequency pairs but rotary_dim ",
                    rotary_dim, " has ", rotary_dim / 2);
  return {rope(rotary_dim, base).inv_freq, pair_axis};
}

GridSinusoidal grid_sinusoidal(int64_t dim, std::string_view convention, double base) {
  constexpr const char* op = "posenc.grid_sinusoidal_inv_freq";
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 0.0, op, ": base must be finite and positive, got ", base);
  // (axis, pairs) blocks in channel order.
  std::vector<std::pair<int64_t, int64_t>> blocks;
  std::string layout = "half_per_axis";
  if (convention == "mae" || convention == "timm" || convention == "timm_interleaved") {
    TORCH_CHECK_VALUE(dim > 0 && dim % 4 == 0, op, ": dim must be a positive multiple of 4 for convention \"",
                      convention, "\" (a sin and a cos per axis), got ", dim);
    if (convention == "mae") {
      blocks = {{1, dim / 4}, {0, dim / 4}};
    } else {
      blocks = {{0, dim / 4}, {1, dim / 4}};
      if (convention == "timm") layout = "half";
    }
  } else if (convention == "cogvideox") {
    TORCH_CHECK_VALUE(dim > 0 && dim % 16 == 0, op, ": dim must be a positive multiple of 16 for convention \"",
                      convention, "\" (a quarter for time, three eighths per spatial axis), got ", dim);
    blocks = {{0, dim / 8}, {2, 3 * dim / 16}, {1, 3 * dim / 16}};
  } else {
    TORCH_CHECK_VALUE(false, op, ": convention must be \"mae\", \"timm\", \"timm_interleaved\" or \"cogvideox\", got \"",
                      convention, "\"");
  }
  const auto options = at::TensorOptions().dtype(at::kLong);
  auto inv_freq = at::empty({dim / 2}, options.dtype(at::kDouble));
  auto pair_axis = at::empty({dim / 2}, options);
  double* w = inv_freq.mutable_data_ptr<double>();
  int64_t* axis = pair_axis.mutable_data_ptr<int64_t>();
  int64_t i = 0;
  for (const auto& [a, n] : blocks) {
    // 1 / base^(k / n), as MAE's numpy and diffusers' float64 torch write it.
    for (int64_t k = 0; k < n; ++k, ++i) {
      w[i] = 1.0 / std::pow(base, static_cast<double>(k) / static_cast<double>(n));
      axis[i] = a;
    }
  }
  return {inv_freq, pair_axis, layout};
}

}  // namespace frequencies

at::Tensor grid_positions(const std::vector<int64_t>& grid, const std::optional<std::vector<int64_t>>& crop_from,
                          const std::optional<std::vector<double>>& scale, double interpolation_scale,
                          at::TensorOptions options) {
  constexpr const char* op = "posenc.grid_positions";
  const auto n_axes = static_cast<int64_t>(grid.size());
  TORCH_CHECK_VALUE(n_axes >= 1, op, ": grid is empty; at least one axis is needed");
  TORCH_CHECK_VALUE(!crop_from || static_cast<int64_t>(crop_from->size()) == n_axes, op, ": crop_from has ",
                    crop_from ? crop_from->size() : 0, " entries but grid ", c10::IntArrayRef(grid), " has ", n_axes, " axes");
  TORCH_CHECK_VALUE(!scale || static_cast<int64_t>(scale->size()) == n_axes, op, ": scale has ",
                    scale ? scale->size() : 0, " entries but grid ", c10::IntArrayRef(grid), " has ", n_axes, " axes");
  TORCH_CHECK_VALUE(std::isfinite(interpolation_scale) && interpolation_scale > 0.0, op,
                    ": interpolation_scale must be finite and positive, got ", interpolation_scale);
  int64_t tokens = 1;
  std::vector<int64_t> start(n_axes, 0);
  for (int64_t a = 0; a < n_axes; ++a) {
    TORCH_CHECK_VALUE(grid[a] >= 0, op, ": grid[", a, "] must not be negative, got ", grid[a]);
    if (crop_from) {
      TORCH_CHECK_VALUE((*crop_from)[a] >= grid[a], op, ": crop_from[", a, "] = ", (*crop_from)[a],
                        " is smaller than grid[", a, "] = ", grid[a], "; the crop lies inside the larger grid");
      start[a] = ((*crop_from)[a] - grid[a]) / 2;
    }
    if (scale) {
      TORCH_CHECK_VALUE(std::isfinite((*scale)[a]) && (*scale)[a] > 0.0, op, ": scale[", a,
                        "] must be finite and positive, got ", (*scale)[a]);
    }
    tokens *= grid[a];
  }
  auto out = at::empty({n_axes, tokens}, at::TensorOptions().dtype(at::kFloat));
  float* values = out.mutable_data_ptr<float>();
  const auto divisor = static_cast<float>(interpolation_scale);
  // Axis a's grid[a] values, each repeated by the `inner` tokens of the axes after it, the run of them repeated
  // `outer` times: no division per token (an integer division and two float ones per token and axis were 8% of
  // CogVideoX's add_sinusoidal, [1, 13 * 30 * 45, 1920] bf16, 2 threads).
  int64_t inner = tokens;
  for (int64_t a = 0; a < n_axes; ++a) {
    if (tokens == 0) break;
    inner /= grid[a];
    const int64_t outer = tokens / (inner * grid[a]);
    const float axis_scale = scale ? static_cast<float>((*scale)[a]) : 1.0f;
    float* row = values + a * tokens;
    for (int64_t i = 0; i < grid[a]; ++i) {
      // Two float32 divisions, in diffusers' order: (i / scale) / interpolation_scale.
      std::fill_n(row + i * inner, inner, (static_cast<float>(start[a] + i) / axis_scale) / divisor);
    }
    for (int64_t o = 1; o < outer; ++o) std::copy_n(row, inner * grid[a], row + o * inner * grid[a]);
  }
  return options.has_device() ? out.to(options.device()) : out;
}


at::Tensor image_positions(int64_t height, int64_t width, at::TensorOptions options) {
  TORCH_CHECK_VALUE(height >= 0 && width >= 0, "posenc.image_positions: height ", height, " and width ", width,
                    " must not be negative");
  const auto index = at::arange(height * width, options);
  return at::stack({index.div(width, "floor"), index.remainder(width)});
}

at::Tensor patch_center_positions(int64_t height, int64_t width, int64_t num_prefix_tokens,
                                  std::optional<double> shift, std::optional<double> jitter,
                                  std::optional<double> rescale, std::optional<at::Generator> generator,
                                  at::TensorOptions options) {
  constexpr const char* op = "posenc.patch_center_positions";
  TORCH_CHECK_VALUE(height >= 0 && width >= 0, op, ": height ", height, " and width ", width,
                    " must not be negative");
  TORCH_CHECK_VALUE(num_prefix_tokens >= 0, op, ": num_prefix_tokens must not be negative, got ", num_prefix_tokens);
  TORCH_CHECK_VALUE(!shift || (std::isfinite(*shift) && *shift >= 0.0), op,
                    ": shift must be finite and not negative, got ", shift.value_or(0.0));
  for (const auto& [name, factor] : {std::pair{"jitter", jitter}, std::pair{"rescale", rescale}}) {
    TORCH_CHECK_VALUE(!factor || (std::isfinite(*factor) && *factor >= 1.0), op, ": ", name,
                      " must be finite and at least 1 (a log-uniform factor in [1 / ", name, ", ", name, "]), got ",
                      factor.value_or(0.0));
  }
  // transformers' get_patches_center_coordinates, in its float32 steps.
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto rows = at::arange(0.5, static_cast<double>(height), 1.0, f32).div(height);
  const auto columns = at::arange(0.5, static_cast<double>(width), 1.0, f32).div(width);
  auto coords = at::stack(at::meshgrid({rows, columns}, "ij"), -1).flatten(0, 1).mul(2.0).sub(1.0);  // [H * W, 2]
  if (shift) coords = coords.add(at::empty({1, 2}, f32).uniform_(-*shift, *shift, generator));
  if (jitter) coords = coords.mul(at::empty({1, 2}, f32).uniform_(-std::log(*jitter), std::log(*jitter), generator).exp());
  if (rescale) coords = coords.mul(at::empty({1}, f32).uniform_(-std::log(*rescale), std::log(*rescale), generator).exp());
  const auto out = at::cat({at::zeros({num_prefix_tokens, 2}, f32), coords}).t().contiguous();
  return options.has_device() ? out.to(options.device()) : out;
}

at::Tensor video_positions(int64_t frames, int64_t height, int64_t width, double time_interval,
                           at::TensorOptions options) {
  TORCH_CHECK_VALUE(frames >= 0 && height >= 0 && width >= 0, "posenc.video_positions: frames ", frames, ", height ",
                    height, " and width ", width, " must not be negative");
  TORCH_CHECK_VALUE(time_interval >= 0, "posenc.video_positions: time_interval must not be negative, got ",
                    time_interval);
  const int64_t per_frame = height * width;
  const auto index = at::arange(frames * per_frame, options);
  const auto frame = index.div(per_frame, "floor");
  const auto within = index.remainder(per_frame);
  const auto time = frame.to(at::kDouble).mul(time_interval).trunc().to(options.dtype());
  return at::stack({time, within.div(width, "floor"), within.remainder(width)});
}

}  // namespace posenc
