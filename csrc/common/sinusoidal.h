#pragma once
// Checks of the sinusoidal family, shared by its CPU, CUDA and Meta kernels, and its op layer, shared by the CPU
// and CUDA kernels.
#include "common/checks.h"
#include "families.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

namespace posenc {

// An input of width D carries 2F encoded channels; an odd width keeps one last channel unencoded
// (the zero column of fairseq and diffusers for odd d_model).
inline void check_encoded_width(const char* op, const char* arg, const c10::SymInt& width, const at::Tensor& inv_freq) {
  const auto pairs = inv_freq.sym_size(0);
  TORCH_CHECK(width == pairs * 2 || width == pairs * 2 + 1, "posenc.", op, ": ", arg, " has ", width,
              " channels but inv_freq has ", pairs, " frequencies; expected ", pairs * 2, " or ",
              pairs * 2 + 1, " channels");
}

// pair_axis [pairs] (multi-axis positions): int64 or int32, one axis per frequency pair of inv_freq; its values are
// checked on real data by the devices.
inline void check_sinusoidal_axes(const char* op, const at::Tensor& pair_axis, const at::Tensor& inv_freq,
                                  const at::Tensor& ref) {
  check_index(op, "pair_axis", pair_axis);
  check_same_device(op, "pair_axis", pair_axis, ref);
  TORCH_CHECK(pair_axis.dim() == 1 && pair_axis.sym_size(0) == inv_freq.sym_size(0), "posenc.", op,
              ": pair_axis has shape ", pair_axis.sym_sizes(), " but needs [", inv_freq.sym_size(0),
              "], one axis per frequency pair of inv_freq");
}

// Returns the output dtype: `dtype`, else that of floating positions, else float32.
inline at::ScalarType check_sinusoidal(const at::Tensor& positions, const at::Tensor& inv_freq, std::string_view layout,
                                       std::optional<at::ScalarType> dtype,
                                       const std::optional<at::Tensor>& pair_axis) {
  constexpr const char* op = "sinusoidal";
  check_positions_dtype(op, positions);
  check_inv_freq(op, inv_freq);
  check_same_device(op, "inv_freq", inv_freq, positions);
  parse_sinusoidal_layout(op, layout);
  if (pair_axis) {
    check_sinusoidal_axes(op, *pair_axis, inv_freq, positions);
    TORCH_CHECK(positions.dim() >= 1 && positions.sym_size(0) >= 1, "posenc.", op, ": positions has shape ",
                positions.sym_sizes(), " but with pair_axis needs a leading axis dimension, [n_axes, ...]");
  }
  const auto out_dtype =
      dtype.value_or(at::isFloatingType(positions.scalar_type()) ? positions.scalar_type() : at::kFloat);
  TORCH_CHECK(at::isFloatingType(out_dtype), "posenc.", op, ": dtype must be floating, got ", out_dtype);
  return out_dtype;
}

// Returns whether the positions are shared across the leading dimensions of x.
inline bool check_add_sinusoidal(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                 const at::Tensor& inv_freq, std::string_view layout,
                                 const std::optional<at::Tensor>& pair_axis, int64_t num_prefix_tokens) {
  constexpr const char* op = "add_sinusoidal";
  check_floating(op, "x", x);
  TORCH_CHECK(x.dim() >= 2, "posenc.", op, ": x must be [..., S, D], got shape ", x.sym_sizes());
  check_inv_freq(op, inv_freq);
  check_same_device(op, "inv_freq", inv_freq, x);
  if (positions) check_same_device(op, "positions", *positions, x);
  parse_sinusoidal_layout(op, layout);
  check_encoded_width(op, "x", x.sym_size(-1), inv_freq);
  const auto seq = x.sym_size(-2);
  TORCH_CHECK(num_prefix_tokens >= 0 && seq >= num_prefix_tokens, "posenc.", op, ": num_prefix_tokens ",
              num_prefix_tokens, " is outside [0, S] for x of shape ", x.sym_sizes(), " (S = ", seq, ")");
  // The shape of the encoded tokens' positions: x's leading shape, less the prefix tokens.
  auto row_shape = x.sym_sizes().slice(0, x.dim() - 1).vec();
  row_shape.back() = row_shape.back() - num_prefix_tokens;
  if (!pair_axis) return check_row_positions(op, "x", row_shape, positions);
  check_sinusoidal_axes(op, *pair_axis, inv_freq, x);
  // "[n_axes, 2, 6]": the per-row shape written inside the axis dimension's brackets
  std::string per_row = "[n_axes";
  for (const auto& size : row_shape) per_row += c10::str(", ", size);
  per_row += "]";
  TORCH_CHECK(positions.has_value(), "posenc.", op, ": pair_axis needs positions with a leading axis dimension, [n_axes, ",
              row_shape.back(), "] or ", per_row, "; got none");
  check_positions_dtype(op, *positions);
  const auto shape = positions->sym_sizes();
  const bool has_axes = !shape.empty() && shape[0] >= 1;
  if (has_axes && shape.size() == 2 && shape[1] == row_shape.back()) return true;
  TORCH_CHECK(has_axes && shape.slice(1).equals(row_shape), "posenc.", op, ": positions has shape ", shape,
              " but with pair_axis needs [n_axes, ", row_shape.back(), "] or ", per_row, " (n_axes >= 1) for x of shape ",
              x.sym_sizes(), num_prefix_tokens > 0 ? c10::str(" and num_prefix_tokens ", num_prefix_tokens) : std::string());
  return false;
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

// The rows an encode call fills: num_positions rows of encodings (P), shared by the output's rows / P leading
// indices, in sequences whose prefix tokens get none (portable/types.h).
struct EncodedRows {
  int64_t num_positions;
  SequenceRows sequence;
};

// The ops of the sinusoidal family on one device: checks, allocation, positions and dtype dispatch, the same on
// every device. The device supplies the rest:
//   Guard, empty            CpuDevice or CudaDevice: the guard that makes a device current for the call
//                           (nothing to do on the CPU), and empty(sizes, options), a contiguous output;
//   read_positions(op, positions, count, offset, pair_axis)
//                           positions plus offset (offset + arange(count) when absent), checked against the
//                           angle domain, with pair_axis's values checked against positions' axes, as its encode
//                           reads them;
//   check_indices(op, arg, indices, limit, limit_name)
//                           every index in [0, limit), with the CPU's message;
//   encode<scalar_t>(in, ids, out, positions, inv_freq, layout, scale, rows)
//                           out = in * scale + PE(positions), in being x rows, rows ids of a token table (ids
//                           defined), or undefined (the encoding alone).
template <typename Device>
struct SinusoidalOps {
  static at::Tensor sinusoidal(const at::Tensor& positions, const at::Tensor& inv_freq, c10::string_view layout,
                               std::optional<at::ScalarType> dtype, int64_t offset,
                               const std::optional<at::Tensor>& pair_axis) {
    constexpr const char* op = "sinusoidal";
    const auto out_dtype = check_sinusoidal(positions, inv_freq, layout, dtype, pair_axis);
    auto sizes = positions.sizes().vec();
    if (pair_axis) sizes.erase(sizes.begin());
    sizes.push_back(2 * inv_freq.size(0));
    auto out = Device::empty(sizes, positions.options().dtype(out_dtype));
    if (out.numel() == 0) return out;
    const typename Device::Guard guard(positions.device());
    const auto pos = Device::read_positions(op, positions, 0, offset, pair_axis);
    const int64_t tokens = out.numel() / out.size(-1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "posenc_sinusoidal", [&] {
      Device::template encode<scalar_t>({}, {}, out, pos, inv_freq, parse_sinusoidal_layout(op, layout), 1.0,
                                        {tokens, {tokens, 0}});
    });
    return out;
  }

  static at::Tensor add_sinusoidal(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                   const at::Tensor& inv_freq, double x_scale, c10::string_view layout,
                                   int64_t offset, const std::optional<at::Tensor>& pair_axis,
                                   int64_t num_prefix_tokens) {
    constexpr const char* op = "add_sinusoidal";
    const bool shared = check_add_sinusoidal(x, positions, inv_freq, layout, pair_axis, num_prefix_tokens);
    const auto input = x.contiguous();
    auto out = Device::empty(input.sizes(), input.options());
    if (input.numel() == 0) return out;
    const typename Device::Guard guard(x.device());
    const int64_t seq = input.size(-2);
    const auto pos = Device::read_positions(op, positions, seq - num_prefix_tokens, offset, pair_axis);
    const int64_t rows = input.numel() / input.size(-1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_sinusoidal", [&] {
      Device::template encode<scalar_t>(input, {}, out, pos, inv_freq, parse_sinusoidal_layout(op, layout), x_scale,
                                        {shared ? seq : rows, {seq, num_prefix_tokens}});
    });
    return out;
  }

  static at::Tensor embed_sinusoidal(const at::Tensor& tokens, const at::Tensor& token_weight,
                                     const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                     double token_scale, std::optional<int64_t> padding_idx, c10::string_view layout,
                                     int64_t offset) {
    constexpr const char* op = "embed_sinusoidal";
    const bool shared = check_embed_sinusoidal(tokens, token_weight, positions, inv_freq, padding_idx, layout);
    const typename Device::Guard guard(tokens.device());
    Device::check_indices(op, "tokens", tokens, token_weight.size(0), "the vocabulary of token_weight, size");
    auto sizes = tokens.sizes().vec();
    sizes.push_back(token_weight.size(1));
    auto out = Device::empty(sizes, token_weight.options());
    if (out.numel() == 0) return out;
    const int64_t seq = tokens.size(-1);
    const auto pos = Device::read_positions(op, positions, seq, offset, std::nullopt);
    const auto ids = tokens.to(at::kLong).contiguous();
    const auto weight = token_weight.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_embed_sinusoidal", [&] {
      Device::template encode<scalar_t>(weight, ids, out, pos, inv_freq, parse_sinusoidal_layout(op, layout),
                                        token_scale, {shared ? seq : tokens.numel(), {seq, 0}});
    });
    return out;
  }

  static void register_kernels(torch::Library& m) {
    POSENC_SINUSOIDAL_OPS(POSENC_IMPL_MEMBER, SinusoidalOps)
  }
};

}  // namespace posenc
