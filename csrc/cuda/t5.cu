// The T5 relative bias on the GPU, under the op layer of common/t5.h: the shared bucketing (portable/t5.h).
//
// T5 buckets distances with a float32 logarithm; as on the CPU, the host tabulates with t5_bucket the least
// distance of each log-spaced bucket, and the GPU buckets by counting the thresholds below a distance
// (t5_bucket_tabulated): the CPU's buckets, with no logarithm per element.
// The thresholds travel in the kernel's parameters (no copy, nothing to synchronize, safe under graph capture).
//
// The bias is constant along each diagonal j - i, as on the CPU: its Q + K - 1 diagonal values per head are
// gathered once, every output row is a slice of them; the backward sums every diagonal over its rows in row
// order, then each bucket its diagonals in diagonal order, in float64: the CPU's sums, the CPU's bits.
#include "common/t5.h"
#include "cuda/geometry.h"
#include "cuda/utils.cuh"
#include "portable/t5.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace posenc::cuda {
namespace {

using portable::T5Buckets;

// The bucketing of one call: T5's constants and the thresholds of its log-spaced buckets, held in the kernel
// parameters up to kInlineThresholds (a bidirectional num_buckets up to 1028), else in device memory.
constexpr int kInlineThresholds = 256;

struct T5Table {
  T5Buckets t5;
  int64_t count;
  const int64_t* spilled;  // device copy when count > kInlineThresholds
  int64_t inline_values[kInlineThresholds];

  __device__ int64_t bucket(int64_t relative_position) const {
    const int64_t* thresholds = count > kInlineThresholds ? spilled : inline_values;
    return portable::t5_bucket_tabulated(t5, thresholds, count, relative_position);
  }
};

// The table and, when it does not fit the parameters, the device memory that holds it.
struct T5Thresholds {
  T5Table table;
  at::Tensor storage;
};

// Thresholds past the kernel parameters, in device memory: copied once per (table, device) from pinned memory that
// is kept too, and reused, so that no call waits for the GPU and a copy captured in a CUDA graph reads a live buffer.
at::Tensor spilled_thresholds(const std::vector<int64_t>& values, const at::Device& device) {
  static std::mutex mutex;
  using Key = std::pair<std::vector<int64_t>, c10::DeviceIndex>;
  static auto* tables = new std::map<Key, std::pair<at::Tensor, at::Tensor>>();  // never freed: used until exit
  static auto* captured = new std::vector<std::pair<at::Tensor, at::Tensor>>();
  const std::lock_guard<std::mutex> lock(mutex);
  const auto copy = [&] {
    auto host = at::tensor(values, at::TensorOptions(at::kLong)).pin_memory();
    auto on_device = host.to(device, /*non_blocking=*/true);
    return std::make_pair(host, on_device);
  };
  const auto found = tables->find({values, device.index()});
  if (found != tables->end()) return found->second.second;
  if (capturing()) {  // a captured copy runs at replays only: kept for the graph, not cached for eager calls
    return captured->emplace_back(copy()).second;
  }
  return tables->emplace(Key{values, device.index()}, copy()).first->second.second;
}

T5Thresholds tabulate(bool bidirectional, int64_t num_buckets, int64_t max_distance, const at::Device& device) {
  T5Thresholds out{};
  out.table.t5 = portable::make_t5_buckets(bidirectional, num_buckets, max_distance);
  const auto values = portable::t5_log_thresholds(out.table.t5);
  out.table.count = static_cast<int64_t>(values.size());
  if (out.table.count <= kInlineThresholds) {
    std::copy(values.begin(), values.end(), out.table.inline_values);
  } else {
    out.storage = spilled_thresholds(values, device);
    out.table.spilled = out.storage.const_data_ptr<int64_t>();
  }
  return out;
}

template <typename index_t>
__global__ void relative_bucket_kernel(const __grid_constant__ T5Table table, const index_t* relative_position,
                                       int64_t numel, int64_t* out) {
  for (int64_t n = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); n < numel;
       n += geometry::stride_step(gridDim.x, blockDim.x)) {
    out[n] = table.bucket(static_cast<int64_t>(relative_position[n]));
  }
}

