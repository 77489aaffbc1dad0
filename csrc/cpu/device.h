#pragma once
// What the CPU side of every family's op layer shares.
#include <c10/core/Device.h>

namespace posenc {

// The op layers make their device current for a call (a CUDA guard); the CPU has none to make current.
struct CpuGuard {
  explicit CpuGuard(c10::Device) {}
};

}  // namespace posenc
