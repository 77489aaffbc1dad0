#pragma once
// The schema table of posenc: every op's signature, once, in its family's list. Every layer expands the lists:
// registration.cpp defines the schemas, a family's CPU and CUDA op layer, its Meta and Autograd kernels and the
// autocast policy register their kernels, so an op added to its family's list fails to compile until every layer
// has its kernel, and a kernel whose C++ types differ from the schema fails when the library loads.
//
// Each list takes a macro X and an argument A and expands to X(A, op, "(arguments) -> returns") for every op of the
// family; an X that registers kernels ignores the schema (`#define X(A, op, ...)`).
#include <posenc/frequencies.h>

// ", float? rope_theta=None, ..., float[]? long_factor=None": the scaling keywords of rope_inv_freq and
// rope_inv_freq_for_length, written from their list (posenc/frequencies.h).
#define POSENC_SCALING_KEYWORD(A, type, key, cpp_default, schema_type, schema_default) \
  ", " schema_type " " #key "=" schema_default
#define POSENC_SCALING_SCHEMA POSENC_ROPE_SCALING_KEYS(POSENC_SCALING_KEYWORD, )

// Deterministic scatter-add of row gradients into an embedding table, shared by the sinusoidal and learned families.
#define POSENC_EMBEDDING_OPS(X, A) \
  X(A, embedding_backward, "(Tensor grad, Tensor indices, SymInt num_rows, float scale=1.0, int? padding_idx=None) -> Tensor")

// Multi-axis (images, video): pair_axis [pairs] as in rotary, positions [n_axes, ...], pair i encoding the position of
// axis pair_axis[i]. num_prefix_tokens: the first tokens along S (cls, registers) get no encoding, x * x_scale exactly.
#define POSENC_SINUSOIDAL_OPS(X, A) \
  X(A, sinusoidal, "(Tensor positions, Tensor inv_freq, str layout=\"interleaved\", ScalarType? dtype=None, int offset=0, Tensor? pair_axis=None) -> Tensor") \
  X(A, add_sinusoidal, "(Tensor x, Tensor? positions, Tensor inv_freq, float x_scale=1.0, str layout=\"interleaved\", int offset=0, Tensor? pair_axis=None, int num_prefix_tokens=0) -> Tensor") \
  X(A, embed_sinusoidal, "(Tensor tokens, Tensor token_weight, Tensor? positions, Tensor inv_freq, float token_scale=1.0, int? padding_idx=None, str layout=\"interleaved\", int offset=0) -> Tensor")

// Learned absolute. resample_learned: a [P + Hs * Ws, D] table of a source_grid (Hs, Ws) resampled to grid (H, W)
// as F.interpolate resamples an image (P = num_prefix_tokens rows kept as they are); add_resampled_learned adds it
// to x [..., P + H * W, D]; resample_learned_backward is its adjoint (grad's leading dimensions summed). grid is
// SymInt[]: an image's patch grid stays symbolic under torch.compile and torch.export, as x's token count does.
#define POSENC_RESAMPLE_ARGS \
  ", str mode=\"bicubic\", bool align_corners=False, bool antialias=False, float[]? scale_factor=None, int num_prefix_tokens=0"
#define POSENC_LEARNED_OPS(X, A) \
  X(A, learned, "(Tensor weight, Tensor positions, int offset=0, int? padding_idx=None) -> Tensor") \
  X(A, add_learned, "(Tensor x, Tensor weight, Tensor? positions=None, int offset=0, int? padding_idx=None) -> Tensor") \
  X(A, embed_learned, "(Tensor tokens, Tensor token_weight, Tensor pos_weight, Tensor? positions=None, float token_scale=1.0, int? padding_idx=None, int offset=0, int? pos_padding_idx=None) -> Tensor") \
  X(A, make_positions, "(Tensor tokens, int padding_idx) -> Tensor") \
  X(A, positions_from_mask, "(Tensor attention_mask, int pad_position=0) -> Tensor") \
  X(A, resample_learned, "(Tensor weight, int[] source_grid, SymInt[] grid" POSENC_RESAMPLE_ARGS ") -> Tensor") \
  X(A, add_resampled_learned, "(Tensor x, Tensor weight, int[] source_grid, SymInt[] grid" POSENC_RESAMPLE_ARGS ") -> Tensor") \
  X(A, resample_learned_backward, "(Tensor grad, int[] source_grid, SymInt[] grid" POSENC_RESAMPLE_ARGS ") -> Tensor")

