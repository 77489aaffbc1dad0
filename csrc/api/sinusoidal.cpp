#include <posenc/frequencies.h>
#include <posenc/sinusoidal.h>

namespace posenc {
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
