#pragma once
// Qualifiers of the kernel bodies in this folder. They hold the per-element maths and the row loops, with
// no ATen in them: the CPU build compiles them once per CPU capability (csrc/cpu/kernels/), and nvcc can
// compile the per-element functions for the device.
//
// Every inline function here lives in the inline namespace POSENC_KERNEL_NAMESPACE, which is distinct for
// each compilation of the bodies (one per CPU capability, one for CUDA). The AVX-512 build of an inline
// function and the baseline build of the same function must not share a name: the linker would keep one of
// them for every caller, and a CPU without AVX-512 would then run AVX-512 code. Types (enums, plain structs)
// hold no code and sit outside that namespace, so the op layer and every capability share them.
#if defined(__CUDACC__)
#define POSENC_HOST_DEVICE __host__ __device__
#define POSENC_KERNEL_NAMESPACE cuda
#else
#define POSENC_HOST_DEVICE
#if defined(POSENC_CPU_CAPABILITY)
#define POSENC_KERNEL_NAMESPACE POSENC_CPU_CAPABILITY
#else
#define POSENC_KERNEL_NAMESPACE host
#endif
#endif

#define POSENC_INLINE POSENC_HOST_DEVICE inline

// Iteration i of a loop marked with this reads and writes only element i (or pair i), so the loop carries
// no dependency even when its output is its input (in-place ops); saying so lets the compiler vectorize
// despite the possible aliasing.
#if defined(__clang__)
#define POSENC_NO_CARRIED_DEPENDENCY _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__) && !defined(__CUDACC__)
#define POSENC_NO_CARRIED_DEPENDENCY _Pragma("GCC ivdep")
#else
#define POSENC_NO_CARRIED_DEPENDENCY
#endif
