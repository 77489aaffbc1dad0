#pragma once
// Position handling on real data: bounds checks and the float64 position vector every family reads.
#include "common/checks.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/arange.h>

#include <vector>

namespace posenc {

// Positions as a contiguous float64 tensor, offset included; absent positions are offset + arange(seq_len).
inline at::Tensor positions_as_double(const std::optional<at::Tensor>& positions, int64_t seq_len, int64_t offset) {
  if (!positions.has_value()) {
    return at::arange(static_cast<double>(offset), static_cast<double>(offset + seq_len), 1.0,
                      at::TensorOptions().dtype(at::kDouble));
  }
  auto values = positions->to(at::kDouble).contiguous();
  return offset == 0 ? values : values.add(static_cast<double>(offset));
}

// The same values without a tensor: absent positions are offset + s, computed where they are read (no
// arange is allocated); given ones are read once into a vector. value(n) equals positions_as_double(...)[n].
class PositionValues {
 public:
  PositionValues(const std::optional<at::Tensor>& positions, int64_t seq_len, int64_t offset)
      : offset_(static_cast<double>(offset)), size_(positions ? positions->numel() : seq_len), given_(positions) {
    if (!given_) return;
    values_.resize(size_);
    const bool shift = offset != 0;
    auto read = [&](auto tag) {
      using value_t = decltype(tag);
      const auto source = positions->contiguous();
      const value_t* p = source.const_data_ptr<value_t>();
      for (const auto n : c10::irange(size_)) {
        const auto value = static_cast<double>(p[n]);
        values_[n] = shift ? value + offset_ : value;
      }
    };
    switch (positions->scalar_type()) {
      case at::kLong: read(int64_t{}); break;
      case at::kInt: read(int32_t{}); break;
      case at::kFloat: read(float{}); break;
      case at::kDouble: read(double{}); break;
      default: {  // the other integer and floating dtypes: converted by ATen, as positions_as_double does
        const auto converted = positions->to(at::kDouble).contiguous();
        const double* p = converted.const_data_ptr<double>();
        for (const auto n : c10::irange(size_)) values_[n] = shift ? p[n] + offset_ : p[n];
      }
    }
  }

  double operator[](int64_t n) const { return given_ ? values_[n] : offset_ + static_cast<double>(n); }
  int64_t size() const { return size_; }

 private:
  double offset_;
  int64_t size_;
  bool given_;
  std::vector<double> values_;
};

// A floating tensor's values as contiguous float64: the tensor's own data when it already is (no dispatcher
// call, no copy), else a converted copy held here.
class DoubleValues {
 public:
  explicit DoubleValues(const at::Tensor& t) {
    if (t.scalar_type() == at::kDouble && t.is_contiguous()) {
      data_ = t.const_data_ptr<double>();
    } else {
      converted_ = t.to(at::kDouble).contiguous();
      data_ = converted_.const_data_ptr<double>();
    }
  }
  const double* data() const { return data_; }

 private:
  at::Tensor converted_;
  const double* data_;
};

// Every index must lie in [0, limit): checked before any kernel reads with it.
inline void check_indices_in_range(const char* op, const char* arg, const at::Tensor& indices, int64_t limit,
                                   const char* limit_name) {
  const auto contiguous = indices.contiguous();
  AT_DISPATCH_INDEX_TYPES(contiguous.scalar_type(), "posenc_check_indices", [&] {
    const index_t* data = contiguous.const_data_ptr<index_t>();
    for (const auto n : c10::irange(contiguous.numel())) {
      TORCH_CHECK(data[n] >= 0 && data[n] < limit, "posenc.", op, ": ", arg, " holds ", data[n], " at flat index ",
                  n, ", outside [0, ", limit, ") of ", limit_name, " ", limit);
    }
  });
}

}  // namespace posenc