// Under autocast, the ops that cast their floating arguments as torch.add casts its operands (to their promoted
// dtype), with the arguments they cast: x + embedding(weight), embedding(token_weight) + embedding(pos_weight).
// Every other op runs in the dtypes it is given (autocast/autocast.cpp says why).
#define POSENC_AUTOCAST_PROMOTED(X) \
  X(add_learned, "x", "weight") X(embed_learned, "token_weight", "pos_weight") X(add_resampled_learned, "x", "weight")

// The query scale of rope_qk and qk_norm_rope (Llama 4's attention temperature, Ministral 3's llama_4_scaling_beta):
// q, and only q, times 1 + q_scale_beta * log(1 + floor((p + q_scale_shift) / q_scale_length)) at position p.
#define POSENC_Q_SCALE_ARGS ", float q_scale_beta=0.0, int q_scale_length=1, int q_scale_shift=0"

// Rotary. pair_axis [pairs]: multi-axis positions ([n_axes, S], [n_axes, B, S] or [n_axes, T]; images, video,
// multimodal text), frequency pair i rotating by the position of axis pair_axis[i].
#define POSENC_ROPE_OPS(X, A) \
  X(A, rope, "(Tensor x, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> Tensor") \
  X(A, rope_backward, "(Tensor grad, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> Tensor") \
  X(A, rope_qk, "(Tensor q, Tensor k, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None" POSENC_Q_SCALE_ARGS ") -> (Tensor, Tensor)") \
  X(A, rope_qk_backward, "(Tensor grad_q, Tensor grad_k, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None" POSENC_Q_SCALE_ARGS ") -> (Tensor, Tensor)") \
  X(A, rope_, "(Tensor(a!) x, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> ()") \
  X(A, rope_cos_sin, "(Tensor x, Tensor cos, Tensor sin, str layout=\"neox\", str format=\"bshd\") -> Tensor") \
  X(A, rope_cos_sin_backward, "(Tensor grad, Tensor cos, Tensor sin, str layout=\"neox\", str format=\"bshd\") -> Tensor")

// QK-norm + RoPE: q and k each RMS-normalized (per head with a [head_dim] weight, over all heads of a token with a
// [heads * head_dim] one), scaled by their weight, then rotated as rope_qk rotates. norm: the rounding convention,
// "llama" (Qwen3, Llama: normalized value rounded to the input dtype, then times the weight), "gemma" (weight 1 + w,
// float32 until the norm's output), "olmo2" (float32 until the norm's output) or "fused" (float32 from load to
// store). The backward recomputes the norm from q and k and returns the weights' gradients too.
#define POSENC_QK_NORM_ROPE_ARGS                                                                                   \
  "Tensor q_weight, Tensor k_weight, Tensor? positions, Tensor inv_freq, float eps=1e-06, str norm=\"llama\", "    \
  "float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, " \
  "Tensor? pair_axis=None" POSENC_Q_SCALE_ARGS
#define POSENC_QK_NORM_OPS(X, A)                                                                                   \
  X(A, qk_norm_rope, "(Tensor q, Tensor k, " POSENC_QK_NORM_ROPE_ARGS ") -> (Tensor, Tensor)")                      \
  X(A, qk_norm_rope_backward, "(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, " POSENC_QK_NORM_ROPE_ARGS        \
    ") -> (Tensor, Tensor, Tensor, Tensor)")                                                                      \
  X(A, qk_norm_rope_, "(Tensor(a!) q, Tensor(b!) k, " POSENC_QK_NORM_ROPE_ARGS ") -> ()")

