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
#include <posenc/rope.h>

#include "families.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <map>
#include <set>
#include <string_view>
#include <vector>

namespace posenc {
namespace {

// The arguments that the promoting ops cast (families.h). When one of them is not floating, none is cast, so that
// the op's own check names it.
#define POSENC_PROMOTED_ENTRY(op, ...) {#op, {__VA_ARGS__}},
const std::map<std::string_view, std::vector<std::string_view>> kPromoted = {
    POSENC_AUTOCAST_PROMOTED(POSENC_PROMOTED_ENTRY)};
#undef POSENC_PROMOTED_ENTRY

// A boxed kernel: reads the op's arguments by name from its schema, so an op joins the policy by its entry in
// families.h.
template <c10::DispatchKey kAutocast>
void promote_like_add(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto first = stack->size() - schema.arguments().size();
  std::vector<c10::IValue*> cast;
  for (const auto name : kPromoted.at(std::string_view(schema.name()).substr(std::string_view("posenc::").size()))) {
    const auto index = schema.argumentIndexWithName(name);
    TORCH_INTERNAL_ASSERT(index, schema.name(), " has no argument ", name, " (POSENC_AUTOCAST_PROMOTED)");
    auto& value = (*stack)[first + *index];
    if (!value.isTensor() || !at::isFloatingType(value.toTensor().scalar_type())) {
      cast.clear();
      break;
    }
    cast.push_back(&value);
  }
  if (!cast.empty()) {
    auto type = cast[0]->toTensor().scalar_type();
    for (const auto* value : cast) type = at::promote_types(type, value->toTensor().scalar_type());
    for (auto* value : cast) *value = value->toTensor().to(type);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocast);
  op.callBoxed(stack);
}

// rope_qk (kInverse = false) and rope_qk_backward (kInverse = true).
template <c10::DispatchKey kAutocast, bool kInverse>
std::tuple<at::Tensor, at::Tensor> rope_qk_autocast(const at::Tensor& q, const at::Tensor& k,
                                                    const std::optional<at::Tensor>& positions,
                                                    const at::Tensor& inv_freq, double attention_scale,
                                                    c10::string_view layout, c10::string_view format, int64_t offset,
                                                    const std::optional<at::Tensor>& cu_seqlens,
                                                    const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
                                                    int64_t q_scale_length, int64_t q_scale_shift) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocast);
  const auto rotate_qk = [&](const at::Tensor& a, const at::Tensor& b) {
    return kInverse ? rope_qk_backward(a, b, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                                       pair_axis, q_scale_beta, q_scale_length, q_scale_shift)
                    : rope_qk(a, b, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                              pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
  };
  if (q.scalar_type() != k.scalar_type() && at::isFloatingType(q.scalar_type()) &&
      at::isFloatingType(k.scalar_type())) {
    // Two rotations: q's (with its scale; k := q keeps the call's shapes valid), then k alone.
    const auto rotate = kInverse ? rope_backward : rope;
    return {std::get<0>(rotate_qk(q, q)),
            rotate(k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis)};
  }
  return rotate_qk(q, k);
}

template <c10::DispatchKey kAutocast>
void register_policy(torch::Library& m) {
  // Learned ~ embedding(weight) (+ x): torch.add promotes.
  for (const auto& [op, arguments] : kPromoted) {
    m.impl(op.data(), torch::CppFunction::makeFromBoxedFunction<&promote_like_add<kAutocast>>());
  }
  m.impl("rope_qk", TORCH_FN((rope_qk_autocast<kAutocast, false>)));
  m.impl("rope_qk_backward", TORCH_FN((rope_qk_autocast<kAutocast, true>)));
  // Every other op runs in the dtypes it is given: rotations ~ x * cos + rotate(x) * sin; sinusoidal ~ x * scale +
  // a table computed from positions; learned() ~ embedding(weight); ALiBi ~ scores + a bias of constant slopes;
  // T5 ~ embedding(weight); integer positions and buckets; configuration constants (float64 or int64 whatever the
  // autocast state, as the constants a model holds are).
  const std::set<std::string_view> rotations_in_own_dtype = {"rope_qk", "rope_qk_backward"};
#define POSENC_SAME_DTYPES_AS_GIVEN(A, op, ...)                        \
  if (!kPromoted.count(#op) && !rotations_in_own_dtype.count(#op)) { \
    m.impl(#op, torch::CppFunction::makeFallthrough());                \
  }
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
