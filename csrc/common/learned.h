#pragma once
// Checks of the learned family, shared by its CPU, CUDA and Meta kernels (metadata only), and its op layer,
// shared by the CPU and CUDA kernels. The range of position values needs the data, so each device's reader of
// table rows checks it.
#include "common/checks.h"
#include "families.h"
#include "common/positions.h"
#include "portable/resample.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/ne.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>

namespace posenc {

// An embedding table: [rows, D], floating.
inline void check_table(const char* op, const char* arg, const at::Tensor& table) {
  check_floating(op, arg, table);
  TORCH_CHECK(table.dim() == 2, "posenc.", op, ": ", arg, " must be [rows, D], got shape ", table.sym_sizes());
}

inline void check_same_dtype(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& ref,
                             const char* ref_arg) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "posenc.", op, ": ", arg, " is ", t.scalar_type(), " but ",
              ref_arg, " is ", ref.scalar_type());
}

inline void check_same_width(const char* op, const char* arg, const c10::SymInt& width, const at::Tensor& table,
                             const char* table_arg) {
  TORCH_CHECK(width == table.sym_size(1), "posenc.", op, ": ", arg, " has ", width, " channels but ", table_arg,
              " has ", table.sym_size(1));
}

// Learned positions index a table, so they are integers (floating positions are sinusoidal-only).
inline void check_learned_positions(const char* op, const std::optional<at::Tensor>& positions,
                                    const at::Tensor& ref) {
  if (!positions) return;
  check_index(op, "positions", *positions);
  check_same_device(op, "positions", *positions, ref);
}

inline void check_learned(const at::Tensor& weight, const at::Tensor& positions, std::optional<int64_t> padding_idx) {
  constexpr const char* op = "learned";
  check_table(op, "weight", weight);
  check_learned_positions(op, positions, weight);
  check_padding_idx(op, padding_idx, weight.sym_size(0));
}

// x [..., S, D] of a floating dtype and a table [rows, D] of its device, dtype and width: what the ops that add table
// rows to x check first.
inline void check_rows_and_table(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_floating(op, "x", x);
  TORCH_CHECK(x.dim() >= 2, "posenc.", op, ": x must be [..., S, D], got shape ", x.sym_sizes());
  check_table(op, "weight", weight);
  check_same_device(op, "weight", weight, x);
  check_same_dtype(op, "weight", weight, x, "x");
  check_same_width(op, "x", x.sym_size(-1), weight, "weight");
}

// Returns whether the positions are shared across the leading dimensions of x.
inline bool check_add_learned(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& positions,
                              std::optional<int64_t> padding_idx) {
  constexpr const char* op = "add_learned";
  check_rows_and_table(op, x, weight);
  check_learned_positions(op, positions, x);
  check_padding_idx(op, padding_idx, weight.sym_size(0));
  return check_row_positions(op, "x", x.sym_sizes().slice(0, x.dim() - 1), positions);
}

inline bool check_embed_learned(const at::Tensor& tokens, const at::Tensor& token_weight, const at::Tensor& pos_weight,
                                const std::optional<at::Tensor>& positions, std::optional<int64_t> padding_idx,
                                std::optional<int64_t> pos_padding_idx) {
  constexpr const char* op = "embed_learned";
  check_index(op, "tokens", tokens);
  TORCH_CHECK(tokens.dim() >= 1, "posenc.", op, ": tokens must be [..., S], got a 0-d tensor");
  check_table(op, "token_weight", token_weight);
  check_table(op, "pos_weight", pos_weight);
  check_same_device(op, "token_weight", token_weight, tokens);
  check_same_device(op, "pos_weight", pos_weight, tokens);
  check_same_dtype(op, "pos_weight", pos_weight, token_weight, "token_weight");
  check_same_width(op, "token_weight", token_weight.sym_size(1), pos_weight, "pos_weight");
  check_learned_positions(op, positions, tokens);
  check_padding_idx(op, padding_idx, token_weight.sym_size(0));
  check_padding_idx(op, pos_padding_idx, pos_weight.sym_size(0));
  return check_row_positions(op, "tokens", tokens.sym_sizes(), positions);
}

