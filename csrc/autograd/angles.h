#pragma once
// What the rotary family's Autograd kernels (autograd/rope.cpp, autograd/qk_norm.cpp) save of a rotation by angles:
// positions, frequencies and scalars, never the rotated tensors.
#include <posenc/rope.h>

#include <torch/autograd.h>

#include <optional>
#include <string>
#include <vector>

namespace posenc {

inline std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Everything a rotation by angles needs besides the rotated tensors.
struct Angles {
  static constexpr size_t kTensors = 4;  // positions, inv_freq, cu_seqlens, pair_axis (undefined where absent)

  std::optional<at::Tensor> positions;
  at::Tensor inv_freq;
  double attention_scale;
  std::string layout;
  std::string format;
  int64_t offset;
  std::optional<at::Tensor> cu_seqlens;
  std::optional<at::Tensor> pair_axis;
  double q_scale_beta = 0.0;  // rope_qk's query scale
  int64_t q_scale_length = 1;
  int64_t q_scale_shift = 0;

  // The tensors to save, kTensors of them, appended to `saved` (the caller's save_for_backward makes one call); the
  // scalars go to ctx's saved_data.
  void save(torch::autograd::AutogradContext* ctx, std::vector<at::Tensor>& saved) const {
    saved.insert(saved.end(), {positions.value_or(at::Tensor()), inv_freq, cu_seqlens.value_or(at::Tensor()),
                               pair_axis.value_or(at::Tensor())});
    ctx->saved_data["attention_scale"] = attention_scale;
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["format"] = format;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["q_scale_beta"] = q_scale_beta;
    ctx->saved_data["q_scale_length"] = q_scale_length;
    ctx->saved_data["q_scale_shift"] = q_scale_shift;
  }

  // `saved`: ctx->get_saved_variables(), read once per backward (non-reentrant activation checkpointing refuses a
  // second read of the same saved tensors); save's tensors from index `first`.
  static Angles load(torch::autograd::AutogradContext* ctx, const torch::autograd::variable_list& saved,
                     size_t first = 0) {
    return {optional_of(saved[first]),
            saved[first + 1],
            ctx->saved_data["attention_scale"].toDouble(),
            ctx->saved_data["layout"].toStringRef(),
            ctx->saved_data["format"].toStringRef(),
            ctx->saved_data["offset"].toInt(),
            optional_of(saved[first + 2]),
            optional_of(saved[first + 3]),
            ctx->saved_data["q_scale_beta"].toDouble(),
            ctx->saved_data["q_scale_length"].toInt(),
            ctx->saved_data["q_scale_shift"].toInt()};
  }

  at::Tensor rotate(const at::Tensor& x, bool inverse) const {
    return inverse
               ? rope_backward(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis)
               : rope(x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, pair_axis);
  }
};

}  // namespace posenc
