// Autograd of the T5 relative bias: a torch::autograd::Function at the Autograd key calling t5_bias below
// autograd and t5_bias_backward through the dispatcher. The bias is a gather, linear in the table, so the
// backward is linear in its gradient and its own derivative is a gather again: double backward works. A call
// with nothing to record goes straight below autograd, as PyTorch's VariableType kernels do.
#include <posenc/t5.h>

#include "autograd/kernels.h"
#include "families.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace posenc {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Nothing but the bucket configuration is saved: the backward needs no tensor of the forward.
void save_buckets(AutogradContext* ctx, bool bidirectional, int64_t num_buckets, int64_t max_distance,
                  const c10::SymInt& q_offset) {
  ctx->saved_data["bidirectional"] = bidirectional;
  ctx->saved_data["num_buckets"] = num_buckets;
  ctx->saved_data["max_distance"] = max_distance;
  ctx->saved_data["q_offset"] = q_offset;
}

struct T5Bias : public torch::autograd::Function<T5Bias> {
  static constexpr const char* kOp = "posenc::t5_bias";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight, c10::SymInt q_len, c10::SymInt k_len,
                            bool bidirectional, int64_t num_buckets, int64_t max_distance, c10::SymInt q_offset) {
    save_buckets(ctx, bidirectional, num_buckets, max_distance, q_offset);
    at::AutoDispatchBelowADInplaceOrView guard;
    return t5_bias_symint(weight, std::move(q_len), std::move(k_len), bidirectional, num_buckets, max_distance,
                          std::move(q_offset));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto grad_weight = t5_bias_backward_symint(
        grad_outputs[0], ctx->saved_data["bidirectional"].toBool(), ctx->saved_data["num_buckets"].toInt(),
        ctx->saved_data["max_distance"].toInt(), ctx->saved_data["q_offset"].toSymInt());
    return {grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto t5_bias_autograd = POSENC_AUTOGRAD(T5Bias);

// The derivative of t5_bias_backward along grad, applied to a table gradient gg, is t5_bias(gg).
struct T5BiasBackward : public torch::autograd::Function<T5BiasBackward> {
  static constexpr const char* kOp = "posenc::t5_bias_backward";

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, bool bidirectional, int64_t num_buckets,
                            int64_t max_distance, c10::SymInt q_offset) {
    save_buckets(ctx, bidirectional, num_buckets, max_distance, q_offset);
    ctx->saved_data["q_len"] = grad.sym_size(2);
    ctx->saved_data["k_len"] = grad.sym_size(3);
    at::AutoDispatchBelowADInplaceOrView guard;
    return t5_bias_backward_symint(grad, bidirectional, num_buckets, max_distance, std::move(q_offset));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto grad_grad = t5_bias_symint(
        grad_outputs[0], ctx->saved_data["q_len"].toSymInt(), ctx->saved_data["k_len"].toSymInt(),
        ctx->saved_data["bidirectional"].toBool(), ctx->saved_data["num_buckets"].toInt(),
        ctx->saved_data["max_distance"].toInt(), ctx->saved_data["q_offset"].toSymInt());
    return {grad_grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
constexpr auto t5_bias_backward_autograd = POSENC_AUTOGRAD(T5BiasBackward);

constexpr auto relative_position_bucket_autograd = POSENC_BELOW_AUTOGRAD(relative_position_bucket);

}  // namespace

TORCH_LIBRARY_IMPL(posenc, Autograd, m) { POSENC_T5_OPS(POSENC_IMPL_SUFFIXED, _autograd) }

}  // namespace posenc
