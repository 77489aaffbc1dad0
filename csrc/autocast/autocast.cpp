// Autocast (torch.autocast): every posenc op behaves as the PyTorch op nearest to it does under autocast.
//
// PyTorch's autocast casts matmul-like ops to the lower precision and a list of numerically sensitive ops to
// float32; elementwise maths (mul, add), embedding lookups and index ops are left alone and run in the dtypes
// they are given, with ordinary type promotion. The nearest PyTorch op of each posenc op is one of those:
// rotations are elementwise products of x with cos/sin, the additive encodings are torch.add, the tables are
// embedding lookups, the biases are lookups or products of constants. So:
//   - fall through (no cast; the result in the dtype the op gives outside autocast): every op whose
//     inputs may differ in dtype already (frequencies, slopes and cos/sin tables are read in the maths
//     type of the data) or that has one floating input;
//   - promote, as torch.add does (cast the floating inputs to their promoted dtype), where the op asks for
//     matching dtypes and the PyTorch expression it replaces would promote: add_learned (x + embedding
//     (weight)) and embed_learned (embedding(token_weight) + embedding(pos_weight));
//   - rope_qk / rope_qk_backward with q and k of different dtypes: two rotations, each in its own dtype, as
//     the two elementwise expressions would give.
// The same policy is registered for AutocastCUDA.
#include <posenc/learned.h>
#include <posenc/rope.h>

#include "families.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <set>
#include <string_view>

namespace posenc {
namespace {

// The dtype both tensors are cast to: torch.add's promotion when both are floating. Anything else is left
// as it is, so that the op's own check names the argument.
at::ScalarType promoted(const at::Tensor& a, const at::Tensor& b) {
  if (!at::isFloatingType(a.scalar_type()) || !at::isFloatingType(b.scalar_type())) {
    return a.scalar_type();
  }
  return at::promote_types(a.scalar_type(), b.scalar_type());
}

at::Tensor cast(const at::Tensor& t, at::ScalarType type) {
  return at::isFloatingType(t.scalar_type()) ? t.to(type) : t;
}

template <c10::DispatchKey kAutocast>
at::Tensor add_learned_autocast(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& positions, int64_t offset,
                                std::optional<int64_t> padding_idx) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocast);
  const auto type = promoted(x, weight);
  return add_learned(cast(x, type), cast(weight, type), positions, offset, padding_idx);
}

template <c10::DispatchKey kAutocast>
at::Tensor embed_learned_autocast(const at::Tensor& tokens, const at::Tensor& token_weight,
                                  const at::Tensor& pos_weight, const std::optional<at::Tensor>& positions,
                                  double token_scale, std::optional<int64_t> padding_idx, int64_t offset,
                                  std::optional<int64_t> pos_padding_idx) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocast);
  const auto type = promoted(token_weight, pos_weight);
  return embed_learned(tokens, cast(token_weight, type), cast(pos_weight, type), positions, token_scale,
                       padding_idx, offset, pos_padding_idx);
}

// rope_qk (kInverse = false) and rope_qk_backward (kInverse = true).
template <c10::DispatchKey kAutocast, bool kInverse>
std::tuple<at::Tensor, at::Tensor> rope_qk_autocast(const at::Tensor& q, const at::Tensor& k,
                                                    const std::optional<at::Tensor>& positions,
                                                    const at::Tensor& inv_freq, double attention_scale,
                                                    c10::string_view layout, c10::string_view format, int64_t offset,
                                                    const std::optional<at::Tensor>& cu_seqlens,
                                                    const std::optional<at::Tensor>& pair_axis) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocast);
  const auto rotate = kInverse ? rope_backward : rope;  // one tensor
  if (q.scalar_type() != k.scalar_type() && at::isFloatingType(q.scalar_type()) &&
      at::isFloatingType(k.scalar_type())) {
    return {rotate(q, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis),
            rotate(k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis)};
  }
  return kInverse ? rope_qk_backward(q, k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                                     pair_axis)
                  : rope_qk(q, k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                            pair_axis);
}

template <c10::DispatchKey kAutocast>
void register_policy(torch::Library& m) {
  // Learned ~ embedding(weight) (+ x): torch.add promotes.
  m.impl("add_learned", TORCH_FN(add_learned_autocast<kAutocast>));
  m.impl("embed_learned", TORCH_FN(embed_learned_autocast<kAutocast>));
  m.impl("rope_qk", TORCH_FN((rope_qk_autocast<kAutocast, false>)));
  m.impl("rope_qk_backward", TORCH_FN((rope_qk_autocast<kAutocast, true>)));
  // Every other op runs in the dtypes it is given: rotations ~ x * cos + rotate(x) * sin; sinusoidal ~ x * scale +
  // a table computed from positions; learned() ~ embedding(weight); ALiBi ~ scores + a bias of constant slopes;
  // T5 ~ embedding(weight); integer positions and buckets; configuration constants (float64 or int64 whatever the
  // autocast state, as the constants a model holds are).
  const std::set<std::string_view> cast = {"add_learned", "embed_learned", "rope_qk", "rope_qk_backward"};
#define POSENC_SAME_DTYPES_AS_GIVEN(A, op) \
  if (!cast.count(#op)) m.impl(#op, torch::CppFunction::makeFallthrough());
  POSENC_ALL_OPS(POSENC_SAME_DTYPES_AS_GIVEN, )
#undef POSENC_SAME_DTYPES_AS_GIVEN
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, AutocastCPU, m) {
  register_policy<c10::DispatchKey::AutocastCPU>(m);
}

TORCH_LIBRARY_IMPL(posenc, AutocastCUDA, m) {
  register_policy<c10::DispatchKey::AutocastCUDA>(m);
}

}  // namespace posenc
