#pragma once
// What the kernels of rope_inv_freq and rope_inv_freq_for_length share (config/ops.cpp, meta/frequencies.cpp,
// cuda/frequencies.cu): the scaling keywords of their schemas, and how the frequencies depend on the length.
#include <posenc/frequencies.h>

#include "kernels/frequencies.h"

#include <ATen/ops/empty.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>

namespace posenc {
namespace frequencies {

// How rope_for_length's frequencies depend on the length L: not at all (kNone); those of every L <= context,
// then those of every L > context (kStep: LongRoPE's short and long factors); those of every L <= context, then
// a function of L (kGrowing: dynamic NTK, whose base grows past the context; a NaN L counts as past it). The
// CUDA op forms on the host, with the CPU's code, what does not vary with L, and evaluates `ntk` (kGrowing's
// constants, kernels/frequencies.h) on the device.
struct LengthDependence {
  enum Kind { kNone, kStep, kGrowing } kind;
  double context;
  kernels::DynamicNtk ntk;
};
LengthDependence length_dependence(int64_t rotary_dim, double base, const RopeScaling& scaling);

}  // namespace frequencies

// The scaling keywords shared by rope_inv_freq and rope_inv_freq_for_length, in schema order.
inline frequencies::RopeScaling make_scaling(
    c10::string_view rope_type, std::optional<double> rope_theta, std::optional<double> factor,
    std::optional<double> alpha, std::optional<double> original_max_position_embeddings,
    std::optional<double> max_position_embeddings, std::optional<double> attention_factor,
    std::optional<double> beta_fast, std::optional<double> beta_slow, std::optional<double> mscale,
    std::optional<double> mscale_all_dim, bool truncate, std::optional<double> low_freq_factor,
    std::optional<double> high_freq_factor, std::optional<c10::ArrayRef<double>> short_factor,
    std::optional<c10::ArrayRef<double>> long_factor) {
  frequencies::RopeScaling scaling;
  scaling.rope_type = std::string(rope_type);
  scaling.rope_theta = rope_theta;
  scaling.factor = factor;
  scaling.alpha = alpha;
  scaling.original_max_position_embeddings = original_max_position_embeddings;
  scaling.max_position_embeddings = max_position_embeddings;
  scaling.attention_factor = attention_factor;
  scaling.beta_fast = beta_fast;
  scaling.beta_slow = beta_slow;
  scaling.mscale = mscale;
  scaling.mscale_all_dim = mscale_all_dim;
  scaling.truncate = truncate;
  scaling.low_freq_factor = low_freq_factor;
  scaling.high_freq_factor = high_freq_factor;
  if (short_factor) scaling.short_factor = short_factor->vec();
  if (long_factor) scaling.long_factor = long_factor->vec();
  return scaling;
}

// The kernel of rope_inv_freq_for_length on the CPU (config/ops.cpp), and with kMeta its Meta kernel
// (meta/frequencies.cpp): the same checks, an empty result of the real one's shape, dtype and device.
template <bool kMeta>
inline at::Tensor rope_inv_freq_for_length_kernel(
    const at::Tensor& seq_len, int64_t rotary_dim, double base, c10::string_view rope_type,
    std::optional<double> rope_theta, std::optional<double> factor, std::optional<double> alpha,
    std::optional<double> original_max_position_embeddings, std::optional<double> max_position_embeddings,
    std::optional<double> attention_factor, std::optional<double> beta_fast, std::optional<double> beta_slow,
    std::optional<double> mscale, std::optional<double> mscale_all_dim, bool truncate,
    std::optional<double> low_freq_factor, std::optional<double> high_freq_factor,
    std::optional<c10::ArrayRef<double>> short_factor, std::optional<c10::ArrayRef<double>> long_factor) {
  const auto scaling = make_scaling(rope_type, rope_theta, factor, alpha, original_max_position_embeddings,
                                    max_position_embeddings, attention_factor, beta_fast, beta_slow, mscale,
                                    mscale_all_dim, truncate, low_freq_factor, high_freq_factor, short_factor,
                                    long_factor);
  if constexpr (kMeta) {
    frequencies::check_rope_for_length(rotary_dim, base, scaling, seq_len);
    return at::empty({rotary_dim / 2}, seq_len.options().dtype(at::kDouble));
  } else {
    return frequencies::rope_for_length(rotary_dim, base, scaling, seq_len);
  }
}

}  // namespace posenc
