#include "cpu/dispatch.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <optional>
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

// POSENC_AVX512_BF16=0 runs the AVX-512 kernels as a CPU without AVX-512 BF16 runs them (Skylake-X to Ice Lake), so
// that their other bf16 paths are tested on a CPU that has it.
bool cpu_has_avx512_bf16() {
  const char* requested = std::getenv("POSENC_AVX512_BF16");
  const std::string_view asked = requested != nullptr ? requested : "";
  TORCH_CHECK(asked.empty() || asked == "0" || asked == "1",
              "posenc: POSENC_AVX512_BF16 must be \"0\" or \"1\", got \"", asked, "\"");
  if (asked == "0") return false;
#if defined(__x86_64__) || defined(__i386__)
  return best_supported() == Capability::AVX512 && __builtin_cpu_supports("avx512bf16");  // best_supported inits
#else
  return false;
#endif
}

// The count a switch asks for (a whole number in [0, limit)), or nullopt where it is unset; anything else is an error
// naming the switch and what it counts.
std::optional<int64_t> requested_count(const char* name, const char* what, long long limit) {
  const char* requested = std::getenv(name);
  if (requested == nullptr || *requested == '\0') return std::nullopt;
  char* end = nullptr;
  const long long count = std::strtoll(requested, &end, 10);
  TORCH_CHECK(*end == '\0' && count >= 0 && count < limit, "posenc: ", name, " must be ", what, " >= 0, got \"",
              requested, "\"");
  return count;
}

int64_t choose_encoding_cache_bytes() {
  const auto mib = requested_count("POSENC_ENCODING_CACHE_MB", "a count of MiB", 1LL << 40);
  return (mib ? *mib : 64) << 20;
}

Capability choose() {
  // A bad switch is an error at the first call of any op, on every CPU, not only where it applies.
  has_avx512_bf16();
  encoding_cache_bytes();
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

// The size of the first CPU's cache at `index` (index2: its L2, index3: the last level) as Linux describes it, or 0
// where it does not. Read with C's stdio, not an iostream: a library built with a copy of libstdc++ of its own crashed
// on the iostream's locale (docs/install.md).
int64_t cache_bytes(int index) {
  char path[64];
  std::snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu0/cache/index%d/size", index);
  long long kib = 0;
  if (std::FILE* file = std::fopen(path, "r")) {
    if (std::fscanf(file, "%lld", &kib) != 1) kib = 0;
    std::fclose(file);
  }
  return kib > 0 ? static_cast<int64_t>(kib) << 10 : 0;
}

int64_t choose_stream_bytes() {
  if (const auto bytes = requested_count("POSENC_STREAM_BYTES", "a byte count", LLONG_MAX)) return *bytes;
  // One instance of the last-level cache, but at most 32 MiB: a virtual machine is shown the host's whole cache,
  // not the share its cores keep. An Emerald Rapids guest of 2 cores lists 300 MiB, yet its copies slow to memory's
  // speed past working sets of 64 MiB, and rope_qk writing 32 MiB of float32 ran 1.5-1.7x as fast past the caches.
  constexpr int64_t kMostBytes = int64_t{32} << 20;
  const int64_t bytes = cache_bytes(3);
  return bytes > 0 ? std::min(bytes, kMostBytes) : kMostBytes;
}

}  // namespace

int64_t stream_bytes() {
  static const int64_t bytes = choose_stream_bytes();
  return bytes;
}

int64_t encoding_cache_bytes() {
  static const int64_t bytes = choose_encoding_cache_bytes();
  return bytes;
}

bool has_avx512_bf16() {
  static const bool has = cpu_has_avx512_bf16();
  return has;
}

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

int64_t num_threads() { return at::get_num_threads(); }

void parallel_for_range(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* context) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(context, b, e); });
}

}  // namespace posenc::cpu
