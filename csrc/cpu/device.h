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
};

}  // namespace posenc
