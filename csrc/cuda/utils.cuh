#pragma once
// What every CUDA op file shares: launch geometry, 16-byte vector access, the current stream and device, and
// whether the stream is being captured into a CUDA graph. Only c10's CUDA parts (c10_cuda, the CUDA runtime):
// no cuBLAS or other toolkit headers, which a partial CUDA toolkit may lack.
#include "portable/convert.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace posenc::cuda {

// What every family's CUDA device struct shares: the guard that makes the inputs' device current for a call, and
// outputs allocated through the dispatcher (CUDA's caching allocator).
struct CudaDevice {
  using Guard = c10::cuda::CUDAGuard;

  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) { return at::empty(sizes, options); }
};

constexpr int kThreads = 256;     // threads per block of the elementwise kernels
constexpr int kVectorBytes = 16;  // one global load or store per thread: 128 bits

// Elements of T in one 16-byte access: 8 for fp16/bf16, 4 for float32, 2 for float64.
template <typename T>
constexpr int kMaxVec = kVectorBytes / static_cast<int>(sizeof(T));

// N values of T that load and store as one 16-byte instruction when the address is 16-byte aligned (N = 1:
// a plain scalar access).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

// A 16-byte vector is stored as one uint4 through __stwb: nvcc splits a plain assignment of the vector into
// 2- and 4-byte stores whenever the row address involves a division (scripts/cuda_static_checks.sh checks the
// SASS for STG.E.128).
template <int N, typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& value) {
  if constexpr (sizeof(Vec<T, N>) == sizeof(uint4)) {
    uint4 bits;
    memcpy(&bits, &value, sizeof(bits));
    __stwb(reinterpret_cast<uint4*>(p), bits);
  } else {
    *reinterpret_cast<Vec<T, N>*>(p) = value;
  }
}

inline bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Multiprocessors of the current device, read once per device.
int multiprocessors();

// Blocks for a grid-stride loop over `work` items of `per_block` each: enough to fill the device several
// times over, no more (the loop covers the rest).
inline unsigned int grid_size(int64_t work, int64_t per_block) {
  const int64_t wanted = std::max<int64_t>(1, ceil_div(work, per_block));
  return static_cast<unsigned int>(std::min<int64_t>(wanted, int64_t{multiprocessors()} * 32));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// A stream being captured into a CUDA graph may not synchronize or copy to the host: the checks that read
// index data back (positions.cuh) are skipped then, and the kernels stay in bounds by themselves.
inline bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// A quiet NaN in maths precision: what a kernel writes for a row that an out-of-range index names, which only
// a graph capture (no host check) lets through.
template <typename T>
__device__ __forceinline__ T quiet_nan() {
  return static_cast<T>(__longlong_as_double(0x7FF8000000000000LL));
}

}  // namespace posenc::cuda

#define POSENC_CUDA_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()
