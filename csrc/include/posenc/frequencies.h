#pragma once
// Frequencies (inv_freq, float64) of every family. These functions are the only implementation: the ops
// posenc::sinusoidal_inv_freq, posenc::rope_inv_freq and posenc::rope_inv_freq_for_length call them, and
// Python's posenc.frequencies calls those ops. Invalid arguments raise c10::ValueError (ValueError in Python)
// naming the argument and its value.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace posenc::frequencies {

// omega_i = base^(-i / (dim/2 - shift)), i < dim/2. shift 0: "Attention Is All You Need";
// shift 1: fairseq / tensor2tensor / Whisper / diffusers. dim >= 2, base finite and positive.
at::Tensor sinusoidal(int64_t dim, double base = 10000.0, int64_t shift = 0);

// The RoPE scaling keys, the fields of a Hugging Face `rope_scaling` / `rope_parameters` dict after rope_type, in
// the order of the keyword arguments of the ops rope_inv_freq and rope_inv_freq_for_length:
// X(A, C++ type, key, C++ default, schema type, schema default). RopeScaling's fields, those ops' schemas and
// their kernels' arguments are all written from this list.
#define POSENC_ROPE_SCALING_KEYS(X, A)                                                                           \
  X(A, std::optional<double>, rope_theta, std::nullopt, "float?", "None") /* replaces `base` when set */         \
  X(A, std::optional<double>, factor, std::nullopt, "float?", "None")                                           \
  X(A, std::optional<double>, alpha, std::nullopt, "float?", "None") /* fixed NTK; `factor` when unset */       \
  X(A, std::optional<double>, original_max_position_embeddings, std::nullopt, "float?", "None")                 \
  X(A, std::optional<double>, max_position_embeddings, std::nullopt, "float?", "None") /* the context */        \
  X(A, std::optional<double>, attention_factor, std::nullopt, "float?", "None")                                 \
  X(A, std::optional<double>, beta_fast, std::nullopt, "float?", "None")                                        \
  X(A, std::optional<double>, beta_slow, std::nullopt, "float?", "None")                                        \
  X(A, std::optional<double>, mscale, std::nullopt, "float?", "None")                                           \
  X(A, std::optional<double>, mscale_all_dim, std::nullopt, "float?", "None")                                   \
  X(A, bool, truncate, true, "bool", "True")                                                                    \
  X(A, std::optional<double>, low_freq_factor, std::nullopt, "float?", "None")                                  \
  X(A, std::optional<double>, high_freq_factor, std::nullopt, "float?", "None")                                 \
  X(A, std::vector<double>, short_factor, {}, "float[]?", "None")                                               \
  X(A, std::vector<double>, long_factor, {}, "float[]?", "None")                                                \
  X(A, std::optional<double>, partial_rotary_factor, std::nullopt, "float?", "None") /* proportional */

// RoPE scaling. An unset field takes its type's default; a set one is used as given, so an invalid value (a zero
// factor, say) is refused, never replaced by the default. Fields of no use to the type are ignored.
struct RopeScaling {
  // "default", "linear", "dynamic" (NTK, runtime), "ntk" (fixed NTK, alpha), "yarn", "llama3", "longrope",
  // "proportional" (Gemma 4). "ntk_alpha", and "dynamic" with alpha set (HunYuan checkpoints), mean "ntk".
  std::string rope_type = "default";
#define POSENC_ROPE_SCALING_FIELD(A, type, key, cpp_default, ...) type key = cpp_default;
  POSENC_ROPE_SCALING_KEYS(POSENC_ROPE_SCALING_FIELD, )
#undef POSENC_ROPE_SCALING_FIELD
};

struct RopeFrequencies {
  at::Tensor inv_freq;  // float64 [rotary_dim / 2]
  double attention_scale;
};

// inv_freq_i = theta^(-2i / rotary_dim) under `scaling`; seq_len (the current sequence length, max
// position + 1) selects the dynamic NTK base and the LongRoPE short/long factors.
RopeFrequencies rope(int64_t rotary_dim, double base = 10000.0, const RopeScaling& scaling = {},
                     std::optional<int64_t> seq_len = std::nullopt);

// The inv_freq of rope(rotary_dim, base, scaling, L) for the length L held by `seq_len` (a 0-d integer or
// floating tensor), on seq_len's device: one op whatever the length, so a traced or compiled caller
// (torch.compile with dynamic shapes, torch.export) gets one graph for every length. A CPU length is read; a
// CUDA one is not (a kernel evaluates the same formulas on the device). Equal bit for bit to rope(...).inv_freq
// for the same L.
at::Tensor rope_for_length(int64_t rotary_dim, double base, const RopeScaling& scaling, const at::Tensor& seq_len);

// rope_for_length through the op posenc::rope_inv_freq_for_length, whose kernel on the GPU evaluates the formulas
// on the device: a length held on the GPU is never read by the host, so the caller never waits for the GPU.
at::Tensor rope_for_length_op(int64_t rotary_dim, double base, const RopeScaling& scaling, const at::Tensor& seq_len);

// Every check of rope_for_length, reading metadata only: the Meta kernel of posenc::rope_inv_freq_for_length
// refuses what the real one refuses.
void check_rope_for_length(int64_t rotary_dim, double base, const RopeScaling& scaling, const at::Tensor& seq_len);

}  // namespace posenc::frequencies
