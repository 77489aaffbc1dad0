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

// RoPE scaling, the fields of a Hugging Face `rope_scaling` / `rope_parameters` dict. An unset field takes its
// type's default; a set one is used as given, so an invalid value (a zero factor, say) is refused, never
// replaced by the default. Fields of no use to the type are ignored.
struct RopeScaling {
  // "default", "linear", "dynamic" (NTK, runtime), "ntk" (fixed NTK, alpha), "yarn", "llama3", "longrope".
  // "ntk_alpha", and "dynamic" with alpha set (HunYuan checkpoints), mean "ntk".
  std::string rope_type = "default";
  std::optional<double> rope_theta;  // replaces `base` when set (Hugging Face v5 keeps theta here)
  std::optional<double> factor;
  std::optional<double> alpha;  // fixed NTK: theta * alpha^(r / (r - 2)); `factor` when unset
  std::optional<double> original_max_position_embeddings;
  std::optional<double> max_position_embeddings;  // the model's context length (dynamic, yarn, longrope)
  std::optional<double> attention_factor;
  std::optional<double> beta_fast;
  std::optional<double> beta_slow;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  bool truncate = true;
  std::optional<double> low_freq_factor;
  std::optional<double> high_freq_factor;
  std::vector<double> short_factor;
  std::vector<double> long_factor;
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

// Every check of rope_for_length, reading metadata only: the Meta kernel of posenc::rope_inv_freq_for_length
// refuses what the real one refuses.
void check_rope_for_length(int64_t rotary_dim, double base, const RopeScaling& scaling, const at::Tensor& seq_len);

}  // namespace posenc::frequencies