inline void check_make_positions(const at::Tensor& tokens, int64_t padding_idx) {
  constexpr const char* op = "make_positions";
  check_index(op, "tokens", tokens);
  TORCH_CHECK(tokens.dim() >= 1, "posenc.", op, ": tokens must be [..., S], got a 0-d tensor");
  // The last position is padding_idx + S: it must fit in int64.
  const auto seq_len = tokens.sym_size(-1);
  const auto room = c10::SymInt(std::numeric_limits<int64_t>::max()) - seq_len;
  TORCH_CHECK(padding_idx < room, "posenc.", op, ": padding_idx ", padding_idx, " leaves no room for ", seq_len,
              " positions in int64");
}

// Any real (non-complex) dtype: Hugging Face masks are int64, others pass bool or float masks.
inline void check_positions_from_mask(const at::Tensor& attention_mask) {
  constexpr const char* op = "positions_from_mask";
  check_defined(op, "attention_mask", attention_mask);
  TORCH_CHECK(!at::isComplexType(attention_mask.scalar_type()), "posenc.", op,
              ": attention_mask must be a bool, integer or floating tensor, got ", attention_mask.scalar_type());
  TORCH_CHECK(attention_mask.dim() >= 1, "posenc.", op, ": attention_mask must be [..., S], got a 0-d tensor");
}

// ---- resampled tables (resample_learned, add_resampled_learned, resample_learned_backward)

// A grid: two positive sizes, int64_t (the op layer) or SymInt (the Meta kernels: an image's grid may be symbolic
// under torch.compile and torch.export, and its checks then guard on it).
template <typename Grid>
void check_grid(const char* op, const char* arg, Grid grid, int64_t num_prefix_tokens) {
  using Size = std::decay_t<decltype(grid[0])>;
  TORCH_CHECK(grid.size() == 2 && grid[0] > 0 && grid[1] > 0, "posenc.", op, ": ", arg,
              " must be two positive sizes (rows, columns), got ", grid);
  const Size most = Size(std::numeric_limits<int64_t>::max() - std::max<int64_t>(num_prefix_tokens, 0)) / grid[1];
  TORCH_CHECK(grid[0] <= most, "posenc.", op, ": ", arg, " ", grid, " with num_prefix_tokens ", num_prefix_tokens,
              " has more tokens than int64 can count");
}

// The token count of a grid with its prefix rows, P + rows * columns.
template <typename Grid>
auto grid_tokens(Grid grid, int64_t num_prefix_tokens) {
  return grid[0] * grid[1] + num_prefix_tokens;
}

// The checks of the arguments every resampling op takes.
template <typename Grid>
void check_resample_args(const char* op, at::IntArrayRef source_grid, Grid grid, std::string_view mode,
                         const std::optional<at::ArrayRef<double>>& scale_factor, int64_t num_prefix_tokens) {
  check_grid(op, "source_grid", source_grid, num_prefix_tokens);
  check_grid(op, "grid", grid, num_prefix_tokens);
  TORCH_CHECK(mode == "bicubic" || mode == "bilinear", "posenc.", op,
              ": mode must be \"bicubic\" or \"bilinear\", got \"", mode, "\"");
  TORCH_CHECK(num_prefix_tokens >= 0, "posenc.", op, ": num_prefix_tokens must be >= 0, got ", num_prefix_tokens);
  if (scale_factor) {
    const auto& s = *scale_factor;
    TORCH_CHECK(s.size() == 2 && std::isfinite(s[0]) && std::isfinite(s[1]) && s[0] > 0 && s[1] > 0, "posenc.", op,
                ": scale_factor must be two positive finite numbers (rows, columns), got ", s);
  }
}