// Decoding through a KV cache: q rotated in place as rope_qk rotates it; k rotated and v copied into their caches
// (cache_format "bhsd" [B, H_kv, S_max, D], "bshd" [B, S_max, H_kv, D], or "shd" [S_max, H_kv, D], one pool of slots
// for every token), token (b, s) at slot cache_positions[b, s] (or [s]; None: its rotary position); k and v unchanged.
#define POSENC_KV_CACHE_OPS(X, A) \
  X(A, rope_qk_cache_, "(Tensor(a!) q, Tensor k, Tensor v, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor? positions, Tensor inv_freq, Tensor? cache_positions=None, str cache_format=\"bhsd\", float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None" POSENC_Q_SCALE_ARGS ") -> ()")

// ALiBi. `alibi_mode`, not `mode`, in add_alibi_: torch.compile's auto_functionalized passes a mutable op's arguments
// as keywords beside its own `mode` parameter, so a mutable op cannot have an argument named mode.
#define POSENC_ALIBI_OPS(X, A) \
  X(A, alibi_bias, "(Tensor slopes, SymInt q_len, SymInt k_len, str mode=\"causal\", int head_offset=0, SymInt? num_heads=None, ScalarType? dtype=None) -> Tensor") \
  X(A, add_alibi, "(Tensor scores, Tensor slopes, str mode=\"causal\", int head_offset=0) -> Tensor") \
  X(A, add_alibi_, "(Tensor(a!) scores, Tensor slopes, str alibi_mode=\"causal\", int head_offset=0) -> ()") \
  X(A, alibi_backward, "(Tensor grad, Tensor slopes, str mode=\"causal\", int head_offset=0) -> Tensor")

// T5 relative bias.
#define POSENC_T5_OPS(X, A) \
  X(A, relative_position_bucket, "(Tensor relative_position, bool bidirectional=True, int num_buckets=32, int max_distance=128) -> Tensor") \
  X(A, t5_bias, "(Tensor weight, SymInt q_len, SymInt k_len, bool bidirectional, int num_buckets, int max_distance, SymInt q_offset=0) -> Tensor") \
  X(A, t5_bias_backward, "(Tensor grad, bool bidirectional, int num_buckets, int max_distance, SymInt q_offset=0) -> Tensor")

// Qwen2-VL's M-RoPE positions [3, B, S] (and rope_deltas [B, 1]) of text, image and video tokens.
#define POSENC_MULTIAXIS_OPS(X, A) \
  X(A, mrope_positions, "(Tensor token_types, Tensor? image_grid_thw=None, Tensor? video_grid_thw=None, Tensor? attention_mask=None, int spatial_merge_size=2, float? tokens_per_second=None, Tensor? second_per_grid_ts=None, bool split_video_frames=False) -> (Tensor, Tensor)")

