// The encoding tables kept between calls (encoding_tables.h).
#include "cpu/encoding_tables.h"

#include "cpu/dispatch.h"
#include "cpu/kernels/additive.h"

#include <ATen/Dispatch.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

namespace posenc::cpu {
namespace {

// Encoding tables kept between calls. A model adds the same encodings to every batch: positions 0..S-1 (or an
// offset into them, or each row's own) at the same frequencies, whose sin/cos cost more than the add itself where no
// batch rows share them (batch 1, one position row per batch row). So a call whose positions are whole numbers >= 0
// reads the rows of a table kept here, computed by the same kernel (the same bits), as eager code reads a table it
// keeps: bf16 [1, 2048, 1024] 1.7x as fast, [8, 2048, 1024] with a position row per batch row 1.6x, and no faster
// with one row shared by batch 8, where the memory hides the sin/cos. The rotary family reads "half_cos_first" tables'
// rows, [cos | sin] of a position, as its coefficients: a model's layers rotate by the same positions, and
// at batch 1 each token's 64 sin/cos pairs were 13% of a bf16 rope_qk of q, k [1, 4096, 16, 128]; read, q, k
// [1, 4096, 16|8, 128] run 1.08x as fast in bf16, 1.12x in fp16 (Zen 2, 2 threads). Least recently used out first,
// within encoding_cache_bytes().
class EncodingTables {
 public:
  static EncodingTables& instance() {
    static EncodingTables tables;
    return tables;
  }

  // A table of at least the positions [0, end) in `layout` at freq's frequencies, of type `type` (the maths
  // type), or an undefined tensor where none fits.
  at::Tensor table(at::ScalarType type, SinusoidalLayout layout, const Frequencies& freq, int64_t end) {
    const int64_t row_bytes = 2 * freq.size() * static_cast<int64_t>(c10::elementSize(type));
    if (row_bytes == 0 || end > budget_ / row_bytes) return {};
    int64_t rows = (end + 255) / 256 * 256;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      ++clock_;
      for (auto& entry : entries_) {
        if (!entry.holds(type, layout, freq)) continue;
        if (entry.table.size(0) >= end) {
          entry.used = clock_;
          return entry.table;
        }
        rows = std::max(rows, 2 * entry.table.size(0));  // a growing sequence: fewer tables computed
      }
    }
    rows = std::min(rows, budget_ / row_bytes);
    at::Tensor table = compute(type, layout, freq, rows);
    const std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(entries_, [&](const Entry& entry) { return entry.holds(type, layout, freq); });
    int64_t kept = table.nbytes();
    for (const auto& entry : entries_) kept += entry.table.nbytes();
    while (kept > budget_) {  // the least recently used out
      const auto oldest = std::min_element(entries_.begin(), entries_.end(),
                                           [](const Entry& a, const Entry& b) { return a.used < b.used; });
      kept -= oldest->table.nbytes();
      entries_.erase(oldest);
    }
    entries_.push_back({type, layout, {freq.data(), freq.data() + freq.size()}, table, ++clock_});
    return table;
  }

 private:
  struct Entry {
    at::ScalarType type;
    SinusoidalLayout layout;
    std::vector<double> inv_freq;
    at::Tensor table;
    uint64_t used;
    bool holds(at::ScalarType t, SinusoidalLayout l, const Frequencies& freq) const {
      return type == t && layout == l && static_cast<int64_t>(inv_freq.size()) == freq.size() &&
             std::memcmp(inv_freq.data(), freq.data(), inv_freq.size() * sizeof(double)) == 0;  // bits: -0.0, NaN
    }
  };

  static at::Tensor compute(at::ScalarType type, SinusoidalLayout layout, const Frequencies& freq, int64_t rows) {
    const int64_t encoded = 2 * freq.size();
    auto table = at::detail::empty_cpu({rows, encoded}, at::TensorOptions().dtype(type));
    AT_DISPATCH_FLOATING_TYPES(type, "posenc_encoding_table", [&] {
      sinusoidal_stub<scalar_t>({{}, table.mutable_data_ptr<scalar_t>(), rows, encoded, nullptr, 0, rows, {rows, 0}, 1,
                                 nullptr, freq.data(), freq.size(), freq.max_abs(), layout, 1.0});
    });
    return table;
  }

  std::mutex mutex_;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
  const int64_t budget_ = encoding_cache_bytes();
};

// The rows a call may ask a kept table to hold, per position of the call: a call at a far offset does not compute
// many times its own sin and cos (a chunk of 16 tokens of 1024 channels at position 15,000 built a table of 60 MB
// once, in 63 ms, and pushed the other tables out of the budget). And a rotation's share of the budget: a model's few
// frequency sets (Gemma 3's two) stay kept together rather than replacing each other layer by layer.
constexpr int64_t kKeptRowsPerPosition = 4;
constexpr int64_t kRotationBudgetShare = 4;

// Below this many (position, frequency) pairs a call's sin/cos cost less than a look-up in the kept tables.
constexpr int64_t kKeptTableMinPairs = 8192;

// 1 + the largest of one axis's positions where every one is a whole number >= 0 (rows of a kept table), else 0.
int64_t positions_end(const HostPositions<double>& positions) {
  if (positions.data() == nullptr) return positions.first >= 0 ? positions.first + positions.count : 0;
  double last = 0;
  for (const double p : positions.values) {
    if (!(p >= 0 && p == std::floor(p) && p < 0x1p53)) return 0;  // NaN too
    last = std::max(last, p);
  }
  return static_cast<int64_t>(last) + 1;
}

// The rows a kept table needs for a call: positions_end where the call's positions are one axis, enough pairs to be
// worth a look-up and at most kKeptRowsPerPosition rows per position, else 0.
int64_t kept_rows_needed(const Frequencies& freq, const AxisPositions& pos) {
  if (pos.n_axes != 1 || pos.values.count * freq.size() < kKeptTableMinPairs) return 0;
  const int64_t end = positions_end(pos.values);
  return end <= kKeptRowsPerPosition * pos.values.count ? end : 0;
}

}  // namespace

at::Tensor kept_encodings(at::ScalarType type, SinusoidalLayout layout, const Frequencies& freq,
                          const AxisPositions& pos) {
  const int64_t end = kept_rows_needed(freq, pos);
  return end > 0 ? EncodingTables::instance().table(type, layout, freq, end) : at::Tensor();
}

at::Tensor kept_rotation_table(at::ScalarType type, const Frequencies& freq, const AxisPositions& pos) {
  const int64_t end = kept_rows_needed(freq, pos);
  const int64_t row_bytes = 2 * freq.size() * static_cast<int64_t>(c10::elementSize(type));
  if (end == 0 || end > encoding_cache_bytes() / kRotationBudgetShare / row_bytes) return {};
  return EncodingTables::instance().table(type, SinusoidalLayout::HalfCosFirst, freq, end);
}

}  // namespace posenc::cpu