// What the kernels need of checked arguments: each axis's sizes, scale and filter (portable/resample.h).
inline ResampleGrid resample_plan(at::IntArrayRef source_grid, at::IntArrayRef grid, std::string_view mode,
                                  bool align_corners, bool antialias,
                                  const std::optional<at::ArrayRef<double>>& scale_factor, int64_t num_prefix_tokens) {
  const bool cubic = mode == "bicubic";
  const auto axis = [&](int64_t a) {
    const int64_t in = source_grid[a];
    const int64_t out = grid[a];
    double scale;
    if (align_corners) {
      scale = out > 1 ? static_cast<double>(in - 1) / static_cast<double>(out - 1) : 0.0;
    } else {
      scale = scale_factor ? 1.0 / (*scale_factor)[a] : static_cast<double>(in) / static_cast<double>(out);
    }
    const double support = (cubic ? 2.0 : 1.0) * (antialias && scale >= 1.0 ? scale : 1.0);
    const int64_t max_taps = antialias ? static_cast<int64_t>(std::ceil(support)) * 2 + 1 : (cubic ? 4 : 2);
    return ResampleAxis{in, out, scale, cubic, antialias, align_corners, support, max_taps};
  };
  return {axis(0), axis(1), num_prefix_tokens};
}

template <typename Grid>
void check_grid_table(const char* op, const char* arg, const c10::SymInt& rows, Grid grid, const char* grid_arg,
                      int64_t num_prefix_tokens) {
  TORCH_CHECK(rows == grid_tokens(grid, num_prefix_tokens), "posenc.", op, ": ", arg, " has ", rows,
              " rows but num_prefix_tokens + prod(", grid_arg, ") = ", num_prefix_tokens, " + ", grid[0], " * ",
              grid[1], " = ", grid_tokens(grid, num_prefix_tokens));
}

template <typename Grid>
void check_resample_learned(const at::Tensor& weight, at::IntArrayRef source_grid, Grid grid, std::string_view mode,
                            const std::optional<at::ArrayRef<double>>& scale_factor, int64_t num_prefix_tokens) {
  constexpr const char* op = "resample_learned";
  check_resample_args(op, source_grid, grid, mode, scale_factor, num_prefix_tokens);
  check_table(op, "weight", weight);
  check_grid_table(op, "weight", weight.sym_size(0), source_grid, "source_grid", num_prefix_tokens);
}

template <typename Grid>
void check_add_resampled_learned(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef source_grid,
                                 Grid grid, std::string_view mode,
                                 const std::optional<at::ArrayRef<double>>& scale_factor, int64_t num_prefix_tokens) {
  constexpr const char* op = "add_resampled_learned";
  check_resample_args(op, source_grid, grid, mode, scale_factor, num_prefix_tokens);
  check_rows_and_table(op, x, weight);
  check_grid_table(op, "weight", weight.sym_size(0), source_grid, "source_grid", num_prefix_tokens);
  check_grid_table(op, "x", x.sym_size(-2), grid, "grid", num_prefix_tokens);
}

template <typename Grid>
void check_resample_learned_backward(const at::Tensor& grad, at::IntArrayRef source_grid, Grid grid,
                                     std::string_view mode, const std::optional<at::ArrayRef<double>>& scale_factor,
                                     int64_t num_prefix_tokens) {
  constexpr const char* op = "resample_learned_backward";
  check_resample_args(op, source_grid, grid, mode, scale_factor, num_prefix_tokens);
  check_floating(op, "grad", grad);
  TORCH_CHECK(grad.dim() >= 2, "posenc.", op, ": grad must be [..., S, D], got shape ", grad.sym_sizes());
  check_grid_table(op, "grad", grad.sym_size(-2), grid, "grid", num_prefix_tokens);
}

