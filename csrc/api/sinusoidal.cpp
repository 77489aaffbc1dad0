#include <posenc/frequencies.h>
#include <posenc/sinusoidal.h>

#include "common/find_op.h"

namespace posenc {

at::Tensor sinusoidal(const at::Tensor& positions, const at::Tensor& inv_freq, std::string_view layout,
                      std::optional<at::ScalarType> dtype, int64_t offset) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view,
                                            std::optional<at::ScalarType>, int64_t)>("posenc::sinusoidal");
  return op.call(positions, inv_freq, layout, dtype, offset);
}

at::Tensor add_sinusoidal(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                          double x_scale, std::string_view layout, int64_t offset) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                            double, c10::string_view, int64_t)>("posenc::add_sinusoidal");
  return op.call(x, positions, inv_freq, x_scale, layout, offset);
}

at::Tensor embed_sinusoidal(const at::Tensor& tokens, const at::Tensor& token_weight,
                            const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double token_scale,
                            std::optional<int64_t> padding_idx, std::string_view layout, int64_t offset) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                         double, std::optional<int64_t>, c10::string_view, int64_t)>("posenc::embed_sinusoidal");
  return op.call(tokens, token_weight, positions, inv_freq, token_scale, padding_idx, layout, offset);
}

namespace nn {

SinusoidalPositionalEncodingImpl::SinusoidalPositionalEncodingImpl(int64_t dim, double base, int64_t shift,
                                                                   std::string layout, double x_scale)
    : inv_freq_(frequencies::sinusoidal(dim, base, shift)), layout_(std::move(layout)), x_scale_(x_scale) {}

at::Tensor SinusoidalPositionalEncodingImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                                     int64_t offset) {
  if (inv_freq_.device() != x.device()) inv_freq_ = inv_freq_.to(x.device());
  return add_sinusoidal(x, positions, inv_freq_, x_scale_, layout_, offset);
}

}  // namespace nn
}  // namespace posenc