// Bucket of diagonal r = j - i + (q_len - 1), whose relative position is first + r, first = -(q_len - 1) - q_offset.
__global__ void diagonal_buckets_kernel(const __grid_constant__ T5Table table, int64_t diagonals, int64_t first,
                                        int64_t* buckets) {
  for (int64_t r = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); r < diagonals;
       r += geometry::stride_step(gridDim.x, blockDim.x)) {
    buckets[r] = table.bucket(first + r);
  }
}

// diag[h, r] = weight[bucket[r], h] (weight any strides).
template <typename scalar_t>
__global__ void diagonal_values_kernel(const scalar_t* weight, int64_t stride_bucket, int64_t stride_head,
                                       int64_t heads, const int64_t* buckets, int64_t diagonals, scalar_t* diag) {
  const int64_t total = heads * diagonals;
  for (int64_t e = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); e < total;
       e += geometry::stride_step(gridDim.x, blockDim.x)) {
    const auto [h, r] = geometry::split(e, diagonals);
    diag[e] = weight[buckets[r] * stride_bucket + h * stride_head];
  }
}

// out[h, i, j0 .. j0 + V) = diag[h, q_len - 1 - i + j0 ..]: the slices are read element by element (they start
// anywhere), the output row is written in vectors.
template <int V, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    bias_rows_kernel(const scalar_t* __restrict__ diag, int64_t diagonals, int64_t heads, int64_t q_len,
                     int64_t k_len, int64_t chunks, scalar_t* __restrict__ out) {
  const int64_t work = heads * q_len * chunks;
  for (int64_t w = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); w < work;
       w += geometry::stride_step(gridDim.x, blockDim.x)) {
    const auto [n, j0] = geometry::row_piece(w, chunks, V);  // row h * q_len + i
    const auto [h, i] = geometry::split(n, q_len);
    const scalar_t* src = diag + h * diagonals + geometry::row_first_diagonal(i, q_len) + j0;
    Vec<scalar_t, V> y;
#pragma unroll
    for (int k = 0; k < V; ++k) y.v[k] = src[k];
    store_vec<V>(out + n * k_len + j0, y);
  }
}

// sums[h, r] = sum over the rows i of diagonal r, in increasing i, of grad[h, i, r - (q_len - 1 - i)], in
// float64 from 0. Neighbouring threads take neighbouring diagonals: each step reads neighbouring keys of a row.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    diagonal_sums_kernel(const scalar_t* __restrict__ grad, int64_t heads, int64_t q_len, int64_t k_len,
                         int64_t diagonals, double* __restrict__ sums) {
  const int64_t total = heads * diagonals;
  for (int64_t e = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); e < total;
       e += geometry::stride_step(gridDim.x, blockDim.x)) {
    const auto [h, r] = geometry::split(e, diagonals);
    const auto rows = geometry::diagonal_rows(r, q_len, k_len);
    const scalar_t* head = grad + h * q_len * k_len;
    double sum = 0.0;
    for (int64_t i = rows.begin; i < rows.end; ++i) {
      sum += static_cast<double>(portable::to_opmath(head[i * k_len + geometry::diagonal_key(r, i, q_len)]));
    }
    sums[e] = sum;
  }
}

// grad_weight[h, b] = the sums of the diagonals of bucket b, in increasing diagonal order, from 0.
__global__ void bucket_sums_kernel(const double* sums, const int64_t* buckets, int64_t heads, int64_t diagonals,
                                   int64_t num_buckets, double* grad_weight) {
  const int64_t total = heads * num_buckets;
  for (int64_t e = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); e < total;
       e += geometry::stride_step(gridDim.x, blockDim.x)) {
    const auto [h, b] = geometry::split(e, num_buckets);
    double sum = 0.0;
    for (int64_t r = 0; r < diagonals; ++r) {
      if (buckets[r] == b) sum += sums[h * diagonals + r];
    }
    grad_weight[e] = sum;
  }
}

at::Tensor diagonal_buckets(const T5Table& table, int64_t q_len, int64_t k_len, int64_t q_offset,
                            const at::TensorOptions& options) {
  const int64_t diagonals = q_len + k_len - 1;
  auto buckets = at::empty({diagonals}, options.dtype(at::kLong));
  diagonal_buckets_kernel<<<grid_size(diagonals, kThreads), kThreads, 0, current_stream()>>>(
      table, diagonals, -(q_len - 1) - q_offset, buckets.mutable_data_ptr<int64_t>());
  POSENC_CUDA_LAUNCH_CHECK();
  return buckets;
}