// The ops of the learned family on one device: checks, allocation, table rows and dtype dispatch, the same on
// every device. The device supplies the rest:
//   Guard, empty            CpuDevice or CudaDevice: the guard that makes a device current for the call
//                           (nothing to do on the CPU), and empty(sizes, options), a contiguous output;
//   read_table_rows(op, positions, count, offset, domain)
//                           positions plus offset (offset + arange(count) when absent), checked against the
//                           table's domain, as its add_rows reads them;
//   check_indices(op, arg, indices, limit, limit_name)
//                           every index in [0, limit), with the CPU's message;
//   add_rows<scalar_t>(in, ids, out, table, rows, scale)
//                           out = in * scale + table[rows], in being x rows, rows ids of a token table (ids
//                           defined), or undefined (the table rows alone);
//   count_positions(is_real, first, pad)
//                           along the last dimension of a bool mask: first + (count of real entries before
//                           each real entry), pad for the others.
//   resample<scalar_t>(table, out, grid)
//                           out = the contiguous table resampled to grid.*.out (portable/resample.h), prefix rows
//                           copied, float64 sums rounded once;
//   add_resampled<scalar_t>(in, out, table, grid)
//                           out = in + the contiguous table resampled as resample's out (rounded to scalar_t),
//                           each sum rounded once: add_rows of those rows, arange(S), scale 1;
//   resample_adjoint<scalar_t>(grad, out, grid)
//                           out = the adjoint applied to the contiguous grad's rows summed over its leading
//                           dimensions in order, float64 sums rounded once, the same bits for any thread count.
template <typename Device>
struct LearnedOps {
  static at::Tensor learned(const at::Tensor& weight, const at::Tensor& positions, int64_t offset,
                            std::optional<int64_t> padding_idx) {
    constexpr const char* op = "learned";
    check_learned(weight, positions, padding_idx);
    const typename Device::Guard guard(weight.device());
    const auto rows = Device::read_table_rows(op, positions, 0, offset, table_domain(weight.size(0), "weight"));
    auto sizes = positions.sizes().vec();
    sizes.push_back(weight.size(1));
    auto out = Device::empty(sizes, weight.options());
    if (out.numel() == 0) return out;
    const auto table = weight.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, table.scalar_type(), "posenc_learned", [&] {
      Device::template add_rows<scalar_t>({}, {}, out, table, rows, 1.0);
    });
    return out;
  }

  static at::Tensor add_learned(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& positions, int64_t offset,
                                std::optional<int64_t> padding_idx) {
    constexpr const char* op = "add_learned";
    check_add_learned(x, weight, positions, padding_idx);
    const typename Device::Guard guard(x.device());
    const auto rows =
        Device::read_table_rows(op, positions, x.size(-2), offset, table_domain(weight.size(0), "weight"));
    const auto input = x.contiguous();
    auto out = Device::empty(input.sizes(), input.options());
    if (out.numel() == 0) return out;
    const auto table = weight.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_learned", [&] {
      Device::template add_rows<scalar_t>(input, {}, out, table, rows, 1.0);
    });
    return out;
  }

  static at::Tensor embed_learned(const at::Tensor& tokens, const at::Tensor& token_weight,
                                  const at::Tensor& pos_weight, const std::optional<at::Tensor>& positions,
                                  double token_scale, std::optional<int64_t> padding_idx, int64_t offset,
                                  std::optional<int64_t> pos_padding_idx) {
    constexpr const char* op = "embed_learned";
    check_embed_learned(tokens, token_weight, pos_weight, positions, padding_idx, pos_padding_idx);
    const typename Device::Guard guard(tokens.device());
    Device::check_indices(op, "tokens", tokens, token_weight.size(0), "the vocabulary of token_weight, size");
    const auto rows = Device::read_table_rows(op, positions, tokens.size(-1), offset,
                                              table_domain(pos_weight.size(0), "pos_weight"));
    auto sizes = tokens.sizes().vec();
    sizes.push_back(token_weight.size(1));
    auto out = Device::empty(sizes, token_weight.options());
    if (out.numel() == 0) return out;
    const auto ids = tokens.to(at::kLong).contiguous();
    const auto token_table = token_weight.contiguous();
    const auto pos_table = pos_weight.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, token_table.scalar_type(), "posenc_embed_learned", [&] {
      Device::template add_rows<scalar_t>(token_table, ids, out, pos_table, rows, token_scale);
    });
    return out;
  }

  // fairseq: padding keeps padding_idx, real tokens count from padding_idx + 1.
  static at::Tensor make_positions(const at::Tensor& tokens, int64_t padding_idx) {
    check_make_positions(tokens, padding_idx);
    const typename Device::Guard guard(tokens.device());
    return Device::count_positions(at::ne(tokens.to(at::kLong), padding_idx), padding_idx + 1, padding_idx);
  }

  // Left padding: real tokens (any nonzero mask value, NaN included) count from 0 (cumsum(mask) - 1), masked
  // ones get pad_position.
  static at::Tensor positions_from_mask(const at::Tensor& attention_mask, int64_t pad_position) {
    check_positions_from_mask(attention_mask);
    const typename Device::Guard guard(attention_mask.device());
    return Device::count_positions(at::ne(attention_mask, 0), 0, pad_position);
  }

  static at::Tensor resample_learned(const at::Tensor& weight, at::IntArrayRef source_grid, at::IntArrayRef grid,
                                     c10::string_view mode, bool align_corners, bool antialias,
                                     std::optional<at::ArrayRef<double>> scale_factor, int64_t num_prefix_tokens) {
    check_resample_learned(weight, source_grid, grid, mode, scale_factor, num_prefix_tokens);
    const auto plan = resample_plan(source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens);
    const typename Device::Guard guard(weight.device());
    return resampled(weight, plan, grid_tokens(grid, num_prefix_tokens));
  }

  // x + the resampled table, the sums of add_learned (rows arange(S) of the resampled table).
  static at::Tensor add_resampled_learned(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef source_grid,
                                          at::IntArrayRef grid, c10::string_view mode, bool align_corners,
                                          bool antialias, std::optional<at::ArrayRef<double>> scale_factor,
                                          int64_t num_prefix_tokens) {
    check_add_resampled_learned(x, weight, source_grid, grid, mode, scale_factor, num_prefix_tokens);
    const auto plan = resample_plan(source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens);
    const typename Device::Guard guard(x.device());
    const auto input = x.contiguous();
    auto out = Device::empty(input.sizes(), input.options());
    if (out.numel() == 0) return out;
    const auto table = weight.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_resampled_learned", [&] {
      Device::template add_resampled<scalar_t>(input, out, table, plan);
    });
    return out;
  }

  static at::Tensor resample_learned_backward(const at::Tensor& grad, at::IntArrayRef source_grid,
                                              at::IntArrayRef grid, c10::string_view mode, bool align_corners,
                                              bool antialias, std::optional<at::ArrayRef<double>> scale_factor,
                                              int64_t num_prefix_tokens) {
    check_resample_learned_backward(grad, source_grid, grid, mode, scale_factor, num_prefix_tokens);
    const auto plan = resample_plan(source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens);
    const typename Device::Guard guard(grad.device());
    const int64_t width = grad.size(-1);
    auto out = Device::empty({grid_tokens(source_grid, num_prefix_tokens), width}, grad.options());
    if (out.numel() == 0) return out;
    if (grad.numel() == 0) return out.zero_();
    const auto input = grad.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_resample_learned_backward",
                                    [&] { Device::template resample_adjoint<scalar_t>(input, out, plan); });
    return out;
  }

  static void register_kernels(torch::Library& m) {
    POSENC_LEARNED_OPS(POSENC_IMPL_MEMBER, LearnedOps)
  }

 private:
  // weight [P + Hs * Ws, D] resampled to [tokens, D] (tokens = P + H * W).
  static at::Tensor resampled(const at::Tensor& weight, const ResampleGrid& plan, int64_t tokens) {
    auto out = Device::empty({tokens, weight.size(1)}, weight.options());
    if (out.numel() == 0) return out;
    const auto table = weight.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, table.scalar_type(), "posenc_resample_learned",
                                    [&] { Device::template resample<scalar_t>(table, out, plan); });
    return out;
  }
};

}  // namespace posenc
