#pragma once
// Checks of the rotary family, shared by its CPU, CUDA and Meta kernels (metadata only, SymInt-aware), and the
// check of pair_axis's values that the CPU and CUDA ops run on a host copy of it.
#include "common/checks.h"
#include "families.h"
#include "portable/types.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace posenc {

inline RopeLayout parse_rope_layout(const char* op, std::string_view layout) {
  if (layout == "neox") return RopeLayout::Neox;
  if (layout == "gptj") return RopeLayout::Gptj;
  TORCH_CHECK(false, "posenc.", op, ": layout must be \"neox\" or \"gptj\", got \"", layout, "\"");
}

inline RopeFormat parse_rope_format(const char* op, std::string_view format) {
  if (format == "bshd") return RopeFormat::BSHD;
  if (format == "bhsd") return RopeFormat::BHSD;
  if (format == "sbhd") return RopeFormat::SBHD;
  if (format == "thd") return RopeFormat::THD;
  TORCH_CHECK(false, "posenc.", op, ": format must be \"bshd\", \"bhsd\", \"sbhd\" or \"thd\", got \"", format, "\"");
}

// The dimension of x holding batch, sequence, head and channel, in that order; -1: thd has no batch.
inline std::array<int64_t, 4> rope_dim_order(RopeFormat format) {
  switch (format) {
    case RopeFormat::BSHD: return {0, 1, 2, 3};
    case RopeFormat::BHSD: return {0, 2, 1, 3};
    case RopeFormat::SBHD: return {1, 0, 2, 3};
    case RopeFormat::THD: break;
  }
  return {-1, 0, 1, 2};
}

// Sizes of x as [batch, seq, heads, head_dim]; thd reads as one sequence of T tokens.
inline std::array<c10::SymInt, 4> rope_sizes(const at::Tensor& x, RopeFormat format) {
  const auto order = rope_dim_order(format);
  std::array<c10::SymInt, 4> sizes;
  for (const auto i : c10::irange(4)) sizes[i] = order[i] < 0 ? c10::SymInt(1) : x.sym_size(order[i]);
  return sizes;
}

// x must be a floating tensor in `format` whose heads hold at least rotary_dim channels.
inline std::array<c10::SymInt, 4> check_rope_input(const char* op, const char* arg, const at::Tensor& x,
                                                   RopeFormat format, const c10::SymInt& rotary_dim) {
  check_floating(op, arg, x);
  const int64_t want = format == RopeFormat::THD ? 3 : 4;
  TORCH_CHECK(x.dim() == want, "posenc.", op, ": ", arg, " must be ", want, "-D for its format, got shape ",
              x.sym_sizes());
  auto sizes = rope_sizes(x, format);
  TORCH_CHECK(sizes[3] >= rotary_dim, "posenc.", op, ": rotary_dim ", rotary_dim, " exceeds the head_dim ", sizes[3],
              " of ", arg);
  return sizes;
}

// cu_seqlens [N + 1] marks the sequences of a packed (thd) input; its values are checked on real data.
inline void check_cu_seqlens(const char* op, const std::optional<at::Tensor>& cu_seqlens, RopeFormat format,
                             const at::Tensor& x) {
  if (!cu_seqlens) return;
  TORCH_CHECK(format == RopeFormat::THD, "posenc.", op, ": cu_seqlens needs format \"thd\" (packed sequences)");
  check_index(op, "cu_seqlens", *cu_seqlens);
  check_same_device(op, "cu_seqlens", *cu_seqlens, x);
  TORCH_CHECK(cu_seqlens->dim() == 1 && cu_seqlens->sym_size(0) >= 1, "posenc.", op,
              ": cu_seqlens must be 1-D [num_sequences + 1], got shape ", cu_seqlens->sym_sizes());
}

