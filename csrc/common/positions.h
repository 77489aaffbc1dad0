#pragma once
// The values the kernels index or form angles with, read from real tensors once per call: positions (offset
// added, domain checked) and float64 frequencies. Every family reads them here.
#include "common/checks.h"

#include <ATen/Dispatch.h>

#include <c10/util/safe_numerics.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace posenc {

// Angles are formed in float64, which holds every integer up to 2^53 exactly.
constexpr int64_t kMaxExactPosition = int64_t{1} << 53;

// The positions (offset included) a family accepts, inclusive bounds and how the error message names them. The
// words are formed only for an error: built on every call, they cost a small rope call 300 instructions.
struct PositionDomain {
  int64_t lo;
  int64_t hi;
  bool finite = false;            // floating positions: NaN and infinities refused too (else they give NaN angles)
  const char* table = nullptr;    // positions index the rows [0, hi] of this table ("weight")
  bool cache_slots = false;       // positions index the slots [0, hi] of the caches

  std::string description() const {
    if (cache_slots) return c10::str("[0, S_max) with S_max = ", hi + 1, " (the slots of the caches)");
    if (table != nullptr) return c10::str("[0, L_max) with L_max = ", hi + 1, " (the rows of ", table, ")");
    return finite ? "[-2^53, 2^53], the integers float64 holds exactly (floating positions: finite)"
                  : "[-2^53, 2^53], the integers float64 holds exactly";
  }
};

inline PositionDomain angle_domain() { return {-kMaxExactPosition, kMaxExactPosition}; }

// Rotary positions: a NaN or infinite one would make q and k NaN without a word, so they are refused.
inline PositionDomain rotary_domain() { return {-kMaxExactPosition, kMaxExactPosition, true}; }

inline PositionDomain table_domain(int64_t rows, const char* table) { return {0, rows - 1, false, table}; }

// The errors of the checks that read index data, each a function of the failing element alone: the CPU raises
// them as it reads, and the CUDA ops raise the same words from the element their check kernels recorded.

// Where a position came from, as its error names it.
enum class PositionSource { Given, Arange, Packed };

[[noreturn]] inline void position_error(const char* op, PositionSource source, int64_t n, const std::string& value,
                                        const std::string& result, int64_t offset, const PositionDomain& domain) {
  const char* from = source == PositionSource::Given    ? "positions.flatten()["
                     : source == PositionSource::Packed ? "its index in its sequence, token ["
                                                        : "arange(S)[";
  TORCH_CHECK(false, "posenc.", op, ": position ", result, " is outside ", domain.description(), "; it is ", from, n,
              "] = ", value, " plus offset ", offset);
}

// Integer position `value` (element n) whose sum with offset overflows int64 or leaves the domain.
[[noreturn]] inline void integer_position_error(const char* op, PositionSource source, int64_t n, int64_t value,
                                                int64_t offset, const PositionDomain& domain) {
  int64_t result = 0;
  const bool overflow = c10::add_overflows(value, offset, &result);
  position_error(op, source, n, c10::str(value), overflow ? "(overflow)" : c10::str(result), offset, domain);
}

// Floating position `value` (element n) whose sum with offset is NaN, infinite or beyond 2^53 in magnitude.
[[noreturn]] inline void floating_position_error(const char* op, int64_t n, double value, int64_t offset,
                                                 const PositionDomain& domain) {
  position_error(op, PositionSource::Given, n, c10::str(value), c10::str(value + static_cast<double>(offset)), offset,
                 domain);
}

// An offset too large for any floating position to stay exact.
[[noreturn]] inline void floating_offset_error(const char* op, int64_t offset, const PositionDomain& domain) {
  position_error(op, PositionSource::Given, 0, "(any)", "offset " + c10::str(offset), offset, domain);
}

