#pragma once
// The public C++ API of posenc. Every function goes through the dispatcher, so autograd, tracing and
// TorchScript see the same `posenc::` ops as Python's torch.ops.posenc.
#include <posenc/alibi.h>
#include <posenc/embedding.h>
#include <posenc/frequencies.h>
#include <posenc/learned.h>
#include <posenc/rope.h>
#include <posenc/sinusoidal.h>
#include <posenc/t5.h>

#include <cstdint>

namespace posenc {

// Version as major * 10000 + minor * 100 + patch.
int64_t version();

}  // namespace posenc

// Any translation unit that includes this header references a symbol of libposenc, so the linker keeps
// the library (and its op registrations) even under --as-needed: torch::jit::load then finds posenc::*.
extern "C" __attribute__((weak)) int64_t (*const posenc_force_link)() = &posenc::version;
