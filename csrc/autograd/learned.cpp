// Autograd of the learned family: torch::autograd::Functions at the Autograd key that call the forward
// ops below autograd and scatter gradients into the tables with the deterministic embedding_backward (a resampled
// table's, with resample_learned_backward). Only integer positions/tokens and arguments are saved, never x or a
// table. A call with nothing to record (grad mode
// off, or no table or x requiring grad) goes straight below autograd, as PyTorch's VariableType kernels do.
#include <posenc/embedding.h>
#include <posenc/learned.h>

#include "autograd/kernels.h"
#include "families.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/arange.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace posenc {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The table rows the forward read: positions + offset, or offset + arange(seq_len) without positions.
at::Tensor position_rows(const at::Tensor& positions, const c10::SymInt& seq_len, int64_t offset,
                         const at::TensorOptions& options) {
  if (positions.defined()) return offset == 0 ? positions : positions.to(at::kLong).add(offset);
  return at::arange(c10::Scalar(offset), c10::Scalar(seq_len + offset), options.dtype(at::kLong));
}

void save_table(AutogradContext* ctx, const char* name, const at::Tensor& table, std::optional<int64_t> padding_idx,
                const char* padding_name) {
  ctx->saved_data[name] = table.sym_size(0);
  ctx->saved_data[padding_name] = padding_idx;
}

