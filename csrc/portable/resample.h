#pragma once
// The interpolation weights of a learned table resampled to a new grid (resample_learned), one axis at a time, as
// ATen's upsample kernels form them (F.interpolate), in float64, for the host and the device:
//   bicubic: source index s = scale * (o + 0.5) - 0.5 (align_corners: scale * o), i = min(floor(s), in - 1),
//     t = clamp(s - i, 0, 1); Keys' cubic with A = -0.75 at taps i - 1 .. i + 2, each clamped into [0, in)
//     (taps clamped onto one index add up);
//   bilinear: s as above but at least 0, i = min(floor(s), in - 1), t = clamp(s - i, 0, 1); 1 - t at i, t at
//     i + 1 (i itself at the last index);
//   antialias (either mode): centre c = scale * (o + 0.5), support r = R * max(scale, 1) (R = 2 bicubic, 1
//     bilinear); taps [max(trunc(c - r + 0.5), 0), min(trunc(c + r + 0.5), in)), weight f((k - c + 0.5) /
//     max(scale, 1)) of Keys' cubic with a = -0.5 or the triangle 1 - |x|, divided by their sum (when not 0).
// scale: (in - 1) / (out - 1) with align_corners (0 for one output), else 1 / scale_factor when one is given
// (F.interpolate(scale_factor=..., recompute_scale_factor=False)), else in / out.
// Every output index reads a run of consecutive input indices, and both ends of the run never decrease with the
// output index, so the adjoint (the backward) is a gather over a run of output indices too.
#include "portable/convert.h"
#include "portable/macros.h"
#include "portable/types.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace posenc::portable {
inline namespace POSENC_KERNEL_NAMESPACE {

POSENC_INLINE double cubic_near(double x, double a) { return ((a + 2) * x - (a + 3)) * x * x + 1; }  // |x| <= 1
POSENC_INLINE double cubic_far(double x, double a) { return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a; }  // 1 < |x| < 2

POSENC_INLINE double antialias_filter(double x, bool cubic) {
  x = x < 0 ? -x : x;
  if (!cubic) return x < 1 ? 1 - x : 0;
  constexpr double a = -0.5;
  if (x < 1) return cubic_near(x, a);
  if (x < 2) return cubic_far(x, a);
  return 0;
}

POSENC_INLINE int64_t clamp_index(int64_t i, int64_t size) { return i < 0 ? 0 : (i >= size ? size - 1 : i); }

// Rows of the resampled table: the prefix rows, then the output grid's.
POSENC_INLINE int64_t resampled_tokens(const ResampleGrid& grid) {
  return grid.prefix + grid.height.out * grid.width.out;
}

// The run of input indices output index o reads: its first index (returned), its length (*count <= max_taps)
// and, when `weights` is not null, their weights (*count values).
POSENC_INLINE int64_t resample_taps(const ResampleAxis& axis, int64_t o, int64_t* count, double* weights) {
  if (axis.antialias) {
    const double center = axis.scale * (o + 0.5);
    const double invscale = axis.scale >= 1.0 ? 1.0 / axis.scale : 1.0;
    const int64_t lo = static_cast<int64_t>(center - axis.support + 0.5);
    const int64_t first = lo > 0 ? lo : 0;
    const int64_t hi = static_cast<int64_t>(center + axis.support + 0.5);
    const int64_t end = hi < axis.in ? hi : axis.in;
    const int64_t n = end > first ? end - first : 0;
    *count = n;
    if (weights == nullptr) return first;
    double total = 0;
    for (int64_t k = 0; k < n; ++k) {
      weights[k] = antialias_filter((k + first - center + 0.5) * invscale, axis.cubic);
      total += weights[k];
    }
    for (int64_t k = 0; k < n; ++k) weights[k] = total != 0 ? weights[k] / total : weights[k];
    return first;
  }
  double source = axis.align_corners ? axis.scale * o : axis.scale * (o + 0.5) - 0.5;
  if (!axis.cubic && source < 0) source = 0;
  const double fl = floor(source);
  const int64_t i = static_cast<int64_t>(fl) < axis.in - 1 ? static_cast<int64_t>(fl) : axis.in - 1;
  double t = source - static_cast<double>(i);
  t = t < 0 ? 0 : (t > 1 ? 1 : t);
  if (!axis.cubic) {
    const int64_t first = i;
    *count = i < axis.in - 1 ? 2 : 1;
    if (weights == nullptr) return first;
    weights[0] = 1 - t;
    if (*count == 2) weights[1] = t; else weights[0] += t;
    return first;
  }
  const int64_t first = clamp_index(i - 1, axis.in);
  *count = clamp_index(i + 2, axis.in) - first + 1;
  if (weights == nullptr) return first;
  constexpr double A = -0.75;
  const double w[4] = {cubic_far(t + 1, A), cubic_near(t, A), cubic_near(1 - t, A), cubic_far(2 - t, A)};
  for (int64_t k = 0; k < *count; ++k) weights[k] = 0;
  for (int64_t k = 0; k < 4; ++k) weights[clamp_index(i - 1 + k, axis.in) - first] += w[k];
  return first;
}

// A float64 value rounded to float32 to odd: truncated toward zero, then its last bit set when inexact. Its 24 bits
// leave a last round-to-nearest-even to 8 or 11 bits (bf16, fp16) the same result as rounding the float64 value
// directly. Branch-free, so that loops of it vectorize.
POSENC_INLINE float round_to_odd_float(double value) {
  const float nearest = static_cast<float>(value);
  const double back = static_cast<double>(nearest);
  const uint32_t away = (back < 0 ? -back : back) > (value < 0 ? -value : value) ? 1u : 0u;  // NaN: 0
  const uint32_t inexact = back != value ? 1u : 0u;
  return bits_to_float((float_to_bits(nearest) - away) | inexact);
}

// A float64 sum rounded once to T: float32 and float64 directly; fp16 and bf16 through round_to_odd_float.
template <typename T>
POSENC_INLINE T round_from_double(double value) {
  if constexpr (std::is_same_v<T, double>) {
    return value;
  } else if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(value);
  } else {
    return from_opmath<T>(round_to_odd_float(value));
  }
}

// The weight of input index `in_index` in output index o's run (0 outside it); `scratch` holds max_taps values.
POSENC_INLINE double resample_weight(const ResampleAxis& axis, int64_t o, int64_t in_index, double* scratch) {
  int64_t count = 0;
  const int64_t first = resample_taps(axis, o, &count, scratch);
  return in_index >= first && in_index < first + count ? scratch[in_index - first] : 0.0;
}

// The output indices whose runs hold input index i: [*lo, *hi), found by bisection (both ends of the runs never
// decrease with the output index).
POSENC_INLINE void resample_adjoint_range(const ResampleAxis& axis, int64_t i, int64_t* lo, int64_t* hi) {
  int64_t count = 0;
  int64_t a = 0;
  int64_t b = axis.out;  // first o whose run ends past i
  while (a < b) {
    const int64_t m = a + (b - a) / 2;
    const int64_t first = resample_taps(axis, m, &count, nullptr);
    if (first + count > i) b = m; else a = m + 1;
  }
  *lo = a;
  b = axis.out;  // first o whose run starts past i
  while (a < b) {
    const int64_t m = a + (b - a) / 2;
    if (resample_taps(axis, m, &count, nullptr) > i) b = m; else a = m + 1;
  }
  *hi = a;
}

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
