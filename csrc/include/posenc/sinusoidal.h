#pragma once
// Sinusoidal positional encodings.
#include <posenc/find_op.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <string_view>

namespace posenc {

// positions.shape + [2F]: sin/cos of (positions + offset) * inv_freq, "interleaved", "half", "half_cos_first" or
// "half_per_axis". With pair_axis [F] (images, video): positions [n_axes, ...], pair i encoding the position of axis
// pair_axis[i]; the output is positions.shape[1:] + [2F].
inline at::Tensor sinusoidal(const at::Tensor& positions, const at::Tensor& inv_freq,
                             std::string_view layout = "interleaved",
                             std::optional<at::ScalarType> dtype = std::nullopt, int64_t offset = 0,
                             const std::optional<at::Tensor>& pair_axis = std::nullopt) {
  static const auto op = detail::find_op<decltype(sinusoidal)>("posenc::sinusoidal");
  return op.call(positions, inv_freq, layout, dtype, offset, pair_axis);
}

// x [..., S, D] * x_scale + PE; positions absent (offset + arange(S)), [S] or x's leading shape. The first
// num_prefix_tokens tokens along S (cls, registers) get no encoding, and the positions cover the S -
// num_prefix_tokens after them; with pair_axis, positions [n_axes, S'] or [n_axes, ..., S'].
inline at::Tensor add_sinusoidal(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                 const at::Tensor& inv_freq, double x_scale = 1.0,
                                 std::string_view layout = "interleaved", int64_t offset = 0,
                                 const std::optional<at::Tensor>& pair_axis = std::nullopt,
                                 int64_t num_prefix_tokens = 0) {
  static const auto op = detail::find_op<decltype(add_sinusoidal)>("posenc::add_sinusoidal");
  return op.call(x, positions, inv_freq, x_scale, layout, offset, pair_axis, num_prefix_tokens);
}

// token_weight[tokens] * token_scale + PE, in one pass; the padding_idx row gets no gradient.
inline at::Tensor embed_sinusoidal(const at::Tensor& tokens, const at::Tensor& token_weight,
                                   const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                   double token_scale = 1.0, std::optional<int64_t> padding_idx = std::nullopt,
                                   std::string_view layout = "interleaved", int64_t offset = 0) {
  static const auto op = detail::find_op<decltype(embed_sinusoidal)>("posenc::embed_sinusoidal");
  return op.call(tokens, token_weight, positions, inv_freq, token_scale, padding_idx, layout, offset);
}

namespace nn {

// Adds a fixed encoding to x [..., S, dim]. Frequencies are float64 and not a registered buffer, so
// module->to(torch::kBFloat16) leaves them exact; they follow x's device. An odd dim gets a zero column.
class SinusoidalPositionalEncodingImpl : public torch::nn::Module {
 public:
  explicit SinusoidalPositionalEncodingImpl(int64_t dim, double base = 10000.0, int64_t shift = 0,
                                            std::string layout = "interleaved", double x_scale = 1.0);
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& positions = std::nullopt,
                     int64_t offset = 0);
  const at::Tensor& inv_freq() const { return inv_freq_; }

 private:
  at::Tensor inv_freq_;
  std::string layout_;
  double x_scale_;
};
TORCH_MODULE(SinusoidalPositionalEncoding);

}  // namespace nn
}  // namespace posenc
