#pragma once
// The first include of every kernel file in this folder. CMake compiles each of those files once per CPU
// capability, defining POSENC_CPU_CAPABILITY (DEFAULT, AVX2, AVX512: the namespace of that build's
// functions) and POSENC_CPU_CAPABILITY_INDEX (its slot in the dispatch stubs).
//
// The whole file is compiled for the x86-64 baseline; only the code between POSENC_KERNELS_BEGIN and
// POSENC_KERNELS_END targets the capability (a target pragma, not -mavx512f on the command line). So the
// standard library and c10 functions the kernels instantiate (std::vector's growth, say), which the linker
// merges with the same functions of other files, stay baseline code, and so does the registration that runs
// when the library loads on any CPU. Headers those kernels use are included here, before the pragma, for the
// same reason.
#if !defined(POSENC_CPU_CAPABILITY) || !defined(POSENC_CPU_CAPABILITY_INDEX)
#error "cpu/kernels/*.cpp are compiled once per CPU capability by CMake, with POSENC_CPU_CAPABILITY(_INDEX) set"
#endif

#include "cpu/dispatch.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace posenc::cpu {

// Scratch rows of the kernels (coefficient rows, widened tokens, partial sums, encodings of a block) on 64-byte
// lines, as torch's tensors are. malloc's 16-byte alignment left each 64-byte vector load and store of a row split
// over two lines, as often as where the row landed made them: on lines, the qk_norm_rope backward ran 1.07-1.18x
// faster and its forward and rope_qk's 1.06-1.24x in cache (in-process A/B, the same bits); the additive, embedding,
// ALiBi and resampled rows, which stream, measured 0.97-1.05x.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const noexcept { return false; }
};

template <typename T>
using ScratchVector = std::vector<T, LineAllocator<T>>;

// A task's scratch of n values (zeroed, on a 64-byte line, as a ScratchVector's), on the stack where they fit 4 KiB:
// a decoding step's token rows. A 64-byte-aligned heap block comes from glibc's memalign: about 1,300 of the 17k
// instructions a small rope_qk spends below torch.ops' binding (callgrind).
template <typename T>
class SmallScratch {
 public:
  explicit SmallScratch(int64_t n) {
    if (n > kInline) {
      heap_.resize(n);
    } else {
      std::fill_n(inline_, n, T{});
    }
  }
  SmallScratch(const SmallScratch&) = delete;
  SmallScratch& operator=(const SmallScratch&) = delete;
  T* data() { return heap_.empty() ? inline_ : heap_.data(); }
  T& operator[](int64_t i) { return data()[i]; }

 private:
  static constexpr int64_t kInline = 4096 / sizeof(T);
  alignas(64) T inline_[kInline];
  ScratchVector<T> heap_;
};

}  // namespace posenc::cpu

#if POSENC_CPU_CAPABILITY_INDEX == 0 || !(defined(__x86_64__) || defined(__i386__))
#define POSENC_KERNELS_BEGIN
#define POSENC_KERNELS_END
#elif defined(__clang__)
#if POSENC_CPU_CAPABILITY_INDEX == 1
#define POSENC_KERNELS_BEGIN \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#else
#define POSENC_KERNELS_BEGIN                                                                             \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c\"))), " \
          "apply_to = function)")
#endif
#define POSENC_KERNELS_END _Pragma("clang attribute pop")
#else
#if POSENC_CPU_CAPABILITY_INDEX == 1
#define POSENC_KERNELS_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#else
// GCC vectorizes with 256-bit registers by default even where the CPU has AVX-512. The memory-bound kernels
// run their fp16/bf16 conversions and rotations in 512-bit registers instead: half the instructions per byte,
// measured 10-35% faster on bf16.
#define POSENC_KERNELS_BEGIN \
  _Pragma("GCC push_options")  \
      _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512\")")
#endif
#define POSENC_KERNELS_END _Pragma("GCC pop_options")
#endif

// Registers `fn` in `stub`'s slot for this capability when the library loads (baseline code: after
// POSENC_KERNELS_END).
#define POSENC_CONCAT_IMPL(a, b) a##b
#define POSENC_CONCAT(a, b) POSENC_CONCAT_IMPL(a, b)
#define POSENC_REGISTER_KERNEL(stub, fn) \
  static const bool POSENC_CONCAT(posenc_registered_, __COUNTER__) = ((stub).kernels[POSENC_CPU_CAPABILITY_INDEX] = (fn), true)
// stub<T> gets kernel<T> for each floating dtype a tensor may hold.
#define POSENC_REGISTER_FLOATING_KERNELS(stub, kernel)           \
  POSENC_REGISTER_KERNEL(stub<float>, &kernel<float>);            \
  POSENC_REGISTER_KERNEL(stub<double>, &kernel<double>);          \
  POSENC_REGISTER_KERNEL(stub<c10::Half>, &kernel<c10::Half>);    \
  POSENC_REGISTER_KERNEL(stub<c10::BFloat16>, &kernel<c10::BFloat16>)