// Rotary positions are integers (token indices) or real coordinates (image patch centres, DINOv3): int64, int32,
// float32 or float64, read exactly; half-precision positions would round most coordinates.
inline void check_rotary_positions_dtype(const char* op, const at::Tensor& positions) {
  const auto dtype = positions.scalar_type();
  TORCH_CHECK(dtype == at::kLong || dtype == at::kInt || dtype == at::kFloat || dtype == at::kDouble, "posenc.", op,
              ": positions must be an int64, int32, float32 or float64 tensor, got ", dtype);
}

// Positions: None (offset + arange, restarting per sequence with cu_seqlens), [S] (or [T]) shared by the
// batch, or [B, S]. Returns whether they are shared by every batch row.
inline bool check_rope_positions(const char* op, const std::optional<at::Tensor>& positions, RopeFormat format,
                                 const std::array<c10::SymInt, 4>& sizes, const at::Tensor& x) {
  if (!positions) return true;
  check_rotary_positions_dtype(op, *positions);
  check_same_device(op, "positions", *positions, x);
  const auto shape = positions->sym_sizes();
  if (shape.size() == 1 && shape[0] == sizes[1]) return true;
  const bool per_row = format != RopeFormat::THD && shape.size() == 2 && shape[0] == sizes[0] && shape[1] == sizes[1];
  TORCH_CHECK(per_row, "posenc.", op, ": positions has shape ", shape, " but needs [", sizes[1], "]",
              format == RopeFormat::THD ? "" : " or [batch, seq]", " for an input of shape ", x.sym_sizes());
  return false;
}

// Multi-axis positions (pair_axis given): a leading axis dimension, [n_axes, S] (or [n_axes, T]) shared by the
// batch or [n_axes, B, S], int64 or int32; pair_axis [pairs] names the axis of each frequency pair (its values
// are checked on real data). Returns whether the positions are shared by every batch row.
inline bool check_rope_axes(const char* op, const std::optional<at::Tensor>& positions,
                            const at::Tensor& pair_axis, const c10::SymInt& pairs, RopeFormat format,
                            const std::array<c10::SymInt, 4>& sizes, const at::Tensor& x) {
  check_index(op, "pair_axis", pair_axis);
  check_same_device(op, "pair_axis", pair_axis, x);
  TORCH_CHECK(pair_axis.dim() == 1 && pair_axis.sym_size(0) == pairs, "posenc.", op, ": pair_axis has shape ",
              pair_axis.sym_sizes(), " but needs [", pairs, "], one axis per frequency pair of inv_freq");
  TORCH_CHECK(positions.has_value(), "posenc.", op,
              ": pair_axis needs positions with a leading axis dimension, [n_axes, seq]",
              format == RopeFormat::THD ? "" : " or [n_axes, batch, seq]", "; got none");
  check_rotary_positions_dtype(op, *positions);
  check_same_device(op, "positions", *positions, x);
  const auto shape = positions->sym_sizes();
  const bool has_axes = !shape.empty() && shape[0] >= 1;
  if (has_axes && shape.size() == 2 && shape[1] == sizes[1]) return true;
  const bool per_row = has_axes && format != RopeFormat::THD && shape.size() == 3 && shape[1] == sizes[0] &&
                       shape[2] == sizes[1];
  const auto per_row_shape = format == RopeFormat::THD ? std::string() : c10::str(" or [n_axes, ", sizes[0], ", ",
                                                                                   sizes[1], "]");
  TORCH_CHECK(per_row, "posenc.", op, ": positions has shape ", shape, " but with pair_axis needs [n_axes, ",
              sizes[1], "]", per_row_shape, " (n_axes >= 1) for an input of shape ", x.sym_sizes());
  return false;
}

