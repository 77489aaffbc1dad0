// The single schema table of posenc. Kernels live in one file per op family and dispatch key
// (cpu/, meta/, autograd/) and are attached there with TORCH_LIBRARY_IMPL.
#include <torch/library.h>

TORCH_LIBRARY(posenc, m) {
  // The CPU capability the kernels run with: "default", "avx2" or "avx512".
  m.def("cpu_capability() -> str");

  // Shared: deterministic scatter-add of row gradients into an embedding table.
  m.def("embedding_backward(Tensor grad, Tensor indices, SymInt num_rows, float scale=1.0, int? padding_idx=None) -> Tensor");

  // Sinusoidal (SPEC 4.1).
  m.def("sinusoidal(Tensor positions, Tensor inv_freq, str layout=\"interleaved\", ScalarType? dtype=None, int offset=0) -> Tensor");
  m.def("add_sinusoidal(Tensor x, Tensor? positions, Tensor inv_freq, float x_scale=1.0, str layout=\"interleaved\", int offset=0) -> Tensor");
  m.def("embed_sinusoidal(Tensor tokens, Tensor token_weight, Tensor? positions, Tensor inv_freq, float token_scale=1.0, int? padding_idx=None, str layout=\"interleaved\", int offset=0) -> Tensor");

  // Learned absolute (SPEC 4.2).
  m.def("learned(Tensor weight, Tensor positions, int offset=0, int? padding_idx=None) -> Tensor");
  m.def("add_learned(Tensor x, Tensor weight, Tensor? positions, int offset=0, int? padding_idx=None) -> Tensor");
  m.def("embed_learned(Tensor tokens, Tensor token_weight, Tensor pos_weight, Tensor? positions, float token_scale=1.0, int? padding_idx=None, int offset=0, int? pos_padding_idx=None) -> Tensor");
  m.def("make_positions(Tensor tokens, int padding_idx) -> Tensor");
  m.def("positions_from_mask(Tensor attention_mask, int pad_position=0) -> Tensor");

  // Rotary (SPEC 4.3).
  // pair_axis [pairs]: multi-axis positions ([n_axes, S], [n_axes, B, S] or [n_axes, T]; images, video, multimodal
  // text), frequency pair i rotating by the position of axis pair_axis[i].
  m.def("rope(Tensor x, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> Tensor");
  m.def("rope_backward(Tensor grad, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> Tensor");
  m.def("rope_qk(Tensor q, Tensor k, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> (Tensor, Tensor)");
  m.def("rope_qk_backward(Tensor grad_q, Tensor grad_k, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) x, Tensor? positions, Tensor inv_freq, float attention_scale=1.0, str layout=\"neox\", str format=\"bshd\", int offset=0, Tensor? cu_seqlens=None, Tensor? pair_axis=None) -> ()");
  m.def("rope_cos_sin(Tensor x, Tensor cos, Tensor sin, str layout=\"neox\", str format=\"bshd\") -> Tensor");
  m.def("rope_cos_sin_backward(Tensor grad, Tensor cos, Tensor sin, str layout=\"neox\", str format=\"bshd\") -> Tensor");
  // Qwen2-VL's M-RoPE positions [3, B, S] (and rope_deltas [B, 1]) of text and vision tokens.
  m.def("mrope_positions(Tensor token_types, Tensor? image_grid_thw=None, Tensor? video_grid_thw=None, Tensor? attention_mask=None, int spatial_merge_size=2, float? tokens_per_second=None, Tensor? second_per_grid_ts=None, bool split_video_frames=False) -> (Tensor, Tensor)");

  // ALiBi (SPEC 4.4).
  m.def("alibi_bias(Tensor slopes, SymInt q_len, SymInt k_len, str mode=\"causal\", int head_offset=0, SymInt? num_heads=None, ScalarType? dtype=None) -> Tensor");
  m.def("add_alibi(Tensor scores, Tensor slopes, str mode=\"causal\", int head_offset=0) -> Tensor");
  // `alibi_mode`, not `mode`: torch.compile's auto_functionalized passes a mutable op's arguments as keywords
  // beside its own `mode` parameter, so a mutable op cannot have an argument named mode.
  m.def("add_alibi_(Tensor(a!) scores, Tensor slopes, str alibi_mode=\"causal\", int head_offset=0) -> ()");
  m.def("alibi_backward(Tensor grad, Tensor slopes, str mode=\"causal\", int head_offset=0) -> Tensor");

  // T5 relative bias (SPEC 4.5).
  m.def("relative_position_bucket(Tensor relative_position, bool bidirectional=True, int num_buckets=32, int max_distance=128) -> Tensor");
  m.def("t5_bias(Tensor weight, SymInt q_len, SymInt k_len, bool bidirectional, int num_buckets, int max_distance, SymInt q_offset=0) -> Tensor");
  m.def("t5_bias_backward(Tensor grad, bool bidirectional, int num_buckets, int max_distance, SymInt q_offset=0) -> Tensor");
}
