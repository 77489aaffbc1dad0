#pragma once
// Kernel interface of the rotary family (cpu/rope.cpp -> cpu/kernels/rope.cpp).
#include "cpu/dispatch.h"
#include "portable/types.h"

namespace posenc::cpu {

// Rotates every view's token (b, s) by angle(p, i) = p * inv_freq[i], p = positions[s] (shared by the batch)
// or positions[b * seq + s], cos and sin times attention_scale; inverse: by -angle. Multi-axis (pair_axis not
// null): token n has n_axes positions, positions[n * n_axes + a], and pair i takes the one of axis
// pair_axis[i], every value in [0, n_axes). norms (qk_norm_rope): each view's rows RMS-normalized before the rotation,
// or with inverse, the gradient of that (the weights' gradients summed in an order no thread count changes). q_scale:
// view scaled_view's coefficients times its query scale at the token's position (one axis). copy: a view whose
// tokens are copied, not rotated, in the same pass.
template <typename scalar_t>
struct RopeProblem {
  const RotaryView<scalar_t>* views;  // x (rope), or q and k (rope_qk); none empty
  int64_t num_views;
  int64_t batch;
  int64_t seq;
  const double* positions;  // null: positions first_position + s (an arange; one axis)
  int64_t first_position;
  bool shared_positions;
  int64_t n_axes;            // 1 without pair_axis
  const int32_t* pair_axis;  // [pairs], or null: every pair follows the one position
  const double* inv_freq;
  int64_t pairs;
  double max_abs_freq;
  double attention_scale;
  bool inverse;
  RopeLayout layout;
  const RmsNormView<scalar_t, opmath_t<scalar_t>>* norms;  // one per view, or null
  QScale q_scale;        // of view scaled_view (q), whose coefficients it multiplies
  int64_t scaled_view;   // -1: none
  const RotaryView<scalar_t>* copy = nullptr;  // rope_qk_cache_'s v, copied into its cache token by token
  // A kept table whose row p is [cos | sin] of position p (sincos_row's bits), holding every position of the call
  // (one axis); or null
  const opmath_t<scalar_t>* kept = nullptr;
};

// Rotates token (b, s) by explicit tables cos/sin [rows, rotary_dim] in maths precision (row s when shared,
// else b * seq + s), channel by channel: x * cos + rotate(x) * sin; transpose: the backward map.
template <typename scalar_t, typename opmath_t>
struct RopeTablesProblem {
  RotaryView<scalar_t> view;
  int64_t batch;
  int64_t seq;
  const opmath_t* cos;
  const opmath_t* sin;
  bool shared_rows;
  int64_t rotary_dim;
  RopeLayout layout;
  bool transpose;
};

template <typename scalar_t>
inline DispatchStub<void(const RopeProblem<scalar_t>&)> rope_stub;
template <typename scalar_t, typename opmath_t>
inline DispatchStub<void(const RopeTablesProblem<scalar_t, opmath_t>&)> rope_tables_stub;

}  // namespace posenc::cpu