// The query scale: q_scale_length >= 1, q_scale_beta finite; q's heads fully rotated (the scale is folded into the
// rotation's coefficients, which the channels past rotary_dim never meet) and one position per token (no pair_axis).
inline QScale check_q_scale(const char* op, double beta, int64_t length, int64_t shift, const at::Tensor& q,
                            RopeFormat format, const c10::SymInt& rotary_dim,
                            const std::optional<at::Tensor>& pair_axis) {
  TORCH_CHECK(std::isfinite(beta), "posenc.", op, ": q_scale_beta must be finite, got ", beta);
  TORCH_CHECK(length >= 1, "posenc.", op, ": q_scale_length must be >= 1, got ", length);
  if (beta != 0.0) {
    const auto head_dim = rope_sizes(q, format)[3];
    TORCH_CHECK(head_dim == rotary_dim, "posenc.", op, ": q_scale_beta needs q's heads fully rotated, but rotary_dim ",
                rotary_dim, " < head_dim ", head_dim, " (scale the rest of q apart)");
    TORCH_CHECK(!pair_axis.has_value(), "posenc.", op,
                ": q_scale_beta takes one position per token; with pair_axis, scale q apart");
  }
  return {beta, length, shift};
}

struct RopeArgs {
  RopeLayout layout;
  RopeFormat format;
  bool shared_positions;  // one position (or cos/sin row) per sequence index serves every batch row
};

// Every check of rope / rope_backward / rope_ (inputs = {x}) and rope_qk / rope_qk_backward (inputs = {q, k});
// the values of cu_seqlens and pair_axis are checked on real data by the CPU op.
inline RopeArgs check_rope(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs,
                           const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                           std::string_view layout, std::string_view format,
                           const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis) {
  const auto pair_layout = parse_rope_layout(op, layout);
  const auto rope_format = parse_rope_format(op, format);
  check_inv_freq(op, inv_freq);
  const auto rotary_dim = inv_freq.sym_size(0) * 2;
  const auto& [first_name, first] = *inputs.begin();
  const auto sizes = check_rope_input(op, first_name, *first, rope_format, rotary_dim);
  for (const auto& [name, t] : inputs) {
    if (t == first) continue;
    const auto other = check_rope_input(op, name, *t, rope_format, rotary_dim);
    check_same_device(op, name, *t, *first);
    TORCH_CHECK(t->scalar_type() == first->scalar_type(), "posenc.", op, ": ", name, " is ", t->scalar_type(),
                " but ", first_name, " is ", first->scalar_type());
    TORCH_CHECK(other[0] == sizes[0] && other[1] == sizes[1], "posenc.", op, ": ", name, " has shape ",
                t->sym_sizes(), " whose batch and sequence sizes differ from those of ", first_name, " ",
                first->sym_sizes());
  }
  check_same_device(op, "inv_freq", inv_freq, *first);
  check_cu_seqlens(op, cu_seqlens, rope_format, *first);
  const bool shared = pair_axis ? check_rope_axes(op, positions, *pair_axis, inv_freq.sym_size(0), rope_format, sizes,
                                                  *first)
                                : check_rope_positions(op, positions, rope_format, sizes, *first);
  return {pair_layout, rope_format, shared};
}

struct RopeQkArgs {
  RopeArgs rope;
  QScale q_scale;
};

// check_rope's checks of the ops that take q and k (inputs = {q, k}, or {grad_q, grad_k, ...}) and the query scale's,
// which applies to the first input.
inline RopeQkArgs check_rope_qk(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs,
                                const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                std::string_view layout, std::string_view format,
                                const std::optional<at::Tensor>& cu_seqlens,
                                const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
                                int64_t q_scale_length, int64_t q_scale_shift) {
  const auto args = check_rope(op, inputs, positions, inv_freq, layout, format, cu_seqlens, pair_axis);
  return {args, check_q_scale(op, q_scale_beta, q_scale_length, q_scale_shift, *inputs.begin()->second, args.format,
                              inv_freq.sym_size(0) * 2, pair_axis)};
}