// cu_seqlens of n values (bounds) failing at `key`: 0, its start is not 0 (value = bounds[0]); j in [1, n), it
// decreases from before = bounds[j - 1] to value = bounds[j]; n, its end (value = bounds[n - 1]) is not tokens.
[[noreturn]] inline void cu_seqlens_error(const char* op, int64_t key, int64_t n, int64_t before, int64_t value,
                                          int64_t tokens) {
  TORCH_CHECK(key != 0, "posenc.", op, ": cu_seqlens must start at 0, got ", value);
  TORCH_CHECK(key >= n, "posenc.", op, ": cu_seqlens must not decrease, got ", before, " then ", value, " at index ",
              key);
  TORCH_CHECK(false, "posenc.", op, ": cu_seqlens must end at the token count T = ", tokens, ", got ", value);
}

[[noreturn]] inline void pair_axis_error(const char* op, int64_t i, int64_t value, int64_t n_axes) {
  TORCH_CHECK(false, "posenc.", op, ": pair_axis holds ", value, " at index ", i, ", outside [0, ", n_axes, ") of the ",
              n_axes, " axes of positions (their first dimension)");
}

// An index (element n of arg) outside [0, limit).
[[noreturn]] inline void index_error(const char* op, const char* arg, int64_t n, int64_t value, int64_t limit,
                                     const char* limit_name) {
  TORCH_CHECK(false, "posenc.", op, ": ", arg, " holds ", value, " at flat index ", n, ", outside [0, ", limit, ") of ",
              limit_name, " ", limit);
}

// Positions plus offset, one per (shared) sequence index or per row. Absent positions are offset +
// arange(count), restarting at each boundary of cu_seqlens when it is given (already checked); present ones
// are read in their own dtype. A result outside `domain`, or an offset sum that overflows int64, raises an
// error naming the op, the position, the domain and where the position came from, before any kernel reads
// with it. T is int64_t (rows of a table: integer positions only) or double (angles: floating positions are
// read too, and NaN or infinite ones pass, giving NaN encodings).
template <typename T>
std::vector<T> read_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                              int64_t offset, const PositionDomain& domain,
                              const std::optional<at::Tensor>& cu_seqlens = std::nullopt) {
  const auto source = positions ? PositionSource::Given : cu_seqlens ? PositionSource::Packed : PositionSource::Arange;
  const auto add_offset = [&](int64_t value, int64_t n) {
    int64_t result = 0;
    if (c10::add_overflows(value, offset, &result) || result < domain.lo || result > domain.hi) {
      integer_position_error(op, source, n, value, offset, domain);
    }
    return static_cast<T>(result);
  };

  std::vector<T> out;
  if (!positions) {
    out.resize(count);
    if (!cu_seqlens) {
      for (int64_t n = 0; n < count; ++n) out[n] = add_offset(n, n);
      return out;
    }
    const auto cu = cu_seqlens->to(at::kLong).contiguous();
    const int64_t* bounds = cu.const_data_ptr<int64_t>();
    for (int64_t j = 0; j + 1 < cu.numel(); ++j) {
      for (int64_t t = bounds[j]; t < bounds[j + 1]; ++t) out[t] = add_offset(t - bounds[j], t);
    }
    return out;
  }

  const auto dtype = positions->scalar_type();
  if (at::isFloatingType(dtype)) {
    if constexpr (std::is_same_v<T, double>) {
      if (std::abs(offset) > kMaxExactPosition) floating_offset_error(op, offset, domain);
      const auto values = positions->to(at::kDouble).contiguous();
      const double* p = values.const_data_ptr<double>();
      out.resize(values.numel());
      for (int64_t n = 0; n < values.numel(); ++n) {
        const double result = p[n] + static_cast<double>(offset);
        const bool outside = !(std::abs(result) <= static_cast<double>(kMaxExactPosition));
        if (outside && (domain.finite || std::isfinite(result))) floating_position_error(op, n, p[n], offset, domain);
        out[n] = result;
      }
      return out;
    }
    TORCH_CHECK(false, "posenc.", op, ": positions must be an integer tensor, got ", dtype);
  }
  const auto values = (dtype == at::kInt || dtype == at::kLong ? *positions : positions->to(at::kLong)).contiguous();
  out.resize(values.numel());
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "posenc_read_positions", [&] {
    const index_t* p = values.const_data_ptr<index_t>();
    for (int64_t n = 0; n < values.numel(); ++n) out[n] = add_offset(static_cast<int64_t>(p[n]), n);
  });
  return out;
}

