// Kernels of the ops that compute a configuration's constants: frequencies, ALiBi slopes, context-parallel
// positions and the position grids of images and video. Each kernel unpacks the op's arguments and calls the
// formula beside it in config/ (frequencies.cpp, multiaxis.cpp, slopes.cpp, zigzag.cpp), its only
// implementation, also the C++ API's; Python's posenc.frequencies and posenc.functional call these ops, so both
// languages compute the same values with the same code.
//
// Ops without a tensor argument dispatch on no key: the dispatcher then runs the kernel registered at
// CompositeExplicitAutograd. rope_inv_freq_for_length reads its tensor's metadata only on other devices than the
// CPU, and its Meta kernel (meta/frequencies.cpp) lets torch.compile and torch.export trace it as one node
// whatever the length.
#include <posenc/alibi.h>
#include <posenc/frequencies.h>
#include <posenc/multiaxis.h>
#include <posenc/rope.h>

#include "config/rope_scaling.h"
#include "families.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace posenc {
namespace {

std::tuple<at::Tensor, double> rope_inv_freq_composite(int64_t rotary_dim, double base,
                                                       c10::string_view rope_type POSENC_SCALING_PARAMETERS,
                                                       std::optional<int64_t> seq_len) {
  const auto scaling = POSENC_SCALING(rope_type);
  auto freqs = frequencies::rope(rotary_dim, base, scaling, seq_len);
  return {std::move(freqs.inv_freq), freqs.attention_scale};
}

// Computed on the CPU, then moved. Ops that return one tensor and take none count as tensor constructors for
// torch.compile and torch.export, which trace them by calling them with device=meta while the tracer's modes
// send every ATen call to Python or to the Meta key: the value is computed for real, outside those modes, then
// moved.
template <typename Compute>
at::Tensor on_device(const Compute& compute, std::optional<at::Device> device) {
  at::Tensor cpu;
  {
    // The dispatcher's state outside any mode: the default included and excluded keys.
    c10::impl::ForceDispatchKeyGuard untraced(c10::default_included_set, c10::default_excluded_set);
    cpu = compute();
  }
  return device ? cpu.to(*device) : cpu;
}

at::Tensor sinusoidal_inv_freq_composite(int64_t dim, double base, int64_t shift, std::optional<at::Device> device) {
  return on_device([&] { return frequencies::sinusoidal(dim, base, shift); }, device);
}

at::Tensor alibi_slopes_composite(int64_t num_heads, std::optional<at::ScalarType> dtype,
                                  std::optional<at::Device> device) {
  return on_device([&] { return alibi_slopes(num_heads, dtype.value_or(at::kFloat)); }, device);
}

at::Tensor zigzag_positions_composite(int64_t seq_len, int64_t cp_size, int64_t cp_rank,
                                      std::optional<at::Device> device) {
  return zigzag_positions(seq_len, cp_size, cp_rank, at::TensorOptions().dtype(at::kLong).device(device));
}

std::tuple<at::Tensor, at::Tensor> unpack(frequencies::AxisFrequencies freqs) {
  return {std::move(freqs.inv_freq), std::move(freqs.pair_axis)};
}

std::tuple<at::Tensor, at::Tensor> multiaxis_inv_freq_composite(c10::IntArrayRef axes_dim,
                                                                c10::ArrayRef<double> bases) {
  return unpack(frequencies::multiaxis(axes_dim.vec(), bases.vec()));
}

std::tuple<at::Tensor, at::Tensor> axial_inv_freq_composite(int64_t rotary_dim, int64_t n_axes, double base) {
  return unpack(frequencies::axial(rotary_dim, n_axes, base));
}

at::Tensor mrope_pair_axis_composite(c10::IntArrayRef mrope_section, bool interleaved,
                                     std::optional<at::Device> device) {
  return on_device([&] { return frequencies::mrope_pair_axis(mrope_section.vec(), interleaved); }, device);
}

std::tuple<at::Tensor, at::Tensor> mrope_inv_freq_composite(int64_t rotary_dim, c10::IntArrayRef mrope_section,
                                                            double base, bool interleaved) {
  return unpack(frequencies::mrope(rotary_dim, mrope_section.vec(), base, interleaved));
}

at::Tensor image_positions_composite(int64_t height, int64_t width, std::optional<at::Device> device) {
  return image_positions(height, width, at::TensorOptions().dtype(at::kLong).device(device));
}

at::Tensor video_positions_composite(int64_t frames, int64_t height, int64_t width, double time_interval,
                                     std::optional<at::Device> device) {
  return video_positions(frames, height, width, time_interval, at::TensorOptions().dtype(at::kLong).device(device));
}

at::Tensor grid_positions_composite(c10::IntArrayRef grid, at::OptionalIntArrayRef crop_from,
                                    std::optional<c10::ArrayRef<double>> scale, double interpolation_scale,
                                    std::optional<at::Device> device) {
  return on_device(
      [&] {
        return grid_positions(grid.vec(), crop_from ? std::optional(crop_from->vec()) : std::nullopt,
                              scale ? std::optional(scale->vec()) : std::nullopt, interpolation_scale);
      },
      device);
}

// Drawn on the CPU from `generator` (the default CPU generator without one), then moved.
at::Tensor patch_center_positions_composite(int64_t height, int64_t width, int64_t num_prefix_tokens,
                                            std::optional<double> shift, std::optional<double> jitter,
                                            std::optional<double> rescale, std::optional<at::Generator> generator,
                                            std::optional<at::Device> device) {
  return on_device(
      [&] { return patch_center_positions(height, width, num_prefix_tokens, shift, jitter, rescale, generator); },
      device);
}

std::tuple<at::Tensor, at::Tensor, std::string> grid_sinusoidal_inv_freq_composite(int64_t dim,
                                                                                    c10::string_view convention,
                                                                                    double base) {
  auto grid = frequencies::grid_sinusoidal(dim, convention, base);
  return {std::move(grid.inv_freq), std::move(grid.pair_axis), std::move(grid.layout)};
}

constexpr auto rope_inv_freq_for_length_composite = &rope_inv_freq_for_length_kernel<false>;
// The output size depends on cu_seqlens' values: no Meta kernel can know it.
constexpr auto zigzag_positions_varlen_composite = &zigzag_positions_varlen;

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CompositeExplicitAutograd, m) {
  POSENC_CONFIG_OPS(POSENC_IMPL_SUFFIXED, _composite)
}

}  // namespace posenc
