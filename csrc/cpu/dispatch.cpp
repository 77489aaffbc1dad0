#include "cpu/dispatch.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string_view>

namespace posenc::cpu {
namespace {

Capability best_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // the checks include the OS's support of the AVX and AVX-512 register state
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return avx512 ? Capability::AVX512 : avx2 ? Capability::AVX2 : Capability::Default;
#else
  return Capability::Default;
#endif
}

Capability choose() {
  const Capability best = best_supported();
  const char* requested = std::getenv("POSENC_CPU_CAPABILITY");
  if (requested == nullptr || *requested == '\0') return best;
  for (int c = 0; c < kNumCapabilities; ++c) {
    const auto candidate = static_cast<Capability>(c);
    if (std::string_view(requested) == capability_name(candidate)) {
      return static_cast<int>(candidate) < static_cast<int>(best) ? candidate : best;
    }
  }
  TORCH_CHECK(false, "posenc: POSENC_CPU_CAPABILITY must be \"default\", \"avx2\" or \"avx512\", got \"", requested,
              "\"");
}

}  // namespace

Capability capability() {
  static const Capability chosen = choose();
  return chosen;
}

const char* capability_name(Capability capability) {
  switch (capability) {
    case Capability::AVX2: return "avx2";
    case Capability::AVX512: return "avx512";
    case Capability::Default: break;
  }
  return "default";
}

void parallel_for_range(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* context) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(context, b, e); });
}

}  // namespace posenc::cpu
