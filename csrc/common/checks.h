#pragma once
// Argument checks shared by every family. Each error names the op, the argument and the value
// (see docs/errors.md); every check reads metadata only, so CPU and Meta kernels run the same ones.
#include "portable/types.h"

#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <optional>
#include <vector>
#include <string_view>

namespace posenc {

inline void check_defined(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "posenc.", op, ": ", arg, " is an undefined tensor");
}

inline void check_floating(const char* op, const char* arg, const at::Tensor& t) {
  check_defined(op, arg, t);
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "posenc.", op, ": ", arg,
              " must be a floating tensor, got ", t.scalar_type());
}

inline void check_index(const char* op, const char* arg, const at::Tensor& t) {
  check_defined(op, arg, t);
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, "posenc.", op, ": ", arg,
              " must be an int64 or int32 tensor, got ", t.scalar_type());
}

// Positions may be integer (token indices) or floating (diffusion timesteps), never bool or complex.
inline void check_positions_dtype(const char* op, const at::Tensor& positions) {
  check_defined(op, "positions", positions);
  const auto dtype = positions.scalar_type();
  TORCH_CHECK((at::isIntegralType(dtype, /*includeBool=*/false) || at::isFloatingType(dtype)),
              "posenc.", op, ": positions must be an integer or floating tensor, got ", dtype);
}

inline void check_same_device(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "posenc.", op, ": ", arg, " is on ", t.device(),
              " but the other inputs are on ", ref.device());
}

inline void check_inv_freq(const char* op, const at::Tensor& inv_freq) {
  check_defined(op, "inv_freq", inv_freq);
  TORCH_CHECK(inv_freq.scalar_type() == at::kDouble || inv_freq.scalar_type() == at::kFloat, "posenc.", op,
              ": inv_freq must be float64 (or float32), got ", inv_freq.scalar_type(),
              " (rounded frequencies shift every angle)");
  TORCH_CHECK(inv_freq.dim() == 1, "posenc.", op, ": inv_freq must be 1-D, got shape ", inv_freq.sym_sizes());
  TORCH_CHECK(inv_freq.sym_size(0) > 0, "posenc.", op, ": inv_freq is empty; at least one frequency is needed");
}

// padding_idx names a row of the table whose gradient stays zero.
inline void check_padding_idx(const char* op, std::optional<int64_t> padding_idx, const c10::SymInt& num_rows) {
  if (!padding_idx) return;
  TORCH_CHECK(*padding_idx >= 0 && num_rows > *padding_idx, "posenc.", op, ": padding_idx ", *padding_idx,
              " is outside [0, ", num_rows, ")");
}

inline SinusoidalLayout parse_sinusoidal_layout(const char* op, std::string_view layout) {
  if (layout == "interleaved") return SinusoidalLayout::Interleaved;
  if (layout == "half") return SinusoidalLayout::Half;
  if (layout == "half_cos_first") return SinusoidalLayout::HalfCosFirst;
  if (layout == "half_per_axis") return SinusoidalLayout::HalfPerAxis;
  TORCH_CHECK(false, "posenc.", op,
              ": layout must be \"interleaved\", \"half\", \"half_cos_first\" or \"half_per_axis\", got \"",
              layout, "\"");
}

// Positions of a [..., S, D] input: absent (offset + arange(S)), [S] shared by every leading index,
// or one per row (the input's leading shape). Returns whether they are shared.
inline bool check_row_positions(const char* op, const char* input_arg, c10::SymIntArrayRef row_shape,
                                const std::optional<at::Tensor>& positions) {
  if (!positions.has_value()) return true;
  check_positions_dtype(op, *positions);
  const auto pos_shape = positions->sym_sizes();
  const auto seq_len = row_shape.empty() ? c10::SymInt(1) : row_shape.back();
  if (pos_shape.size() == 1 && pos_shape[0] == seq_len) return true;
  TORCH_CHECK(pos_shape.equals(row_shape), "posenc.", op, ": positions has shape ", pos_shape,
              " but ", input_arg, " needs [", seq_len, "] or ", row_shape);
  return false;
}

