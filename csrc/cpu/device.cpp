#include "cpu/device.h"

#include <ATen/Dispatch.h>

#include <cstring>

namespace posenc {

at::Tensor CpuDevice::converted(const at::Tensor& weight, at::ScalarType to, double add) {
  if (weight.scalar_type() == to && add == 0 && weight.is_contiguous()) return weight;
  auto out = empty({weight.size(0)}, weight.options().dtype(to));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, to, "posenc_converted", [&] {
    using out_t = scalar_t;
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const auto addend = static_cast<out_t>(add);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_converted", [&] {
      const scalar_t* src = weight.const_data_ptr<scalar_t>();
      const int64_t stride = weight.stride(0);
      for (int64_t i = 0; i < weight.size(0); ++i) {
        const auto value = static_cast<out_t>(src[i * stride]);
        dst[i] = add != 0 ? value + addend : value;
      }
    });
  });
  return out;
}

at::Tensor CpuDevice::zeros(int64_t size, const at::TensorOptions& options) {
  auto out = empty({size}, options);
  std::memset(out.mutable_data_ptr(), 0, out.nbytes());
  return out;
}

}  // namespace posenc
