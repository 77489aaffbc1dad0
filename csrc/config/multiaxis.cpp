// Multi-axis rotary's configuration: the frequencies and pair axes of M-RoPE and axial (2-D/3-D) rotary, and the
// position grids of images and video.
#include <posenc/multiaxis.h>
#include <posenc/rope.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
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

}  // namespace frequencies

at::Tensor image_positions(int64_t height, int64_t width, at::TensorOptions options) {
  TORCH_CHECK_VALUE(height >= 0 && width >= 0, "posenc.image_positions: height ", height, " and width ", width,
                    " must not be negative");
  const auto index = at::arange(height * width, options);
  return at::stack({index.div(width, "floor"), index.remainder(width)});
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
