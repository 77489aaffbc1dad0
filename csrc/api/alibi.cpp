#include <posenc/alibi.h>

#include <ATen/ops/empty.h>

namespace posenc {
namespace nn {

ALiBiImpl::ALiBiImpl(int64_t num_heads, std::string mode, bool learnable, int64_t head_offset,
                     std::optional<int64_t> num_local_heads)
    : slopes_(alibi_slopes(num_heads)),
      mode_(std::move(mode)),
      learnable_(learnable),
      head_offset_(head_offset),
      num_local_heads_(num_local_heads.value_or(num_heads - head_offset)) {
  TORCH_CHECK(mode_ == "causal" || mode_ == "symmetric",
              "posenc.nn.ALiBi: mode must be \"causal\" or \"symmetric\", got \"", mode_, "\"");
  TORCH_CHECK(head_offset_ >= 0 && num_local_heads_ > 0 && head_offset_ + num_local_heads_ <= num_heads,
              "posenc.nn.ALiBi: heads [", head_offset_, ", ", head_offset_ + num_local_heads_,
              ") are not a non-empty part of the ", num_heads, " heads");
  if (learnable_) slopes_ = register_parameter("slopes", slopes_);
}

at::Tensor ALiBiImpl::forward(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 4 && scores.size(1) == num_local_heads_, "posenc.nn.ALiBi: scores must be [B, ",
              num_local_heads_, ", Q, K], got shape ", scores.sizes());
  if (!learnable_ && slopes_.device() != scores.device()) slopes_ = slopes_.to(scores.device());
  return add_alibi(scores, slopes_, mode_, head_offset_);
}

at::Tensor ALiBiImpl::bias(int64_t q_len, int64_t k_len, std::optional<at::ScalarType> dtype) {
  return alibi_bias(slopes_, q_len, k_len, mode_, head_offset_, num_local_heads_, dtype);
}

}  // namespace nn
}  // namespace posenc
