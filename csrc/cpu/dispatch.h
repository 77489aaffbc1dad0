#pragma once
// Runtime CPU dispatch, as ATen's DispatchStub does it: every kernel file in cpu/kernels/ is compiled once
// per capability (its functions in a namespace of that capability's name), each build registers its entry
// points in the stubs declared here, and a call goes to the best build the CPU runs. No ATen in this
// header: the kernel builds include it.
#include <cstdint>
#include <type_traits>
#include <utility>

namespace posenc::cpu {

// In increasing order: x86-64 baseline (SSE2); AVX2 with FMA and F16C; AVX-512 (F, BW, VL, DQ).
enum class Capability : int { Default = 0, AVX2 = 1, AVX512 = 2 };
constexpr int kNumCapabilities = 3;

// The capability the kernels run with: the best one this CPU supports, or the one the environment variable
// POSENC_CPU_CAPABILITY (default, avx2, avx512) asks for if the CPU supports it (else the best supported one
// below it). Chosen at the first call; an unknown value raises an error naming it.
Capability capability();
const char* capability_name(Capability capability);

// Whether the CPU has AVX-512 BF16 (vcvtneps2bf16), which the AVX-512 build uses where it has it: the same bits
// as without it (convert.h).
bool has_avx512_bf16();

// Outputs of at least this many bytes per call are stored past the caches (non-temporal stores): the size of the
// last-level cache (one instance of it, as Linux describes it), at most 32 MiB, or the environment variable
// POSENC_STREAM_BYTES. Read at the first call. Such an output would leave the cache before anyone reads it, and
// an ordinary store first reads every line it writes: a third of the traffic of a rotation out of place.
int64_t stream_bytes();

// Whether a call that moves `bytes` (read or written) is past the caches: at least stream_bytes(), and not empty.
inline bool past_caches(int64_t bytes) { return bytes > 0 && bytes >= stream_bytes(); }

// The most bytes of sinusoidal encoding tables kept between calls (cpu/sinusoidal.cpp): 64 MiB, or the environment
// variable POSENC_ENCODING_CACHE_MB (0: none kept). Read at the first call.
int64_t encoding_cache_bytes();

// Whether a call that writes `bytes_written` out of place stores them past the caches: float32 outputs of at least
// stream_bytes(). bfloat16 rows measured slower that way (their rounding and the pass through L1 cost more than
// the lines not read); float64 rows, rotated into a row in L1, were compiled to fused multiply-adds.
template <typename scalar_t>
bool streams_output(int64_t bytes_written) {
  return std::is_same_v<scalar_t, float> && past_caches(bytes_written);
}

// One kernel entry point, one function per capability; a capability's build fills its own slot when the
// library loads (default always exists), and a call runs the best filled slot up to capability().
template <typename Fn>
struct DispatchStub;

template <typename R, typename... Args>
struct DispatchStub<R(Args...)> {
  R (*kernels[kNumCapabilities])(Args...) = {};

  auto get() const {
    for (int c = static_cast<int>(capability()); c > 0; --c) {
      if (kernels[c] != nullptr) return kernels[c];
    }
    return kernels[0];
  }

  R operator()(Args... args) const { return get()(std::forward<Args>(args)...); }
};

// The threads parallel_for may run on (at::get_num_threads): for kernels that cut their work into as many tasks.
int64_t num_threads();

// at::parallel_for for the kernel builds, which hold no ATen: f(begin, end) over [begin, end) in chunks of
// at least `grain`, on the intra-op thread pool (or inline when already inside a parallel region).
using RangeFn = void (*)(const void* context, int64_t begin, int64_t end);
void parallel_for_range(int64_t begin, int64_t end, int64_t grain, RangeFn fn, const void* context);

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_for_range(
      begin, end, grain, [](const void* context, int64_t b, int64_t e) { (*static_cast<const F*>(context))(b, e); },
      &f);
}

}  // namespace posenc::cpu
