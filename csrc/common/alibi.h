#pragma once
// Checks of the ALiBi family, shared by its CPU, CUDA and Meta kernels, and its op layer, shared by the CPU and
// CUDA kernels.
#include "common/checks.h"
#include "families.h"

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

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

// The rows (b, h, i) of a [B, H, Q, K] tensor as the kernels read them.
inline AlibiRows alibi_rows(const at::Tensor& t) {
  return {t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// The ops of ALiBi on one device: checks, allocation and dtype dispatch, the same on every device. The device
// supplies the rest:
//   Guard, empty            CpuDevice or CudaDevice: the guard that makes a device current for the call
//                           (nothing to do on the CPU), and empty(sizes, options), a contiguous output;
//   add_bias<scalar_t>(in, out, slopes, mode, head_offset)
//                           every row of out = in + bias (in undefined: the bias alone); out may be in;
//   slope_grad<scalar_t>(grad, mode, slopes, head_offset, acc)
//                           acc[b?, head_offset + h] (float64, zeros) = -sum_{i, j} grad[b, h, i, j] * d_ij
//                           (|d_ij| symmetric), in the CPU's order.
template <typename Device>
struct AlibiOps {
  static at::Tensor alibi_bias(const at::Tensor& slopes, int64_t q_len, int64_t k_len, c10::string_view mode,
                               int64_t head_offset, std::optional<int64_t> num_heads,
                               std::optional<at::ScalarType> dtype) {
    const auto shape = check_alibi_bias(slopes, q_len, k_len, mode, head_offset,
                                        num_heads ? std::optional<c10::SymInt>(*num_heads) : std::nullopt, dtype);
    auto out = Device::empty({shape.batch.expect_int(), shape.num_heads.expect_int(), q_len, k_len},
                         slopes.options().dtype(shape.dtype));
    const typename Device::Guard guard(slopes.device());
    if (out.numel() > 0) add_bias(at::Tensor(), out, slopes, parse_alibi_mode("alibi_bias", mode), head_offset);
    return out;
  }

  static at::Tensor add_alibi(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode,
                              int64_t head_offset) {
    const auto alibi_mode = check_alibi_scores("add_alibi", "scores", scores, slopes, mode, head_offset);
    auto out = Device::empty(scores.sizes(), scores.options());
    const typename Device::Guard guard(scores.device());
    if (out.numel() > 0) add_bias(scores, out, slopes, alibi_mode, head_offset);
    return out;
  }

  // In place through scores' own strides: a view (e.g. a slice of a larger buffer) is updated where it lies.
  static void add_alibi_(const at::Tensor& scores, const at::Tensor& slopes, c10::string_view mode,
                         int64_t head_offset) {
    const auto alibi_mode = check_add_alibi_inplace(scores, slopes, mode, head_offset);
    check_no_internal_overlap("add_alibi_", "scores", scores,
                              "write into a tensor that owns each element, or use add_alibi");
    const typename Device::Guard guard(scores.device());
    if (scores.numel() > 0) add_bias(scores, scores, slopes, alibi_mode, head_offset);
  }

  // d/d slopes[b?, head_offset + h] = -sum_{i, j} grad[b, h, i, j] * d_ij (|d_ij| symmetric), deterministic.
  static at::Tensor alibi_backward(const at::Tensor& grad, const at::Tensor& slopes, c10::string_view mode,
                                   int64_t head_offset) {
    const auto alibi_mode = check_alibi_scores("alibi_backward", "grad", grad, slopes, mode, head_offset);
    auto acc = at::zeros(slopes.sizes(), slopes.options().dtype(at::kDouble));
    if (grad.numel() > 0) {
      const typename Device::Guard guard(grad.device());
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_alibi_backward", [&] {
        Device::template slope_grad<scalar_t>(grad, alibi_mode, slopes, head_offset, acc);
      });
    }
    return acc.to(slopes.scalar_type());
  }

  static void register_kernels(torch::Library& m) {
    POSENC_ALIBI_OPS(POSENC_IMPL_MEMBER, AlibiOps)
  }

 private:
  static void add_bias(const at::Tensor& in, const at::Tensor& out, const at::Tensor& slopes, AlibiMode mode,
                       int64_t head_offset) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "posenc_alibi", [&] {
      Device::template add_bias<scalar_t>(in, out, slopes, mode, head_offset);
    });
  }
};

}  // namespace posenc