// rope_cos_sin: explicit cos/sin tables of width r <= head_dim, [S, r] or [B or 1, S, r] ([T, r] for thd),
// as Hugging Face builds them (each angle repeated in both channels of its pair).
inline RopeArgs check_rope_cos_sin(const char* op, const char* arg, const at::Tensor& x, const at::Tensor& cos,
                                   const at::Tensor& sin, std::string_view layout, std::string_view format) {
  const auto pair_layout = parse_rope_layout(op, layout);
  const auto rope_format = parse_rope_format(op, format);
  check_floating(op, "cos", cos);
  check_floating(op, "sin", sin);
  check_same_device(op, "cos", cos, x);
  check_same_device(op, "sin", sin, x);
  TORCH_CHECK(cos.sym_sizes().equals(sin.sym_sizes()), "posenc.", op, ": cos has shape ", cos.sym_sizes(),
              " but sin has shape ", sin.sym_sizes());
  TORCH_CHECK(cos.dim() == 2 || (cos.dim() == 3 && rope_format != RopeFormat::THD), "posenc.", op,
              ": cos must be [seq, rotary_dim]", rope_format == RopeFormat::THD ? "" : " or [batch, seq, rotary_dim]",
              ", got shape ", cos.sym_sizes());
  const auto rotary_dim = cos.sym_size(-1);
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "posenc.", op, ": rotary_dim ", rotary_dim,
              " (the last size of cos) must be even and positive");
  const auto sizes = check_rope_input(op, arg, x, rope_format, rotary_dim);
  const bool batch_ok = cos.dim() == 2 || cos.sym_size(0) == 1 || cos.sym_size(0) == sizes[0];
  TORCH_CHECK(batch_ok && cos.sym_size(-2) == sizes[1], "posenc.", op, ": cos has shape ", cos.sym_sizes(),
              " which does not match ", arg, " of shape ", x.sym_sizes(), " in format \"", format, "\"");
  return {pair_layout, rope_format, cos.dim() == 2 || cos.sym_size(0) == 1};
}

// x (and its output, the same tensor in place) as the kernels read it: [batch, seq, heads, head_dim] strides; the
// output in a format of its own when it is a cache (rope_qk_cache_).
template <typename scalar_t>
RotaryView<scalar_t> rotary_view(const at::Tensor& in, const at::Tensor& out, RopeFormat format,
                                 std::optional<RopeFormat> out_format = std::nullopt) {
  const auto order = rope_dim_order(format);
  const auto out_order = rope_dim_order(out_format.value_or(format));
  RotaryView<scalar_t> view{in.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), in.size(order[2]),
                            in.size(order[3]), {}, {}};
  for (int i = 0; i < 4; ++i) {
    view.in_stride[i] = order[i] < 0 ? 0 : in.stride(order[i]);
    view.out_stride[i] = out_order[i] < 0 ? 0 : out.stride(out_order[i]);
  }
  return view;
}

// The RMS normalization of one rotated tensor before its rotation (qk_norm_rope), as the op layer hands it to a
// device: weight [group] in maths precision (1 + w for gemma); in the backward, the forward's input and the
// weight's gradient [group] (maths precision, zeros) to write.
struct RotationNorm {
  at::Tensor weight;
  int64_t group;
  double eps;
  QkNorm convention;
  at::Tensor input;
  at::Tensor weight_grad;
};

// rope_qk_cache_'s caches as the op layer hands them to a device: the rotation's outputs[1] is k's cache, and v is
// copied into v_cache in the same pass; both caches in `format` (thd: one pool of slots), every token at its slot
// from cache_positions, else from its rotary position.
struct CacheWrite {
  const at::Tensor& v;
  const at::Tensor& v_cache;
  RopeFormat format;
  const std::optional<at::Tensor>& cache_positions;
};

