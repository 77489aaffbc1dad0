#pragma once
// RMS normalization of a row before its rotation (qk_norm_rope), written once for the CPU kernels of every
// capability and the GPU:
//   r = 1 / sqrt(sum(x^2) / n + eps),   xhat = x * r,   z = w * xhat,
// and its backward from the gradient gz of z:
//   gw += gz * xhat,   gxhat = gz * w,   gx = r * (gxhat - xhat * sum(gxhat * xhat) / n).
// Sums run over 16 lanes (lane j adds channels j, j + 16, ... in order) folded by a fixed tree, so every CPU
// capability, whatever its vector width, adds in the same order and gives the same bits; a GPU whose 16 threads
// take the lanes and fold them by shuffles does too.
#include "portable/convert.h"
#include "portable/macros.h"
#include "portable/types.h"

#include <cmath>
#include <cstdint>

namespace posenc::portable {
inline namespace POSENC_KERNEL_NAMESPACE {

constexpr int kSumLanes = 16;

// The sum of a[i] * b[i], i < n, over the lanes.
template <typename T>
POSENC_INLINE T lane_dot(const T* a, const T* b, int64_t n) {
  T lane[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int j = 0; j < kSumLanes; ++j) lane[j] += a[i + j] * b[i + j];
  }
  for (int j = 0; i + j < n; ++j) lane[j] += a[i + j] * b[i + j];
  for (int width = kSumLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  }
  return lane[0];
}

// 1 / sqrt(mean(x^2) + eps): both IEEE operations are correctly rounded on every CPU and (without fast maths) the GPU.
template <typename T>
POSENC_INLINE T inverse_rms(T sum_squares, int64_t n, T eps) {
  using std::sqrt;
  return T(1) / sqrt(sum_squares / static_cast<T>(n) + eps);
}

// v rounded to scalar_t and back: the intermediate rounding of the "llama", "gemma" and "olmo2" conventions.
template <typename scalar_t, typename T>
POSENC_INLINE T round_to(T v) {
  return to_opmath(from_opmath<scalar_t>(v));
}

// The normalized row z = w * x * r in place of x, rounded as the convention rounds it before the rotation.
template <typename scalar_t, typename T>
POSENC_INLINE void rms_norm_row(T* x, const T* w, int64_t n, T eps, QkNorm convention) {
  const T r = inverse_rms(lane_dot(x, x, n), n, eps);
  if (convention == QkNorm::Llama) {
    for (int64_t i = 0; i < n; ++i) x[i] = round_to<scalar_t>(w[i] * round_to<scalar_t>(x[i] * r));
  } else if (convention == QkNorm::Fused) {
    for (int64_t i = 0; i < n; ++i) x[i] = w[i] * (x[i] * r);
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] = round_to<scalar_t>(w[i] * (x[i] * r));
  }
}

// The backward of rms_norm_row: x (the forward's input) becomes xhat, g (the gradient of z) that of x, and gz * xhat
// is added to gw. The intermediate roundings of the conventions pass the gradient through, as autograd's casts do.
template <typename T>
POSENC_INLINE void rms_norm_row_backward(T* x, T* g, const T* w, T* gw, int64_t n, T eps) {
  const T r = inverse_rms(lane_dot(x, x, n), n, eps);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = x[i] * r;
    gw[i] += g[i] * x[i];
    g[i] = g[i] * w[i];
  }
  const T mean_dot = lane_dot(g, x, n) / static_cast<T>(n);
  for (int64_t i = 0; i < n; ++i) g[i] = r * (g[i] - x[i] * mean_dot);
}

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
