#pragma once
// The enums and plain structs that the op layer, the CPU kernels of every capability and (later) the CUDA
// kernels share. No code here.
#include <cstdint>

namespace posenc {

// The type the maths runs in for data of type T (ATen's opmath_type without ATen): float32 for fp16, bf16 and
// float32 data, float64 for float64 data.
template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

// Channel pairing of a fixed (sinusoidal) encoding: "interleaved" = [sin t0, cos t0, sin t1, ...],
// "half" = [sin t0 .. sin t(F-1), cos t0 .. cos t(F-1)], "half_cos_first" = [cos .. || sin ..]
// (diffusers' flip_sin_to_cos), "half_per_axis" = "half" within each run of consecutive pairs that follow the
// same axis (multi-axis grids: MAE's [sin col, cos col, sin row, cos row]); one run without pair_axis.
enum class SinusoidalLayout { Interleaved, Half, HalfCosFirst, HalfPerAxis };

// Where the encoding of row p of an additive kernel's positions comes from (portable/angle.h's
// sequence_position): rows form sequences of `period` tokens whose first `prefix` (cls, registers) get none;
// token s >= prefix of sequence j reads position j * (period - prefix) + s - prefix.
struct SequenceRows {
  int64_t period;
  int64_t prefix;
};

// Channel pairing of a rotation: "neox" pairs (x_i, x_{i+r/2}) (Hugging Face rotate_half), "gptj" pairs
// (x_2i, x_2i+1).
enum class RopeLayout { Neox, Gptj };

// Where tokens and heads sit: bshd [B,S,H,D], bhsd [B,H,S,D], sbhd [S,B,H,D], thd [T,H,D] (packed).
enum class RopeFormat { BSHD, BHSD, SBHD, THD };

// One tensor to rotate: input and output read through their strides as [batch, seq, heads, head_dim]
// (out == in: in place). slots (a KV cache's output): token (b, s) is stored at sequence index
// slots[b * slot_batch_stride + s] of out instead of s (portable/rotary.h's output_token).
template <typename scalar_t>
struct RotaryView {
  const scalar_t* in;
  scalar_t* out;
  int64_t heads;
  int64_t head_dim;
  int64_t in_stride[4];
  int64_t out_stride[4];
  const int64_t* slots = nullptr;
  int64_t slot_batch_stride = 0;
  int64_t out_seq = 0;
  bool stream = false;      // CPU: rows stored past the caches (an output larger than they are)
  bool read_ahead = false;  // CPU: inputs larger than the caches: rows asked for a token ahead (rotary.h)
};

// The query scale of rope_qk and qk_norm_rope: q times 1 + beta * log(1 + floor((p + shift) / length)) at position p
// (beta 0: none).
struct QScale {
  double beta = 0.0;
  int64_t length = 1;
  int64_t shift = 0;
};

// Rounding of qk_norm_rope's normalization z = w * x / rms(x), by the model family that defines it: "llama"
// (Qwen3, Llama: x / rms(x) rounded to the input dtype, then the product rounded), "gemma" (weight 1 + w) and
// "olmo2" (the product rounded once), "fused" (nothing rounded before the rotation's output).
enum class QkNorm { Llama, Gemma, Olmo2, Fused };

// RMS normalization of a rotated view before its rotation (qk_norm_rope): groups of `group` channels (one head, or
// all heads of a token), weight [group] in maths precision (1 + w for gemma). The backward (the view's input then
// being the gradient) reads the forward's input through `input` and its strides, and writes the weight's gradient
// weight_grad [group].
template <typename scalar_t, typename opmath>
struct RmsNormView {
  const opmath* weight;
  int64_t group;
  opmath eps;
  QkNorm convention;
  const scalar_t* input;
  int64_t input_stride[4];
  opmath* weight_grad;
};

// "causal": -m * d, "symmetric": -m * |d|, with d = i + (k_len - q_len) - j (bottom-right aligned).
enum class AlibiMode { Causal, Symmetric };

// A [B, H, Q, K] scores tensor (or bias, or gradient) walked row by row, row n = (b * H + h) * Q + i, any strides.
struct AlibiRows {
  int64_t heads;
  int64_t q_len;
  int64_t k_len;
  int64_t stride_b;
  int64_t stride_h;
  int64_t stride_i;
  int64_t stride_j;
};

// Where row n of an additive kernel's input comes from: contiguous rows (`data + n * width`), rows of a table
// gathered by id (`data + ids[n] * width`), or nothing (data == nullptr: the output is the encoding alone).
template <typename scalar_t>
struct RowInput {
  const scalar_t* data = nullptr;
  const int64_t* ids = nullptr;
};

// One axis of a resampled grid (resample_learned): its sizes and what portable/resample.h's weights need.
struct ResampleAxis {
  int64_t in;
  int64_t out;
  double scale;
  bool cubic;
  bool antialias;
  bool align_corners;
  double support;    // antialias: R * max(scale, 1)
  int64_t max_taps;  // an upper bound of any output index's run length
};

// A table's grid rows [prefix + height.in * width.in, D] resampled to [prefix + height.out * width.out, D], row-major
// over (row, column); the prefix rows (cls, registers) are kept.
struct ResampleGrid {
  ResampleAxis height;
  ResampleAxis width;
  int64_t prefix;
};

}  // namespace posenc
