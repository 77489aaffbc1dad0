// ALiBi's slopes (the paper's geometric sequence, and BLOOM's interleaving past the largest power of two).
#include <posenc/alibi.h>

#include "portable/libm.h"

#include <ATen/ops/empty.h>

namespace posenc {

at::Tensor alibi_slopes(int64_t num_heads, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(num_heads > 0, "posenc.alibi_slopes: num_heads must be positive, got ", num_heads);
  TORCH_CHECK_VALUE(at::isFloatingType(dtype), "posenc.alibi_slopes: dtype must be floating, got ", dtype);
  int64_t power = 1;  // the largest power of two <= num_heads, in integers (log2 of a double can round up)
  while (power <= num_heads / 2) power *= 2;
  auto slopes = at::empty({num_heads}, at::kDouble);
  double* m = slopes.mutable_data_ptr<double>();
  // 2^(-8k / n), and 2^(-4(2j - 1) / n) for the heads past the power of two n: posenc's own exp2 of the exact
  // exponent, the same bits on every machine (an integer exponent gives the power of two exactly).
  namespace libm = portable::libm;
  const auto n = static_cast<double>(power);
  const auto slope = [&](int64_t numerator) {
    return libm::exp2(libm::div(portable::DoubleDouble{static_cast<double>(-numerator), 0.0}, n));
  };
  for (int64_t k = 1; k <= power; ++k) m[k - 1] = slope(8 * k);
  for (int64_t j = 1; j <= num_heads - power; ++j) m[power + j - 1] = slope(4 * (2 * j - 1));
  return slopes.to(dtype);
}

}  // namespace posenc
