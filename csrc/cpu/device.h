#pragma once
// What the CPU side of every family's op layer shares: each family's CPU device struct derives from CpuDevice.
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace posenc {

struct CpuDevice {
  // The op layers make their device current for a call (a CUDA guard); the CPU has none to make current.
  struct Guard {
    explicit Guard(c10::Device) {}
  };

  // A contiguous output, allocated as ATen's own CPU kernels allocate theirs: without a second trip through the
  // dispatcher, which costs as much as the rest of a small call's op layer.
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    return at::detail::empty_cpu(sizes, options);
  }

  // A small 1-D tensor (a norm's weight) in dtype `to`, plus `add` added there: weight.to(to) + add, its values
  // converted and added as ATen converts and adds them (the weight itself where nothing changes), in one allocation
  // and a loop instead of two or three ops through the dispatcher: bf16 weights' qk_norm_rope on [1, 1, 1, 8],
  // 6.4 -> 4.8 us a call. Also the weights' gradients back to the weights' dtype.
  static at::Tensor converted(const at::Tensor& weight, at::ScalarType to, double add);

  // A 1-D tensor of zeros (a weight's gradient to sum into), without the dispatcher's fill.
  static at::Tensor zeros(int64_t size, const at::TensorOptions& options);
};

}  // namespace posenc