// Configuration constants (frequencies, slopes, position grids), computed on the CPU by config/ops.cpp's kernels at
// CompositeExplicitAutograd, which the ops without a tensor argument reach whatever the device.
//   sinusoidal_inv_freq: float64 base^(-i / (dim // 2 - shift)), i < dim // 2.
//   rope_inv_freq: frequencies and attention scale of a scaling type; the keywords are the keys of Hugging Face's
//     rope_parameters (absent: the type's default); seq_len selects the dynamic NTK base and LongRoPE's short or
//     long factors. rope_inv_freq_for_length: the same for the length held by a 0-d tensor, on its device and
//     without reading it (per call).
//   zigzag_positions(_varlen): context parallelism, dual-chunk split: this rank's positions (and, packed, its token
//     indices).
//   multiaxis_inv_freq, axial_inv_freq, mrope_inv_freq: float64 inv_freq [pairs] with int64 pair_axis [pairs], the
//     axis driving each pair.
//   image_positions [2, H * W] (row, column), video_positions [3, F * H * W] (time, row, column).
//   grid_positions: float32 [n_axes, prod(grid)], axis a at index i: (i + (crop_from[a] - grid[a]) // 2) / scale[a]
//     / interpolation_scale, each division in float32 (diffusers' coordinates, SD3's centre crop).
//   patch_center_positions: float32 [2, num_prefix_tokens + H * W], DINOv3's (row, column) patch centres in [-1, 1]
//     (zeros for the prefix tokens), with its training augmentations drawn from `generator`.
//   grid_sinusoidal_inv_freq: the frequencies, pair axes and layout of a multi-axis sincos convention ("mae",
//     "timm", "timm_interleaved", "cogvideox").
//   alibi_slopes: dtype None is float32 (an optional: AOTInductor cannot replay a ScalarType argument's default).
#define POSENC_CONFIG_OPS(X, A) \
  X(A, sinusoidal_inv_freq, "(int dim, float base=10000.0, int shift=0, Device? device=None) -> Tensor") \
  X(A, rope_inv_freq, "(int rotary_dim, float base=10000.0, str rope_type=\"default\", *" POSENC_SCALING_SCHEMA ", int? seq_len=None) -> (Tensor inv_freq, float attention_scale)") \
  X(A, rope_inv_freq_for_length, "(Tensor seq_len, int rotary_dim, float base=10000.0, str rope_type=\"default\", *" POSENC_SCALING_SCHEMA ") -> Tensor") \
  X(A, zigzag_positions, "(int seq_len, int cp_size, int cp_rank, Device? device=None) -> Tensor") \
  X(A, zigzag_positions_varlen, "(Tensor cu_seqlens, int cp_size, int cp_rank) -> (Tensor positions, Tensor indices, Tensor local_cu_seqlens)") \
  X(A, multiaxis_inv_freq, "(int[] axes_dim, float[] bases) -> (Tensor inv_freq, Tensor pair_axis)") \
  X(A, axial_inv_freq, "(int rotary_dim, int n_axes=2, float base=10000.0) -> (Tensor inv_freq, Tensor pair_axis)") \
  X(A, mrope_pair_axis, "(int[] mrope_section, bool interleaved=False, Device? device=None) -> Tensor") \
  X(A, mrope_inv_freq, "(int rotary_dim, int[] mrope_section, float base=10000.0, bool interleaved=False) -> (Tensor inv_freq, Tensor pair_axis)") \
  X(A, image_positions, "(int height, int width, Device? device=None) -> Tensor") \
  X(A, grid_positions, "(int[] grid, int[]? crop_from=None, float[]? scale=None, float interpolation_scale=1.0, Device? device=None) -> Tensor") \
  X(A, patch_center_positions, "(int height, int width, int num_prefix_tokens=0, float? shift=None, float? jitter=None, float? rescale=None, Generator? generator=None, Device? device=None) -> Tensor") \
  X(A, grid_sinusoidal_inv_freq, "(int dim, str convention=\"mae\", float base=10000.0) -> (Tensor inv_freq, Tensor pair_axis, str layout)") \
  X(A, video_positions, "(int frames, int height, int width, float time_interval=1.0, Device? device=None) -> Tensor") \
  X(A, alibi_slopes, "(int num_heads, ScalarType? dtype=None, Device? device=None) -> Tensor")

// Every op of the schema table. cpu_capability: the CPU capability the kernels run with, "default", "avx2" or
// "avx512".
#define POSENC_ALL_OPS(X, A)                                                                                    \
  X(A, cpu_capability, "() -> str") POSENC_EMBEDDING_OPS(X, A) POSENC_SINUSOIDAL_OPS(X, A)                     \
      POSENC_LEARNED_OPS(X, A) POSENC_ROPE_OPS(X, A) POSENC_QK_NORM_OPS(X, A) POSENC_KV_CACHE_OPS(X, A) POSENC_ALIBI_OPS(X, A) POSENC_T5_OPS(X, A)                 \
          POSENC_MULTIAXIS_OPS(X, A) POSENC_CONFIG_OPS(X, A)

// X macros for the lists: m.impl of each op with the kernel Kernels::op (a family's op layer) or op<suffix>
// (learned_meta, add_learned_autograd), into the torch::Library named m.
#define POSENC_IMPL_MEMBER(Kernels, op, ...) m.impl(#op, TORCH_FN(Kernels::op));
#define POSENC_IMPL_SUFFIXED(suffix, op, ...) m.impl(#op, TORCH_FN(op##suffix));
