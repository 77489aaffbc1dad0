#pragma once
// Checks of the sinusoidal family, shared by its CPU and Meta kernels.
#include "common/checks.h"

namespace posenc {

// An input of width D carries 2F encoded channels; an odd width keeps one last channel unencoded
// (the zero column of fairseq and diffusers for odd d_model).
inline void check_encoded_width(const char* op, const char* arg, const c10::SymInt& width, const at::Tensor& inv_freq) {
  const auto pairs = inv_freq.sym_size(0);
  TORCH_CHECK(width == pairs * 2 || width == pairs * 2 + 1, "posenc.", op, ": ", arg, " has ", width,
              " channels but inv_freq has ", pairs, " frequencies; expected ", pairs * 2, " or ",
              pairs * 2 + 1, " channels");
}

// Returns the output dtype: `dtype`, else that of floating positions, else float32.
inline at::ScalarType check_sinusoidal(const at::Tensor& positions, const at::Tensor& inv_freq, std::string_view layout,
                                       std::optional<at::ScalarType> dtype) {
  constexpr const char* op = "sinusoidal";
  check_positions_dtype(op, positions);
  check_inv_freq(op, inv_freq);
  check_same_device(op, "inv_freq", inv_freq, positions);
  parse_sinusoidal_layout(op, layout);
  const auto out_dtype =
      dtype.value_or(at::isFloatingType(positions.scalar_type()) ? positions.scalar_type() : at::kFloat);
  TORCH_CHECK(at::isFloatingType(out_dtype), "posenc.", op, ": dtype must be floating, got ", out_dtype);
  return out_dtype;
}

// Returns whether the positions are shared across the leading dimensions of x.
inline bool check_add_sinusoidal(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                 const at::Tensor& inv_freq, std::string_view layout) {
  constexpr const char* op = "add_sinusoidal";
  check_floating(op, "x", x);
  TORCH_CHECK(x.dim() >= 2, "posenc.", op, ": x must be [..., S, D], got shape ", x.sym_sizes());
  check_inv_freq(op, inv_freq);
  check_same_device(op, "inv_freq", inv_freq, x);
  if (positions) check_same_device(op, "positions", *positions, x);
  parse_sinusoidal_layout(op, layout);
  check_encoded_width(op, "x", x.sym_size(-1), inv_freq);
  return check_row_positions(op, "x", x.sym_sizes().slice(0, x.dim() - 1), positions);
}

inline bool check_embed_sinusoidal(const at::Tensor& tokens, const at::Tensor& token_weight,
                                   const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                   std::optional<int64_t> padding_idx, std::string_view layout) {
  constexpr const char* op = "embed_sinusoidal";
  check_index(op, "tokens", tokens);
  TORCH_CHECK(tokens.dim() >= 1, "posenc.", op, ": tokens must be [..., S], got a 0-d tensor");
  check_floating(op, "token_weight", token_weight);
  TORCH_CHECK(token_weight.dim() == 2, "posenc.", op, ": token_weight must be [vocab, D], got shape ",
              token_weight.sym_sizes());
  check_inv_freq(op, inv_freq);
  check_same_device(op, "token_weight", token_weight, tokens);
  check_same_device(op, "inv_freq", inv_freq, tokens);
  if (positions) check_same_device(op, "positions", *positions, tokens);
  parse_sinusoidal_layout(op, layout);
  check_encoded_width(op, "token_weight", token_weight.sym_size(1), inv_freq);
  check_padding_idx(op, padding_idx, token_weight.sym_size(0));
  return check_row_positions(op, "tokens", tokens.sym_sizes(), positions);
}

}  // namespace posenc
