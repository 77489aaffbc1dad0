#pragma once
// The frequency formulas' per-pair maths, with posenc's own exp and log (portable/libm.h): the same bits on every
// CPU and on the GPU, which evaluates dynamic NTK's frequencies for a length it holds.
#include "portable/libm.h"
#include "portable/macros.h"

#include <cstdint>

namespace posenc::portable {

// Dynamic NTK (Hugging Face's runtime rule): past the context C, the base becomes
// theta (1 + factor (L - C) / C)^(r / (r - 2)); up to it, theta. A NaN length gives NaN frequencies.
struct DynamicNtk {
  double theta;
  double factor;
  double context;
  int64_t rotary_dim;
};

inline namespace POSENC_KERNEL_NAMESPACE {

// base^(-numerator / denominator) from ln(base), correctly rounded but in the rarest cases.
POSENC_INLINE double inverse_power(DoubleDouble log_base, int64_t numerator, int64_t denominator) {
  const DoubleDouble exponent = libm::div(DoubleDouble{static_cast<double>(numerator), 0.0},
                                          static_cast<double>(denominator));
  return libm::exp(libm::neg(libm::mul(log_base, exponent))).hi;
}

// ln of dynamic NTK's base at length L (max(L, C): the base never shrinks below theta).
POSENC_INLINE DoubleDouble dynamic_ntk_log_base(const DynamicNtk& p, double length) {
  const double clamped = length < p.context ? p.context : length;
  // 1 + factor (L - C) / C: exactly 1 at L = C, where the frequencies are theta's.
  const DoubleDouble growth = libm::add(
      DoubleDouble{1.0, 0.0}, libm::div(libm::mul(libm::two_sum(clamped, -p.context), p.factor), p.context));
  const double r = static_cast<double>(p.rotary_dim);
  const DoubleDouble power = libm::div(DoubleDouble{r, 0.0}, r - 2.0);
  return libm::add(libm::log(DoubleDouble{p.theta, 0.0}), libm::mul(libm::log(growth), power));
}

POSENC_INLINE double dynamic_ntk_inv_freq(const DynamicNtk& p, double length, int64_t i) {
  return inverse_power(dynamic_ntk_log_base(p, length), 2 * i, p.rotary_dim);
}

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