struct CudaT5 : CudaDevice {

  template <typename index_t>
  static void bucket(const at::Tensor& input, const at::Tensor& out, bool bidirectional, int64_t num_buckets,
                     int64_t max_distance) {
    const auto thresholds = tabulate(bidirectional, num_buckets, max_distance, input.device());
    relative_bucket_kernel<index_t><<<grid_size(input.numel(), kThreads), kThreads, 0, current_stream()>>>(
        thresholds.table, input.const_data_ptr<index_t>(), input.numel(), out.mutable_data_ptr<int64_t>());
    POSENC_CUDA_LAUNCH_CHECK();
  }

  template <typename scalar_t>
  static void bias(const at::Tensor& weight, const at::Tensor& out, bool bidirectional, int64_t num_buckets,
                   int64_t max_distance, int64_t q_offset) {
    const int64_t q_len = out.size(2);
    const int64_t k_len = out.size(3);
    const auto thresholds = tabulate(bidirectional, num_buckets, max_distance, weight.device());
    const auto buckets = diagonal_buckets(thresholds.table, q_len, k_len, q_offset, weight.options());
    const int64_t heads = weight.size(1);
    const int64_t diagonals = q_len + k_len - 1;
    auto diag = at::empty({heads, diagonals}, weight.options());
    diagonal_values_kernel<<<grid_size(heads * diagonals, kThreads), kThreads, 0, current_stream()>>>(
        weight.const_data_ptr<scalar_t>(), weight.stride(0), weight.stride(1), heads,
        buckets.const_data_ptr<int64_t>(), diagonals, diag.mutable_data_ptr<scalar_t>());
    POSENC_CUDA_LAUNCH_CHECK();
    constexpr int V = kMaxVec<scalar_t>;
    const bool vectorized = geometry::bias_rows_vectorizable(k_len, out.const_data_ptr(), V);
    const auto plan = geometry::rows_launch(heads * q_len, k_len, vectorized, V, multiprocessors());
    const auto blocks = static_cast<unsigned int>(plan.blocks);
    const int64_t chunks = plan.chunks;
    if (vectorized) {
      bias_rows_kernel<V, scalar_t><<<blocks, kThreads, 0, current_stream()>>>(
          diag.const_data_ptr<scalar_t>(), diagonals, heads, q_len, k_len, chunks, out.mutable_data_ptr<scalar_t>());
    } else {
      bias_rows_kernel<1, scalar_t><<<blocks, kThreads, 0, current_stream()>>>(
          diag.const_data_ptr<scalar_t>(), diagonals, heads, q_len, k_len, chunks, out.mutable_data_ptr<scalar_t>());
    }
    POSENC_CUDA_LAUNCH_CHECK();
  }

  template <typename scalar_t>
  static void bias_grad(const at::Tensor& grad, const at::Tensor& acc, bool bidirectional, int64_t num_buckets,
                        int64_t max_distance, int64_t q_offset) {
    const int64_t heads = grad.size(1);
    const int64_t q_len = grad.size(2);
    const int64_t k_len = grad.size(3);
    const int64_t diagonals = q_len + k_len - 1;
    const auto thresholds = tabulate(bidirectional, num_buckets, max_distance, grad.device());
    const auto buckets = diagonal_buckets(thresholds.table, q_len, k_len, q_offset, grad.options());
    auto sums = at::empty({heads, diagonals}, grad.options().dtype(at::kDouble));
    diagonal_sums_kernel<<<grid_size(heads * diagonals, kThreads), kThreads, 0, current_stream()>>>(
        grad.const_data_ptr<scalar_t>(), heads, q_len, k_len, diagonals, sums.mutable_data_ptr<double>());
    POSENC_CUDA_LAUNCH_CHECK();
    bucket_sums_kernel<<<grid_size(heads * num_buckets, kThreads), kThreads, 0, current_stream()>>>(
        sums.const_data_ptr<double>(), buckets.const_data_ptr<int64_t>(), heads, diagonals, num_buckets,
        acc.mutable_data_ptr<double>());
    POSENC_CUDA_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  T5Ops<CudaT5>::register_kernels(m);
}

}  // namespace posenc::cuda