// A rotation by angles as the op layer hands it to a device: inputs[v] rotated into outputs[v] (the same tensor in
// place) by angle(p, i) = p * inv_freq[i] (by minus it when inverse), the inputs of `batch` x `seq` tokens; with
// norms, each input normalized first (inverse: the backward of both).
struct Rotation {
  const char* op;
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> outputs;
  RopeArgs args;
  int64_t batch;
  int64_t seq;
  const std::optional<at::Tensor>& positions;
  const at::Tensor& inv_freq;
  double attention_scale;
  int64_t offset;
  const std::optional<at::Tensor>& cu_seqlens;
  const std::optional<at::Tensor>& pair_axis;
  bool inverse;
  const std::vector<RotationNorm>* norms = nullptr;
  QScale q_scale = {};  // of inputs[0], q
  const CacheWrite* cache = nullptr;
};

// The ops of the rotary family on one device: checks, allocation and empty outputs, the same on every device.
// Functional outputs are fresh and contiguous in the input's own format (the Meta kernels agree). The device
// supplies the rest:
//   Guard, empty            CpuDevice or CudaDevice: the guard that makes a device current for the call
//                           (nothing to do on the CPU), and empty(sizes, options), a contiguous output;
//   rotate(rotation)        the Rotation, reading and checking positions as it needs;
//   rotate_by_tables<scalar_t, opmath>(view, batch, seq, cos, sin, args, transpose)
//                           view's input rotated into its output by cos/sin tables [.., seq, rotary_dim] of type
//                           opmath (contiguous), or by the transposed rotation.
template <typename Device>
struct RopeOps {
  static void rotate(const char* op, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                     const RopeArgs& args, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                     double attention_scale, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                     const std::optional<at::Tensor>& pair_axis, bool inverse,
                     const std::vector<RotationNorm>* norms = nullptr, QScale q_scale = {},
                     const CacheWrite* cache = nullptr) {
    const typename Device::Guard guard(inputs[0].device());
    const auto order = rope_dim_order(args.format);
    const int64_t batch = order[0] < 0 ? 1 : inputs[0].size(order[0]);
    const int64_t seq = inputs[0].size(order[1]);
    Device::rotate({op, std::move(inputs), std::move(outputs), args, batch, seq, positions, inv_freq, attention_scale,
                    offset, cu_seqlens, pair_axis, inverse, norms, q_scale, cache});
  }

  static at::Tensor one(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& positions,
                        const at::Tensor& inv_freq, double attention_scale, c10::string_view layout,
                        c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                        const std::optional<at::Tensor>& pair_axis, bool inverse) {
    const auto args =
        check_rope(op, {{inverse ? "grad" : "x", &x}}, positions, inv_freq, layout, format, cu_seqlens, pair_axis);
    auto out = Device::empty(x.sizes(), x.options());
    rotate(op, {x}, {out}, args, positions, inv_freq, attention_scale, offset, cu_seqlens, pair_axis, inverse);
    return out;
  }

  static std::tuple<at::Tensor, at::Tensor> qk(const char* op, const at::Tensor& q, const at::Tensor& k,
                                               const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                               double attention_scale, c10::string_view layout,
                                               c10::string_view format, int64_t offset,
                                               const std::optional<at::Tensor>& cu_seqlens,
                                               const std::optional<at::Tensor>& pair_axis, bool inverse,
                                               double q_scale_beta, int64_t q_scale_length, int64_t q_scale_shift) {
    const auto args = check_rope_qk(op, {{inverse ? "grad_q" : "q", &q}, {inverse ? "grad_k" : "k", &k}}, positions,
                                    inv_freq, layout, format, cu_seqlens, pair_axis, q_scale_beta, q_scale_length,
                                    q_scale_shift);
    auto q_out = Device::empty(q.sizes(), q.options());
    auto k_out = Device::empty(k.sizes(), k.options());
    rotate(op, {q, k}, {q_out, k_out}, args.rope, positions, inv_freq, attention_scale, offset, cu_seqlens, pair_axis,
           inverse, nullptr, args.q_scale);
    return {q_out, k_out};
  }

