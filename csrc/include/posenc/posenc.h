#pragma once
// The public C++ API of posenc. Every function goes through the dispatcher, so autograd, tracing and
// TorchScript see the same `posenc::` ops as Python's torch.ops.posenc.
#include <posenc/alibi.h>
#include <posenc/cuda.h>
#include <posenc/embedding.h>
#include <posenc/frequencies.h>
#include <posenc/learned.h>
#include <posenc/multiaxis.h>
#include <posenc/qk_norm.h>
#include <posenc/rope.h>
#include <posenc/sinusoidal.h>
#include <posenc/t5.h>
#include <posenc/version.h>

#include <string>

namespace posenc {

// The version of the libposenc loaded at run time, "MAJOR.MINOR.PATCH": the same string as Python's
// posenc.__version__. POSENC_VERSION (posenc/version.h) is the version of the headers compiled against.
const char* version();

// The CPU capability posenc's kernels run with: "default" (x86-64 baseline), "avx2" (AVX2, FMA, F16C) or
// "avx512" (AVX-512 F/BW/VL/DQ); the best this CPU supports, unless the environment variable
// POSENC_CPU_CAPABILITY asks for a lower one. Every capability computes the same bits.
std::string cpu_capability();

}  // namespace posenc

// posenc::version() under a C name, for loaders that cannot call C++ functions (Python's ctypes).
extern "C" const char* posenc_version();

// Any translation unit that includes this header references a symbol of libposenc, so the linker keeps
// the library (and its op registrations) even under --as-needed: torch::jit::load then finds posenc::*.
extern "C" __attribute__((weak)) const char* (*const posenc_force_link)() = &posenc::version;