// The positions offset + arange(count) (restarting per sequence with host cu_seqlens, the longest `longest` long)
// lie in `domain` when the first and the last do; otherwise the element-wise reader raises its error.
template <typename T>
void check_arange(const char* op, int64_t count, int64_t longest, int64_t offset, const PositionDomain& domain,
                  const std::optional<at::Tensor>& host_cu_seqlens = std::nullopt) {
  if (longest == 0) return;
  if (offset >= domain.lo && offset <= domain.hi - (longest - 1)) return;
  read_positions<T>(op, std::nullopt, count, offset, domain, host_cu_seqlens);
  TORCH_INTERNAL_ASSERT(false, "posenc.", op, ": positions failed a range check that the host check passed");
}

// Positions as the CPU kernels read them: the values read (offset added, domain checked), or for an arange
// (positions and cu_seqlens absent) no values at all, the kernels taking first + n: no host buffer the size of the
// positions is made for the common case of none given.
template <typename T>
struct HostPositions {
  std::vector<T> values;
  int64_t first = 0;
  int64_t count = 0;
  const T* data() const { return values.empty() ? nullptr : values.data(); }
};

template <typename T>
HostPositions<T> read_host_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                     int64_t offset, const PositionDomain& domain,
                                     const std::optional<at::Tensor>& cu_seqlens = std::nullopt) {
  if (!positions && !cu_seqlens) {
    check_arange<T>(op, count, count, offset, domain);
    return {{}, offset, count};
  }
  auto values = read_positions<T>(op, positions, count, offset, domain, cu_seqlens);
  const auto n = static_cast<int64_t>(values.size());
  return {std::move(values), 0, n};
}

// cu_seqlens (on the host) must start at 0, never decrease and end at T: checked before any token is read.
inline void check_cu_seqlens_values(const char* op, const std::optional<at::Tensor>& cu_seqlens, int64_t tokens) {
  if (!cu_seqlens) return;
  const auto cu = cu_seqlens->to(at::kLong).contiguous();
  const int64_t* bounds = cu.const_data_ptr<int64_t>();
  const int64_t n = cu.numel();
  if (bounds[0] != 0) cu_seqlens_error(op, 0, n, 0, bounds[0], tokens);
  for (int64_t j = 1; j < n; ++j) {
    if (bounds[j] < bounds[j - 1]) cu_seqlens_error(op, j, n, bounds[j - 1], bounds[j], tokens);
  }
  if (bounds[n - 1] != tokens) cu_seqlens_error(op, n, n, 0, bounds[n - 1], tokens);
}

// The axis of every frequency pair as int32, each checked to lie in [0, n_axes) before any kernel reads with it;
// pair_axis on the host (the CUDA ops read a copy of it).
inline std::vector<int32_t> read_pair_axis(const char* op, const at::Tensor& pair_axis, int64_t n_axes) {
  const auto values = pair_axis.to(at::kLong).contiguous();
  const int64_t* axis = values.const_data_ptr<int64_t>();
  std::vector<int32_t> out(values.numel());
  for (int64_t i = 0; i < values.numel(); ++i) {
    if (axis[i] < 0 || axis[i] >= n_axes) pair_axis_error(op, i, axis[i], n_axes);
    out[i] = static_cast<int32_t>(axis[i]);
  }
  return out;
}

