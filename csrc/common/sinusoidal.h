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

// The ops of the sinusoidal family on one device: checks, allocation, positions and dtype dispatch, the same on
// every device. The device supplies the rest:
//   Guard, empty            CpuDevice or CudaDevice: the guard that makes a device current for the call
//                           (nothing to do on the CPU), and empty(sizes, options), a contiguous output;
//   read_positions(op, positions, count, offset)
//                           positions plus offset (offset + arange(count) when absent), checked against the
//                           angle domain, as its encode reads them;
//   check_indices(op, arg, indices, limit, limit_name)
//                           every index in [0, limit), with the CPU's message;
//   encode<scalar_t>(in, ids, out, positions, inv_freq, layout, scale)
//                           out = in * scale + PE(positions), in being x rows, rows ids of a token table (ids
//                           defined), or undefined (the encoding alone).
template <typename Device>
struct SinusoidalOps {
  static at::Tensor sinusoidal(const at::Tensor& positions, const at::Tensor& inv_freq, c10::string_view layout,
                               std::optional<at::ScalarType> dtype, int64_t offset) {
    constexpr const char* op = "sinusoidal";
    const auto out_dtype = check_sinusoidal(positions, inv_freq, layout, dtype);
    auto sizes = positions.sizes().vec();
    sizes.push_back(2 * inv_freq.size(0));
    auto out = Device::empty(sizes, positions.options().dtype(out_dtype));
    if (out.numel() == 0) return out;
    const typename Device::Guard guard(positions.device());
    const auto pos = Device::read_positions(op, positions, 0, offset);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "posenc_sinusoidal", [&] {
      Device::template encode<scalar_t>({}, {}, out, pos, inv_freq, parse_sinusoidal_layout(op, layout), 1.0);
    });
    return out;
  }

  static at::Tensor add_sinusoidal(const at::Tensor& x, const std::optional<at::Tensor>& positions,
                                   const at::Tensor& inv_freq, double x_scale, c10::string_view layout,
                                   int64_t offset) {
    constexpr const char* op = "add_sinusoidal";
    check_add_sinusoidal(x, positions, inv_freq, layout);
    const auto input = x.contiguous();
    auto out = Device::empty(input.sizes(), input.options());
    if (input.numel() == 0) return out;
    const typename Device::Guard guard(x.device());
    const auto pos = Device::read_positions(op, positions, input.size(-2), offset);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_sinusoidal", [&] {
      Device::template encode<scalar_t>(input, {}, out, pos, inv_freq, parse_sinusoidal_layout(op, layout), x_scale);
    });
    return out;
  }

  static at::Tensor embed_sinusoidal(const at::Tensor& tokens, const at::Tensor& token_weight,
                                     const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                     double token_scale, std::optional<int64_t> padding_idx, c10::string_view layout,
                                     int64_t offset) {
    constexpr const char* op = "embed_sinusoidal";
    check_embed_sinusoidal(tokens, token_weight, positions, inv_freq, padding_idx, layout);
    const typename Device::Guard guard(tokens.device());
    Device::check_indices(op, "tokens", tokens, token_weight.size(0), "the vocabulary of token_weight, size");
    auto sizes = tokens.sizes().vec();
    sizes.push_back(token_weight.size(1));
    auto out = Device::empty(sizes, token_weight.options());
    if (out.numel() == 0) return out;
    const auto pos = Device::read_positions(op, positions, tokens.size(-1), offset);
    const auto ids = tokens.to(at::kLong).contiguous();
    const auto weight = token_weight.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_embed_sinusoidal", [&] {
      Device::template encode<scalar_t>(weight, ids, out, pos, inv_freq, parse_sinusoidal_layout(op, layout),
                                        token_scale);
    });
    return out;
  }

  static void register_kernels(torch::Library& m) {
    POSENC_SINUSOIDAL_OPS(POSENC_IMPL_MEMBER, SinusoidalOps)
  }
};

}  // namespace posenc
