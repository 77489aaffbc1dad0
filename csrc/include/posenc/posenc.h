#pragma once
// The public C++ API of posenc. Every function goes through the dispatcher, so autograd, tracing and
// TorchScript see the same `posenc::` ops as Python's torch.ops.posenc.
#include <posenc/alibi.h>
#include <posenc/embedding.h>
#include <posenc/frequencies.h>
#include <posenc/learned.h>
#include <posenc/multiaxis.h>
#include <posenc/rope.h>
#include <posenc/sinusoidal.h>
#include <posenc/t5.h>

#include <cstdint>
#include <string>

namespace posenc {

// Version as major * 10000 + minor * 100 + patch.
int64_t version();

// The CPU capability posenc's kernels run with: "default" (x86-64 baseline), "avx2" (AVX2, FMA, F16C) or
// "avx512" (AVX-512 F/BW/VL/DQ); the best this CPU supports, unless the environment variable
// POSENC_CPU_CAPABILITY asks for a lower one. Every capability computes the same bits.
std::string cpu_capability();

}  // namespace posenc

// Any translation unit that includes this header references a symbol of libposenc, so the linker keeps
// the library (and its op registrations) even under --as-needed: torch::jit::load then finds posenc::*.
extern "C" __attribute__((weak)) int64_t (*const posenc_force_link)() = &posenc::version;
