// The single schema table of posenc. Kernels live in one file per op family and dispatch key
// (cpu/, meta/, autograd/) and are attached there with TORCH_LIBRARY_IMPL; the ops that compute a
// configuration's constants (frequencies, slopes, context-parallel positions) have theirs in config/ops.cpp.
#include <posenc/frequencies.h>

#include <torch/library.h>

// ", float? rope_theta=None, ..., float[]? long_factor=None": the scaling keywords of rope_inv_freq and
// rope_inv_freq_for_length, written from their list (posenc/frequencies.h).
#define POSENC_SCALING_KEYWORD(A, type, key, cpp_default, schema_type, schema_default) \
  ", " schema_type " " #key "=" schema_default
#define POSENC_SCALING_SCHEMA POSENC_ROPE_SCALING_KEYS(POSENC_SCALING_KEYWORD, )

TORCH_LIBRARY(posenc, m) {
  // The CPU capability the kernels run with: "default", "avx2" or "avx512".
  m.def("cpu_capability() -> str");

  // Shared: deterministic scatter-add of row gradients into an embedding table.
  m.def("embedding_backward(Tensor grad, Tensor indices, SymInt num_rows, float scale=1.0, int? padding_idx=None) -> Tensor");

  // Sinusoidal.
  // float64 frequencies base^(-i / (dim // 2 - shift)), i < dim // 2.
  m.def("sinusoidal_inv_freq(int dim, float base=10000.0, int shift=0, Device? device=None) -> Tensor");
  m.def("sinusoidal(Tensor positions, Tensor inv_freq, str layout=\"interleaved\", ScalarType? dtype=None, int offset=0) -> Tensor");
  m.def("add_sinusoidal(Tensor x, Tensor? positions, Tensor inv_freq, float x_scale=1.0, str layout=\"interleaved\", int offset=0) -> Tensor");
  m.def("embed_sinusoidal(Tensor tokens, Tensor token_weight, Tensor? positions, Tensor inv_freq, float token_scale=1.0, int? padding_idx=None, str layout=\"interleaved\", int offset=0) -> Tensor");

  // Learned absolute.
  m.def("learned(Tensor weight, Tensor positions, int offset=0, int? padding_idx=None) -> Tensor");
  m.def("add_learned(Tensor x, Tensor weight, Tensor? positions=None, int offset=0, int? padding_idx=None) -> Tensor");
  m.def("embed_learned(Tensor tokens, Tensor token_weight, Tensor pos_weight, Tensor? positions=None, float token_scale=1.0, int? padding_idx=None, int offset=0, int? pos_padding_idx=None) -> Tensor");
  m.def("make_positions(Tensor tokens, int padding_idx) -> Tensor");
  m.def("positions_from_mask(Tensor attention_mask, int pad_position=0) -> Tensor");

  // Rotary.
  // pair_axis [pairs]: multi-axis positions ([n_axes, S], [n_axes, B, S] or [n_axes, T]; images, video, multimodal
  // text), frequency pair i rotating by the position of axis pair_axis[i].
  m.def("rope(Tensor x, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> Tensor");
  m.def("rope_backward(Tensor grad, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> Tensor");
  m.def("rope_qk(Tensor q, Tensor k, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> (Tensor, Tensor)");
  m.def("rope_qk_backward(Tensor grad_q, Tensor grad_k, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) x, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> ()");
  m.def("rope_cos_sin(Tensor x, Tensor cos, Tensor sin, str layout=\"neox\", str format=\"bshd\") -> Tensor");
  m.def("rope_cos_sin_backward(Tensor grad, Tensor cos, Tensor sin, str layout=\"neox\", str format=\"bshd\") -> Tensor");
  // Frequencies and attention scale of a scaling type; the keywords are the keys of Hugging Face's rope_parameters
  // (absent: the type's default). seq_len selects the dynamic NTK base and LongRoPE's short or long factors.
  m.def("rope_inv_freq(int rotary_dim, float base=10000.0, str rope_type=\"default\", *" POSENC_SCALING_SCHEMA ", int? seq_len=None) -> (Tensor inv_freq, float attention_scale)");
  // The same frequencies for the length held by a 0-d tensor, on its device and without reading it (per call).
  m.def("rope_inv_freq_for_length(Tensor seq_len, int rotary_dim, float base=10000.0, str rope_type=\"default\", *" POSENC_SCALING_SCHEMA ") -> Tensor");
  // Context parallelism, dual-chunk (zigzag) split: this rank's positions (and, packed, its token indices).
  m.def("zigzag_positions(int seq_len, int cp_size, int cp_rank, Device? device=None) -> Tensor");
  m.def("zigzag_positions_varlen(Tensor cu_seqlens, int cp_size, int cp_rank) -> (Tensor positions, Tensor indices, Tensor local_cu_seqlens)");
  // Multi-axis frequencies: inv_freq float64 [pairs] with pair_axis int64 [pairs], the axis driving each pair.
  m.def("multiaxis_inv_freq(int[] axes_dim, float[] bases) -> (Tensor inv_freq, Tensor pair_axis)");
  m.def("axial_inv_freq(int rotary_dim, int n_axes=2, float base=10000.0) -> (Tensor inv_freq, Tensor pair_axis)");
  m.def("mrope_pair_axis(int[] mrope_section, bool interleaved=False, Device? device=None) -> Tensor");
  m.def("mrope_inv_freq(int rotary_dim, int[] mrope_section, float base=10000.0, bool interleaved=False) -> (Tensor inv_freq, Tensor pair_axis)");
  // Patch positions of an image [2, H * W] (row, column) and of a video [3, F * H * W] (time, row, column).
  m.def("image_positions(int height, int width, Device? device=None) -> Tensor");
  m.def("video_positions(int frames, int height, int width, float time_interval=1.0, Device? device=None) -> Tensor");
  // Qwen2-VL's M-RoPE positions [3, B, S] (and rope_deltas [B, 1]) of text and vision tokens.
  m.def("mrope_positions(Tensor token_types, Tensor? image_grid_thw=None, Tensor? video_grid_thw=None, Tensor? attention_mask=None, int spatial_merge_size=2, float? tokens_per_second=None, Tensor? second_per_grid_ts=None, bool split_video_frames=False) -> (Tensor, Tensor)");

  // ALiBi.
  // dtype None is float32 (an optional: AOTInductor cannot replay a ScalarType argument's default).
  m.def("alibi_slopes(int num_heads, ScalarType? dtype=None, Device? device=None) -> Tensor");
  m.def("alibi_bias(Tensor slopes, SymInt q_len, SymInt k_len, str mode=\"causal\", int head_offset=0, SymInt? num_heads=None, ScalarType? dtype=None) -> Tensor");
  m.def("add_alibi(Tensor scores, Tensor slopes, str mode=\"causal\", int head_offset=0) -> Tensor");
  // `alibi_mode`, not `mode`: torch.compile's auto_functionalized passes a mutable op's arguments as keywords
  // beside its own `mode` parameter, so a mutable op cannot have an argument named mode.
  m.def("add_alibi_(Tensor(a!) scores, Tensor slopes, str alibi_mode=\"causal\", int head_offset=0) -> ()");
  m.def("alibi_backward(Tensor grad, Tensor slopes, str mode=\"causal\", int head_offset=0) -> Tensor");

  // T5 relative bias.
  m.def("relative_position_bucket(Tensor relative_position, bool bidirectional=True, int num_buckets=32, int max_distance=128) -> Tensor");
  m.def("t5_bias(Tensor weight, SymInt q_len, SymInt k_len, bool bidirectional, int num_buckets, int max_distance, SymInt q_offset=0) -> Tensor");
  m.def("t5_bias_backward(Tensor grad, bool bidirectional, int num_buckets, int max_distance, SymInt q_offset=0) -> Tensor");
}
