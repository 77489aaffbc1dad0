#pragma once
// Checks of the ALiBi family, shared by its CPU and Meta kernels.
#include "common/checks.h"

#include <ATen/MemoryOverlap.h>

#include <string>

namespace posenc {

// Causal agrees with symmetric wherever j <= i + (k_len - q_len); past it, it continues the same line.

inline AlibiMode parse_alibi_mode(const char* op, std::string_view mode) {
  if (mode == "causal") return AlibiMode::Causal;
  if (mode == "symmetric") return AlibiMode::Symmetric;
  TORCH_CHECK(false, "posenc.", op, ": mode must be \"causal\" or \"symmetric\", got \"", mode, "\"");
}

// head_offset + num_heads for a message, exact where it passes int64 (both are non-negative here).
inline std::string heads_end(int64_t head_offset, const c10::SymInt& num_heads) {
  if (const auto n = num_heads.maybe_as_int()) {
    return std::to_string(static_cast<uint64_t>(head_offset) + static_cast<uint64_t>(*n));
  }
  return c10::str(num_heads + head_offset);
}

// slopes is [H] (shared by the batch) or [B, H] (per batch row), H the global head count; a call uses
// heads [head_offset, head_offset + num_heads), so a tensor-parallel shard indexes its global heads.
inline void check_slopes(const char* op, const at::Tensor& slopes, int64_t head_offset, const c10::SymInt& num_heads) {
  check_floating(op, "slopes", slopes);
  TORCH_CHECK(slopes.dim() == 1 || slopes.dim() == 2, "posenc.", op, ": slopes must be [H] or [B, H], got shape ",
              slopes.sym_sizes());
  TORCH_CHECK(head_offset >= 0, "posenc.", op, ": head_offset must be non-negative, got ", head_offset);
  TORCH_CHECK(num_heads >= 0, "posenc.", op, ": num_heads must be non-negative, got ", num_heads);
  // Compared without forming head_offset + num_heads, which overflows int64 for a head_offset near its maximum.
  const auto available = slopes.sym_size(-1);
  TORCH_CHECK(num_heads <= available && head_offset <= available - num_heads, "posenc.", op, ": heads [", head_offset,
              ", ", heads_end(head_offset, num_heads), ") need that many slopes but slopes has ", available, " heads");
}

// scores (or a gradient like it) is [B, H_local, Q, K]; per-batch slopes must match B.
inline AlibiMode check_alibi_scores(const char* op, const char* arg, const at::Tensor& scores, const at::Tensor& slopes,
                                    std::string_view mode, int64_t head_offset) {
  check_floating(op, arg, scores);
  TORCH_CHECK(scores.dim() == 4, "posenc.", op, ": ", arg, " must be [B, H, Q, K], got shape ", scores.sym_sizes());
  const auto alibi_mode = parse_alibi_mode(op, mode);
  check_slopes(op, slopes, head_offset, scores.sym_size(1));
  check_same_device(op, "slopes", slopes, scores);
  TORCH_CHECK(slopes.dim() == 1 || slopes.sym_size(0) == scores.sym_size(0), "posenc.", op, ": slopes has shape ",
              slopes.sym_sizes(), " but ", arg, " has batch ", scores.sym_size(0), "; per-batch slopes must be [",
              scores.sym_size(0), ", H]");
  return alibi_mode;
}

// In place, every element must own its memory: an expanded scores tensor would be written twice.
inline AlibiMode check_add_alibi_inplace(const at::Tensor& scores, const at::Tensor& slopes, std::string_view mode,
                                         int64_t head_offset) {
  const auto alibi_mode = check_alibi_scores("add_alibi_", "scores", scores, slopes, mode, head_offset);
  TORCH_CHECK(at::has_internal_overlap(scores) != at::MemOverlap::Yes,
              "posenc.add_alibi_: scores has elements that share memory (strides ", scores.sym_strides(),
              "); write into a tensor that owns each element, or use add_alibi");
  return alibi_mode;
}

struct AlibiBiasShape {
  c10::SymInt batch;      // 1 for shared slopes, B for per-batch slopes
  c10::SymInt num_heads;  // local heads: num_heads, else every head from head_offset on
  at::ScalarType dtype;
};

inline AlibiBiasShape check_alibi_bias(const at::Tensor& slopes, const c10::SymInt& q_len, const c10::SymInt& k_len,
                                       std::string_view mode, int64_t head_offset,
                                       const std::optional<c10::SymInt>& num_heads,
                                       std::optional<at::ScalarType> dtype) {
  constexpr const char* op = "alibi_bias";
  check_floating(op, "slopes", slopes);
  TORCH_CHECK(q_len >= 0, "posenc.", op, ": q_len must be non-negative, got ", q_len);
  TORCH_CHECK(k_len >= 0, "posenc.", op, ": k_len must be non-negative, got ", k_len);
  parse_alibi_mode(op, mode);
  TORCH_CHECK(slopes.dim() == 1 || slopes.dim() == 2, "posenc.", op, ": slopes must be [H] or [B, H], got shape ",
              slopes.sym_sizes());
  const auto local_heads = num_heads.value_or(slopes.sym_size(-1) - head_offset);
  check_slopes(op, slopes, head_offset, local_heads);
  const auto out_dtype = dtype.value_or(slopes.scalar_type());
  TORCH_CHECK(at::isFloatingType(out_dtype), "posenc.", op, ": dtype must be floating, got ", out_dtype);
  return {slopes.dim() == 2 ? slopes.sym_size(0) : c10::SymInt(1), local_heads, out_dtype};
}

}  // namespace posenc