struct Learned : public torch::autograd::Function<Learned> {
  static constexpr const char* kOp = "posenc::learned";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& positions,
                            int64_t offset, std::optional<int64_t> padding_idx) {
    ctx->save_for_backward({positions});
    save_table(ctx, "rows", weight, padding_idx, "padding_idx");
    ctx->saved_data["offset"] = offset;
    at::AutoDispatchBelowADInplaceOrView guard;
    return learned(weight, positions, offset, padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto& grad = grad_outputs[0];
    const auto rows = position_rows(ctx->get_saved_variables()[0], 0, ctx->saved_data["offset"].toInt(),
                                    grad.options());
    return {embedding_backward_symint(grad, rows, ctx->saved_data["rows"].toSymInt(), 1.0,
                                      ctx->saved_data["padding_idx"].toOptional<int64_t>()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto learned_autograd = POSENC_AUTOGRAD(Learned);

// d/dx is the identity; d/dweight scatters grad's rows to the positions read.
struct AddLearned : public torch::autograd::Function<AddLearned> {
  static constexpr const char* kOp = "posenc::add_learned";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& positions, int64_t offset,
                            std::optional<int64_t> padding_idx) {
    ctx->save_for_backward({positions.value_or(at::Tensor())});
    save_table(ctx, "rows", weight, padding_idx, "padding_idx");
    ctx->saved_data["offset"] = offset;
    at::AutoDispatchBelowADInplaceOrView guard;
    return add_learned(x, weight, positions, offset, padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto& grad = grad_outputs[0];
    at::Tensor grad_weight;
    if (ctx->needs_input_grad(1)) {
      const auto rows = position_rows(ctx->get_saved_variables()[0], grad.sym_size(-2),
                                      ctx->saved_data["offset"].toInt(), grad.options());
      grad_weight = embedding_backward_symint(grad, rows, ctx->saved_data["rows"].toSymInt(), 1.0,
                                              ctx->saved_data["padding_idx"].toOptional<int64_t>());
    }
    return {ctx->needs_input_grad(0) ? grad : at::Tensor(), grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto add_learned_autograd = POSENC_AUTOGRAD(AddLearned);

// d/dtoken_weight: grad's rows scattered to their tokens, times token_scale; d/dpos_weight: to positions.
struct EmbedLearned : public torch::autograd::Function<EmbedLearned> {
  static constexpr const char* kOp = "posenc::embed_learned";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& token_weight,
                            const at::Tensor& pos_weight, const std::optional<at::Tensor>& positions,
                            double token_scale, std::optional<int64_t> padding_idx, int64_t offset,
                            std::optional<int64_t> pos_padding_idx) {
    ctx->save_for_backward({tokens, positions.value_or(at::Tensor())});
    save_table(ctx, "vocab", token_weight, padding_idx, "padding_idx");
    save_table(ctx, "rows", pos_weight, pos_padding_idx, "pos_padding_idx");
    ctx->saved_data["token_scale"] = token_scale;
    ctx->saved_data["offset"] = offset;
    at::AutoDispatchBelowADInplaceOrView guard;
    return embed_learned(tokens, token_weight, pos_weight, positions, token_scale, padding_idx, offset,
                         pos_padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto& grad = grad_outputs[0];
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad_tokens_table;
    at::Tensor grad_pos_table;
    if (ctx->needs_input_grad(1)) {
      grad_tokens_table = embedding_backward_symint(grad, saved[0], ctx->saved_data["vocab"].toSymInt(),
                                                    ctx->saved_data["token_scale"].toDouble(),
                                                    ctx->saved_data["padding_idx"].toOptional<int64_t>());
    }
    if (ctx->needs_input_grad(2)) {
      const auto rows = position_rows(saved[1], grad.sym_size(-2),
                                      ctx->saved_data["offset"].toInt(), grad.options());
      grad_pos_table = embedding_backward_symint(grad, rows, ctx->saved_data["rows"].toSymInt(), 1.0,
                                                 ctx->saved_data["pos_padding_idx"].toOptional<int64_t>());
    }
    return {at::Tensor(), grad_tokens_table, grad_pos_table, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};
constexpr auto embed_learned_autograd = POSENC_AUTOGRAD(EmbedLearned);

// The arguments every resampling op takes, kept in the context for the backward.
struct ResampleArgs {
  std::vector<int64_t> source_grid;
  std::vector<c10::SymInt> grid;  // an image's grid: symbolic under torch.compile and torch.export
  std::string mode;
  bool align_corners;
  bool antialias;
  std::optional<std::vector<double>> scale_factor;
  int64_t num_prefix_tokens;

  void save(AutogradContext* ctx) const {
    ctx->saved_data["source_grid"] = source_grid;
    ctx->saved_data["grid"] = c10::SymIntArrayRef(grid);
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["align_corners"] = align_corners;
    ctx->saved_data["antialias"] = antialias;
    ctx->saved_data["has_scale_factor"] = scale_factor.has_value();
    ctx->saved_data["scale_factor"] = scale_factor.value_or(std::vector<double>{});
    ctx->saved_data["num_prefix_tokens"] = num_prefix_tokens;
  }

  static ResampleArgs load(AutogradContext* ctx) {
    auto& saved = ctx->saved_data;
    return {saved["source_grid"].toIntVector(), saved["grid"].toSymIntVector(), saved["mode"].toStringRef(),
            saved["align_corners"].toBool(), saved["antialias"].toBool(),
            saved["has_scale_factor"].toBool() ? std::optional(saved["scale_factor"].toDoubleVector()) : std::nullopt,
            saved["num_prefix_tokens"].toInt()};
  }

  std::optional<at::ArrayRef<double>> scale() const {
    return scale_factor ? std::optional<at::ArrayRef<double>>(*scale_factor) : std::nullopt;
  }

  // The table resampled from source_grid to grid (forward: true), or the adjoint back (false).
  at::Tensor apply(const at::Tensor& t, bool forward) const {
    return forward ? resample_learned_symint(t, source_grid, grid, mode, align_corners, antialias, scale(),
                                             num_prefix_tokens)
                   : resample_learned_backward_symint(t, source_grid, grid, mode, align_corners, antialias, scale(),
                                                      num_prefix_tokens);
  }
};

ResampleArgs resample_args(at::IntArrayRef source_grid, c10::SymIntArrayRef grid, c10::string_view mode,
                           bool align_corners, bool antialias, std::optional<at::ArrayRef<double>> scale_factor,
                           int64_t num_prefix_tokens) {
  return {source_grid.vec(), grid.vec(), std::string(mode), align_corners, antialias,
          scale_factor ? std::optional(scale_factor->vec()) : std::nullopt, num_prefix_tokens};
}

// Linear in weight: d/dweight = resample_learned_backward(grad). Nothing but the arguments is saved.
struct ResampleLearned : public torch::autograd::Function<ResampleLearned> {
  static constexpr const char* kOp = "posenc::resample_learned";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight, at::IntArrayRef source_grid,
                            c10::SymIntArrayRef grid, c10::string_view mode, bool align_corners, bool antialias,
                            std::optional<at::ArrayRef<double>> scale_factor, int64_t num_prefix_tokens) {
    resample_args(source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens).save(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;
    return resample_learned_symint(weight, source_grid, grid, mode, align_corners, antialias, scale_factor,
                                   num_prefix_tokens);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return {ResampleArgs::load(ctx).apply(grad_outputs[0], false), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(),  at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto resample_learned_autograd = POSENC_AUTOGRAD(ResampleLearned);

// d/dx is the identity; d/dweight = resample_learned_backward(grad), grad's leading dimensions summed.
struct AddResampledLearned : public torch::autograd::Function<AddResampledLearned> {
  static constexpr const char* kOp = "posenc::add_resampled_learned";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            at::IntArrayRef source_grid, c10::SymIntArrayRef grid, c10::string_view mode,
                            bool align_corners, bool antialias, std::optional<at::ArrayRef<double>> scale_factor,
                            int64_t num_prefix_tokens) {
    resample_args(source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens).save(ctx);
    at::AutoDispatchBelowADInplaceOrView guard;
    return add_resampled_learned_symint(x, weight, source_grid, grid, mode, align_corners, antialias, scale_factor,
                                        num_prefix_tokens);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto& grad = grad_outputs[0];
    return {ctx->needs_input_grad(0) ? grad : at::Tensor(),
            ctx->needs_input_grad(1) ? ResampleArgs::load(ctx).apply(grad, false) : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto add_resampled_learned_autograd = POSENC_AUTOGRAD(AddResampledLearned);

// The adjoint is linear in grad, and its own adjoint is the resampling: d/dgrad = resample_learned(g), broadcast
// over grad's leading dimensions. So double backward works.
struct ResampleLearnedBackward : public torch::autograd::Function<ResampleLearnedBackward> {
  static constexpr const char* kOp = "posenc::resample_learned_backward";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, at::IntArrayRef source_grid,
                            c10::SymIntArrayRef grid, c10::string_view mode, bool align_corners, bool antialias,
                            std::optional<at::ArrayRef<double>> scale_factor, int64_t num_prefix_tokens) {
    resample_args(source_grid, grid, mode, align_corners, antialias, scale_factor, num_prefix_tokens).save(ctx);
    ctx->saved_data["grad_sizes"] = grad.sym_sizes();
    at::AutoDispatchBelowADInplaceOrView guard;
    return resample_learned_backward_symint(grad, source_grid, grid, mode, align_corners, antialias, scale_factor,
                                            num_prefix_tokens);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto sizes = ctx->saved_data["grad_sizes"].toSymIntVector();
    return {ResampleArgs::load(ctx).apply(grad_outputs[0], true).expand_symint(sizes), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto resample_learned_backward_autograd = POSENC_AUTOGRAD(ResampleLearnedBackward);

// Integer outputs, even for a floating mask that requires grad.
constexpr auto make_positions_autograd = POSENC_BELOW_AUTOGRAD(make_positions);
constexpr auto positions_from_mask_autograd = POSENC_BELOW_AUTOGRAD(positions_from_mask);

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) { POSENC_LEARNED_OPS(POSENC_IMPL_SUFFIXED, _autograd) }

}  // namespace posenc
