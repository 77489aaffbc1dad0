#pragma once
// What the kernels of rope_inv_freq and rope_inv_freq_for_length share (config/ops.cpp, meta/frequencies.cpp,
// cuda/frequencies.cu), and the C++ call of the latter (api/rope.cpp): the scaling keywords of their schemas, and
// how the frequencies depend on the length.
#include <posenc/frequencies.h>

#include "portable/frequencies.h"

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
// constants, portable/frequencies.h) on the device.
struct LengthDependence {
  enum Kind { kNone, kStep, kGrowing } kind;
  double context;
  portable::DynamicNtk ntk;
};
LengthDependence length_dependence(int64_t rotary_dim, double base, const RopeScaling& scaling);

}  // namespace frequencies

// The scaling keywords of rope_inv_freq and rope_inv_freq_for_length as a kernel's parameters, in schema order
// (after rope_type), and the struct they fill; both written from the list of keys (posenc/frequencies.h). A kernel
// takes `c10::string_view rope_type POSENC_SCALING_PARAMETERS` and makes its struct with POSENC_SCALING(rope_type).
template <typename Field>
struct ScalingArgument {  // a field's kernel argument is the field itself...
  using type = Field;
  static Field field(Field value) { return value; }
  static type argument(const Field& value) { return value; }
};
template <>
struct ScalingArgument<std::vector<double>> {  // ...but a list of floats, which the dispatcher passes as a view
  using type = std::optional<c10::ArrayRef<double>>;
  static std::vector<double> field(type value) { return value ? value->vec() : std::vector<double>(); }
  static type argument(const std::vector<double>& value) {
    return value.empty() ? type() : type(c10::ArrayRef<double>(value));
  }
};
#define POSENC_SCALING_PARAMETER(A, field, key, ...) , typename ScalingArgument<field>::type key
#define POSENC_SCALING_PARAMETERS POSENC_ROPE_SCALING_KEYS(POSENC_SCALING_PARAMETER, )
#define POSENC_SCALING_FIELD(scaling, field_type, key, ...) scaling.key = ScalingArgument<field_type>::field(key);
// `, scaling.rope_theta, ..., scaling.long_factor` as the kernel arguments.
#define POSENC_SCALING_ARGUMENT(scaling, field_type, key, ...) , ScalingArgument<field_type>::argument(scaling.key)
#define POSENC_SCALING(rope_type)                                 \
  [&] {                                                           \
    frequencies::RopeScaling scaling;                             \
    scaling.rope_type = std::string(rope_type);                   \
    POSENC_ROPE_SCALING_KEYS(POSENC_SCALING_FIELD, scaling)        \
    return scaling;                                               \
  }()

// The kernel of rope_inv_freq_for_length on the CPU (config/ops.cpp), and with kMeta its Meta kernel
// (meta/frequencies.cpp): the same checks, an empty result of the real one's shape, dtype and device.
template <bool kMeta>
inline at::Tensor rope_inv_freq_for_length_kernel(const at::Tensor& seq_len, int64_t rotary_dim, double base,
                                                  c10::string_view rope_type POSENC_SCALING_PARAMETERS) {
  const auto scaling = POSENC_SCALING(rope_type);
  if constexpr (kMeta) {
    frequencies::check_rope_for_length(rotary_dim, base, scaling, seq_len);
    return at::empty({rotary_dim / 2}, seq_len.options().dtype(at::kDouble));
  } else {
    return frequencies::rope_for_length(rotary_dim, base, scaling, seq_len);
  }
}

}  // namespace posenc
