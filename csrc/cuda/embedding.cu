// embedding_backward on the GPU, under the op layer of common/embedding.h: a scatter-add of gradient rows into a
// table without float atomics, in the CPU's order, so the GPU gives the CPU's bits.
//
// The gradient rows are grouped by the table row they go to with a stable sort of their ids (ATen's sort:
// a radix sort, deterministic), so each group keeps increasing row order; searchsorted gives each table row's
// group. A thread then owns V channels of one table row and sums its group's rows into them in that order, in
// maths precision from +0, and writes the scaled sum once: the CPU kernel's sums, operation for operation.
// Rows with many gradient rows (frequent tokens) are summed by one thread per channel vector, with several
// rows' loads in flight.
#include "common/embedding.h"
#include "cuda/geometry.h"
#include "cuda/positions.cuh"
#include "cuda/utils.cuh"

#include <ATen/ops/arange.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>
#include <torch/library.h>

#include <tuple>

namespace posenc::cuda {
namespace {

template <int V, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    embedding_backward_kernel(const scalar_t* __restrict__ grad, const int64_t* __restrict__ order,
                              const int64_t* __restrict__ group_start, int64_t num_rows, int64_t width,
                              int64_t chunks, int64_t skip, opmath_t<scalar_t> scale, scalar_t* __restrict__ out) {
  using opmath = opmath_t<scalar_t>;
  using portable::from_opmath;
  using portable::to_opmath;
  constexpr int kInFlight = 4;  // gradient rows loaded before the first is added
  const int64_t tiles = num_rows * chunks;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const auto [r, d0] = geometry::tile_piece(tile, chunks, blockDim.x, threadIdx.x, V);
    if (d0 >= width) continue;
    const auto [first, last] = geometry::embedding_group(r, skip, group_start);
    opmath acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = opmath(0);
    for (int64_t g = first; g < last; g += kInFlight) {
      Vec<scalar_t, V> rows[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        if (g + j < last) rows[j] = load_vec<V>(grad + order[g + j] * width + d0);
      }
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        if (g + j >= last) break;
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += to_opmath(rows[j].v[k]);
      }
    }
    Vec<scalar_t, V> y;
#pragma unroll
    for (int k = 0; k < V; ++k) y.v[k] = from_opmath<scalar_t>(first == last ? opmath(0) : acc[k] * scale);
    store_vec<V>(out + r * width + d0, y);
  }
}

struct CudaEmbedding : CudaDevice {

  static constexpr auto check_indices = &check_device_indices_in_range;

  template <typename scalar_t>
  static void sum_rows(const at::Tensor& grad, const at::Tensor& indices, int64_t skip, double scale,
                       const at::Tensor& out) {
    using opmath = opmath_t<scalar_t>;
    const int64_t num_rows = out.size(0);
    const int64_t width = grad.size(-1);
    const int64_t num_grad_rows = grad.numel() / width;
    const auto ids = indices.view({-1});
    // The id of every gradient row (indices shared by the leading indices repeat), grouped by a stable sort.
    const auto row_ids =
        ids.numel() == num_grad_rows ? ids : ids.repeat({num_grad_rows / std::max<int64_t>(ids.numel(), 1)});
    const auto sorted = at::sort(row_ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const at::Tensor& order = std::get<1>(sorted);
    const auto group_start = at::searchsorted(std::get<0>(sorted), at::arange(num_rows + 1, row_ids.options()));
    constexpr int V = kMaxVec<scalar_t>;
    const bool vectorized = geometry::embedding_vectorizable(width, grad.const_data_ptr(), out.const_data_ptr(), V);
    const auto plan = geometry::embedding_launch(num_rows, width, vectorized, V, multiprocessors());
    const auto blocks = static_cast<unsigned int>(plan.blocks);
    const int64_t chunks = plan.chunks;
    const auto row_scale = static_cast<opmath>(scale);
    if (vectorized) {
      embedding_backward_kernel<V, scalar_t><<<blocks, kThreads, 0, current_stream()>>>(
          grad.const_data_ptr<scalar_t>(), order.const_data_ptr<int64_t>(), group_start.const_data_ptr<int64_t>(),
          num_rows, width, chunks, skip, row_scale, out.mutable_data_ptr<scalar_t>());
    } else {
      embedding_backward_kernel<1, scalar_t><<<blocks, kThreads, 0, current_stream()>>>(
          grad.const_data_ptr<scalar_t>(), order.const_data_ptr<int64_t>(), group_start.const_data_ptr<int64_t>(),
          num_rows, width, chunks, skip, row_scale, out.mutable_data_ptr<scalar_t>());
    }
    POSENC_CUDA_LAUNCH_CHECK();
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  EmbeddingOps<CudaEmbedding>::register_kernels(m);
}

}  // namespace posenc::cuda
