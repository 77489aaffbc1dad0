#pragma once
// What every CUDA op file shares: launch geometry, 16-byte vector access, the current stream and device, and
// whether the stream is being captured into a CUDA graph. Only c10's CUDA parts (c10_cuda, the CUDA runtime):
// no cuBLAS or other toolkit headers, which a partial CUDA toolkit may lack.
#include "cuda/geometry.h"
#include "portable/convert.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace posenc::cuda {

// Raises the failure a device check recorded on the current device since the last one raised (cuda/checks.cuh).
void raise_recorded_failure();

// The guard of every posenc CUDA op: makes the inputs' device current, then raises what an earlier call's device
// checks found, if anything (a load from host memory, no synchronization).
struct CheckingGuard : c10::cuda::CUDAGuard {
  explicit CheckingGuard(at::Device device) : c10::cuda::CUDAGuard(device) { raise_recorded_failure(); }
};

// What every family's CUDA device struct shares: the guard that makes the inputs' device current for a call, and
// outputs allocated through the dispatcher (CUDA's caching allocator).
struct CudaDevice {
  using Guard = CheckingGuard;

  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) { return at::empty(sizes, options); }

  // A small 1-D tensor (a norm's weight) in dtype `to`, plus `add` added there.
  static at::Tensor converted(const at::Tensor& weight, at::ScalarType to, double add) {
    const auto out = weight.to(to);
    return add != 0 ? out.add(add) : out.contiguous();
  }

  static at::Tensor zeros(int64_t size, const at::TensorOptions& options) { return at::zeros({size}, options); }
};

// The launch constants and index maths of cuda/geometry.h, which tests/cpp/test_cuda_geometry.cpp checks on the host.
constexpr int kThreads = geometry::kThreads;
constexpr int kVectorBytes = geometry::kVectorBytes;
template <typename T>
constexpr int kMaxVec = geometry::kMaxVec<T>;

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

inline bool aligned(const void* p) { return geometry::aligned(p); }

using geometry::ceil_div;

// Multiprocessors of the current device, read once per device.
int multiprocessors();

// Blocks for a grid-stride loop over `work` items of `per_block` each: enough to fill the device several
// times over, no more (the loop covers the rest).
inline unsigned int grid_size(int64_t work, int64_t per_block) {
  return static_cast<unsigned int>(geometry::grid_size(work, per_block, multiprocessors()));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// A stream being captured into a CUDA graph may not synchronize, copy to the host or allocate pinned memory.
inline bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// A quiet NaN in maths precision: what a kernel writes for a row that an out-of-range index names (the device
// check's failure is raised after the kernel has run).
template <typename T>
__device__ __forceinline__ T quiet_nan() {
  return static_cast<T>(__longlong_as_double(0x7FF8000000000000LL));
}

}  // namespace posenc::cuda

#define POSENC_CUDA_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()