  static at::Tensor rope(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                         double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
                         const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis) {
    return one("rope", x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis, false);
  }

  static at::Tensor rope_backward(const at::Tensor& grad, const std::optional<at::Tensor>& positions,
                                  const at::Tensor& inv_freq, double attention_scale, c10::string_view layout,
                                  c10::string_view format, int64_t offset,
                                  const std::optional<at::Tensor>& cu_seqlens,
                                  const std::optional<at::Tensor>& pair_axis) {
    return one("rope_backward", grad, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
               pair_axis, true);
  }

  static std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k,
                                                    const std::optional<at::Tensor>& positions,
                                                    const at::Tensor& inv_freq, double attention_scale,
                                                    c10::string_view layout, c10::string_view format, int64_t offset,
                                                    const std::optional<at::Tensor>& cu_seqlens,
                                                    const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
                                                    int64_t q_scale_length, int64_t q_scale_shift) {
    return qk("rope_qk", q, k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis,
              false, q_scale_beta, q_scale_length, q_scale_shift);
  }

  static std::tuple<at::Tensor, at::Tensor> rope_qk_backward(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                             const std::optional<at::Tensor>& positions,
                                                             const at::Tensor& inv_freq, double attention_scale,
                                                             c10::string_view layout, c10::string_view format,
                                                             int64_t offset,
                                                             const std::optional<at::Tensor>& cu_seqlens,
                                                             const std::optional<at::Tensor>& pair_axis,
                                                             double q_scale_beta, int64_t q_scale_length,
                                                             int64_t q_scale_shift) {
    return qk("rope_qk_backward", grad_q, grad_k, positions, inv_freq, attention_scale, layout, format, offset,
              cu_seqlens, pair_axis, true, q_scale_beta, q_scale_length, q_scale_shift);
  }

  static void rope_(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                    double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
                    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& pair_axis) {
    constexpr const char* op = "rope_";
    const auto args = check_rope(op, {{"x", &x}}, positions, inv_freq, layout, format, cu_seqlens, pair_axis);
    check_no_internal_overlap(op, "x", x, "rotate a copy with posenc.rope");
    rotate(op, {x}, {x}, args, positions, inv_freq, attention_scale, offset, cu_seqlens, pair_axis, false);
  }

  static at::Tensor by_tables(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              c10::string_view layout, c10::string_view format, bool transpose) {
    const auto args = check_rope_cos_sin(op, transpose ? "grad" : "x", x, cos, sin, layout, format);
    auto out = Device::empty(x.sizes(), x.options());
    if (x.numel() == 0) return out;
    const typename Device::Guard guard(x.device());
    const auto order = rope_dim_order(args.format);
    const int64_t batch = order[0] < 0 ? 1 : x.size(order[0]);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "posenc_rope_cos_sin", [&] {
      using opmath = opmath_t<scalar_t>;
      const auto cos_table = cos.to(c10::CppTypeToScalarType<opmath>::value).contiguous();
      const auto sin_table = sin.to(c10::CppTypeToScalarType<opmath>::value).contiguous();
      Device::template rotate_by_tables<scalar_t, opmath>(rotary_view<scalar_t>(x, out, args.format), batch,
                                                          x.size(order[1]), cos_table, sin_table, args, transpose);
    });
    return out;
  }

  static at::Tensor rope_cos_sin(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 c10::string_view layout, c10::string_view format) {
    return by_tables("rope_cos_sin", x, cos, sin, layout, format, false);
  }

  static at::Tensor rope_cos_sin_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                                          c10::string_view layout, c10::string_view format) {
    return by_tables("rope_cos_sin_backward", grad, cos, sin, layout, format, true);
  }

  static void register_kernels(torch::Library& m) { POSENC_ROPE_OPS(POSENC_IMPL_MEMBER, RopeOps) }
};

}  // namespace posenc