// Whether the (stride, size) dimensions give every element its own offset, by listing all of them: memory and
// time of the order of the element count, spent only on views whose strides interleave.
inline bool offsets_are_distinct(const std::vector<std::pair<int64_t, int64_t>>& dims) {
  std::vector<int64_t> offsets{0};
  for (const auto& [stride, size] : dims) {
    std::vector<int64_t> next;
    next.reserve(offsets.size() * size);
    for (int64_t i = 0; i < size; ++i) {
      for (const int64_t offset : offsets) next.push_back(offset + i * stride);
    }
    offsets = std::move(next);
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) == offsets.end();
}

// Whether every element of a tensor of these sizes and strides has its own address. ATen's check finds expanded
// dimensions; other strides are sorted, and each must step past everything the smaller ones span, which proves the
// elements distinct.
inline bool elements_are_distinct(at::IntArrayRef sizes, at::IntArrayRef strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size) of every dimension of size > 1
  int64_t numel = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    numel *= sizes[d];
    if (sizes[d] > 1) dims.emplace_back(std::abs(strides[d]), sizes[d]);
  }
  if (numel <= 1) return true;
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // largest offset reached by the dimensions of smaller stride
  bool distinct = true;
  for (const auto& [stride, size] : dims) {
    distinct = distinct && stride > span;
    span += (size - 1) * stride;
  }
  // Strides that interleave (sizes [2, 3], strides [3, 2]) can still give every element its own address: the test
  // above cannot tell, so list the offsets and look for a repeat.
  return distinct || offsets_are_distinct(dims);
}

// An in-place op writes every element once, so no two elements may share memory (an expanded tensor, an
// as_strided view whose rows overlap).
inline void check_no_internal_overlap(const char* op, const char* arg, const at::Tensor& t, const char* advice) {
  const bool distinct = t.numel() <= 1 || at::has_internal_overlap(t) == at::MemOverlap::No ||
                        (at::has_internal_overlap(t) != at::MemOverlap::Yes &&
                         elements_are_distinct(t.sizes(), t.strides()));
  TORCH_CHECK(distinct, "posenc.", op, ": ", arg, " has elements that share memory (sizes ", t.sizes(), ", strides ",
              t.strides(), "); ", advice);
}

// Two tensors that an in-place op rewrites one after the other share no element: they lie in different memory or
// in disjoint ranges of it, or they are slices of one view along dimension `dim` that do not meet (q and k of a
// packed projection: the same strides, k's heads after q's or before them).
inline void check_no_shared_elements(const char* op, const char* a_name, const at::Tensor& a, const char* b_name,
                                     const at::Tensor& b, int64_t dim, const char* advice) {
  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) return;
  const auto range = [](const at::Tensor& t) {  // first and last element offsets reached
    int64_t low = t.storage_offset();
    int64_t high = low;
    for (int64_t d = 0; d < t.dim(); ++d) (t.stride(d) < 0 ? low : high) += (t.size(d) - 1) * t.stride(d);
    return std::make_pair(low, high);
  };
  const auto [a_low, a_high] = range(a);
  const auto [b_low, b_high] = range(b);
  bool disjoint = a_high < b_low || b_high < a_low;
  // dim -1: no dimension along which a and b may be slices of one view (a cache and what is written into it).
  const int64_t step = dim >= 0 && dim < a.dim() ? a.stride(dim) : 0;
  const int64_t delta = b.storage_offset() - a.storage_offset();
  if (!disjoint && a.dim() == b.dim() && a.strides() == b.strides() && step != 0 && delta % step == 0) {
    // a and b as slices of one view along dim, from the one that starts first.
    const int64_t shift = delta / step;
    const auto& first = shift >= 0 ? a : b;
    const auto& second = shift >= 0 ? b : a;
    auto sizes = first.sizes().vec();
    sizes[dim] = std::abs(shift) + second.size(dim);
    bool same_other_sizes = true;
    for (int64_t d = 0; d < a.dim(); ++d) same_other_sizes = same_other_sizes && (d == dim || a.size(d) == b.size(d));
    disjoint = same_other_sizes && std::abs(shift) >= first.size(dim) && elements_are_distinct(sizes, a.strides());
  }
  TORCH_CHECK(disjoint, "posenc.", op, ": ", a_name, " and ", b_name, " may share elements (sizes ", a.sizes(), " and ",
              b.sizes(), ", strides ", a.strides(), " and ", b.strides(), ", storage offsets ", a.storage_offset(),
              " and ", b.storage_offset(), "); ", advice);
}

}  // namespace posenc