// Multi-axis positions as read, axis by axis ([n_axes, tokens]), reordered token by token ([tokens, n_axes]), so
// that the angle engine finds a token's positions side by side.
inline std::vector<double> tokens_major(const std::vector<double>& positions, int64_t n_axes) {
  const int64_t tokens = static_cast<int64_t>(positions.size()) / n_axes;
  std::vector<double> out(positions.size());
  for (int64_t a = 0; a < n_axes; ++a) {
    for (int64_t n = 0; n < tokens; ++n) out[n * n_axes + a] = positions[a * tokens + n];
  }
  return out;
}

// Positions as the CPU kernels of the angle families read them: pair_axis (when given) checked against the axes of
// positions ([n_axes, ...]), then the positions read by read_host_positions and, multi-axis, reordered token by token
// so that a token's n_axes positions lie side by side.
struct AxisPositions {
  HostPositions<double> values;
  int64_t n_axes = 1;
  std::vector<int32_t> pair_axis;  // empty: one axis
  const int32_t* axes() const { return pair_axis.empty() ? nullptr : pair_axis.data(); }
};

inline AxisPositions read_axis_positions(const char* op, const std::optional<at::Tensor>& positions, int64_t count,
                                         int64_t offset, const PositionDomain& domain,
                                         const std::optional<at::Tensor>& pair_axis,
                                         const std::optional<at::Tensor>& cu_seqlens = std::nullopt) {
  AxisPositions pos;
  if (pair_axis) {
    pos.n_axes = positions->size(0);
    pos.pair_axis = read_pair_axis(op, *pair_axis, pos.n_axes);
  }
  pos.values = read_host_positions<double>(op, positions, count, offset, domain, cu_seqlens);
  if (pos.n_axes > 1) pos.values.values = tokens_major(pos.values.values, pos.n_axes);
  return pos;
}

// inv_freq (1-D, float64 or float32, checked by the op) as contiguous float64: the tensor's own data when it already
// is, else widened here on the host; an ATen conversion was a quarter of a small rope call's own instructions. Also
// max |inv_freq|, which decides the angle engine's path for each position.
class Frequencies {
 public:
  explicit Frequencies(const at::Tensor& inv_freq) : size_(inv_freq.numel()) {
    if (inv_freq.scalar_type() == at::kDouble && inv_freq.is_contiguous()) {
      data_ = inv_freq.const_data_ptr<double>();
    } else {
      widened_.resize(size_);
      const int64_t stride = inv_freq.stride(0);
      AT_DISPATCH_FLOATING_TYPES(inv_freq.scalar_type(), "posenc_frequencies", [&] {
        const scalar_t* w = inv_freq.const_data_ptr<scalar_t>();
        for (int64_t i = 0; i < size_; ++i) widened_[i] = static_cast<double>(w[i * stride]);
      });
      data_ = widened_.data();
    }
    // A NaN frequency is skipped here: it makes NaN angles on either path.
    for (int64_t i = 0; i < size_; ++i) max_abs_ = std::max(max_abs_, std::abs(data_[i]));
  }
  Frequencies(const Frequencies&) = delete;  // data_ may point into widened_
  Frequencies& operator=(const Frequencies&) = delete;
  const double* data() const { return data_; }
  int64_t size() const { return size_; }
  double max_abs() const { return max_abs_; }

 private:
  int64_t size_;
  std::vector<double> widened_;
  const double* data_ = nullptr;
  double max_abs_ = 0.0;
};

// Every index must lie in [0, limit): checked before any kernel reads with it.
inline void check_indices_in_range(const char* op, const char* arg, const at::Tensor& indices, int64_t limit,
                                   const char* limit_name) {
  const auto contiguous = indices.contiguous();
  AT_DISPATCH_INDEX_TYPES(contiguous.scalar_type(), "posenc_check_indices", [&] {
    const index_t* data = contiguous.const_data_ptr<index_t>();
    for (int64_t n = 0; n < contiguous.numel(); ++n) {
      if (data[n] < 0 || data[n] >= limit) index_error(op, arg, n, static_cast<int64_t>(data[n]), limit, limit_name);
    }
  });
}

}  // namespace posenc
