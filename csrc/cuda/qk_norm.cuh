#pragma once
// qk_norm_rope on the GPU (rope.cu's CudaRope::rotate given norms): q and k RMS-normalized group by group (a head,
// or all heads of a token), times their weights, then rotated by the token's coefficients; the backward rotates the
// gradient back and takes it through the norm. The maths is portable/rmsnorm.h's and portable/rotary.h's.
//
// A block takes one token at a time and forms its cos/sin once (all pairs, dynamic shared memory; a global
// scratch row per block past 32 KiB). Sums follow portable::lane_dot exactly, so the GPU gives the CPU's bits: a
// team of 16 threads takes one group, thread j adding channels j, j + 16, ... in order, and the 16 lanes fold as
// lane[j] += lane[j + w] for w = 8, 4, 2, 1 (__shfl_down_sync within the half-warp). Each team writes its group's
// 1 / rms (and in the backward its mean of gxhat * xhat) to shared memory; after a barrier every thread of the block
// finishes elements with them, so reductions never wait on more than 16 threads.
//
// Forward: a thread normalizes and rotates one pair (both channels read before either is written: in place is
// safe) or one channel past rotary_dim. When there are fewer tokens than the device has room for (decoding), a
// token's groups are split over gridDim.y.
//
// Backward: the weight's gradient sum_tokens sum_groups gz * xhat is summed as the CPU sums it: fixed chunks of
// tokens_per_chunk(tokens) tokens, a block per chunk walking its tokens in order, each weight channel owned by one
// thread of the block, which adds the chunk's tokens and each token's groups in order into the chunk's row of a
// [chunks, group] partial in maths precision; then fold_chunks_kernel adds each channel's chunk rows in chunk order
// in float64. No atomics: the same bits on every run and as on the CPU.
#include "cuda/geometry.h"
#include "cuda/utils.cuh"
#include "portable/rmsnorm.h"
#include "portable/rotary.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace posenc::cuda {

// Groups whose scalars (1 / rms, the backward's mean dot) a block holds at once; more groups per token are taken in
// batches of this many, in group order. The grid, the teams and each thread's elements: geometry.h.
constexpr int64_t kGroupBatch = geometry::kGroupBatch;
static_assert(geometry::kNormLanes == portable::kSumLanes, "a team's lanes are lane_dot's");

// One tensor of qk_norm_rope as the kernels take it: its rows (forward: q or k into the output; backward: the
// output's gradient into the input's), its norm (backward: the forward's input through its own strides), and in the
// backward its partial weight gradients [chunks, group].
template <typename scalar_t>
struct NormRopeView {
  RotaryView<scalar_t> rows;
  RmsNormView<scalar_t, opmath_t<scalar_t>> norm;
  opmath_t<scalar_t>* partial;
};

// portable::lane_dot's fold of the 16 lanes of a team (lane = threadIdx.x % 16), returned to every lane. Every
// thread of the warp must call it: the shuffles name the whole warp.
template <typename T>
__device__ __forceinline__ T fold_lanes(T lane_sum) {
#pragma unroll
  for (int width = portable::kSumLanes / 2; width > 0; width /= 2) {
    lane_sum += __shfl_down_sync(0xFFFFFFFFu, lane_sum, width, portable::kSumLanes);
  }
  return __shfl_sync(0xFFFFFFFFu, lane_sum, 0, portable::kSumLanes);
}

using geometry::GroupChannel;

// Channel d of a head's row after the rotation (the row read through `step`), as portable::rotate_row forms it.
template <RopeLayout kLayout, typename scalar_t, typename opmath>
__device__ __forceinline__ opmath rotated_channel(const scalar_t* row, int64_t step, int64_t d, int64_t pairs,
                                                  const opmath* cos_row, const opmath* sin_row) {
  using portable::to_opmath;
  if (d >= 2 * pairs) return to_opmath(row[d * step]);
  const auto pair_of = geometry::channel_pair(kLayout, d, pairs);
  const bool first = pair_of.first;
  const int64_t i = pair_of.pair;
  const auto [a, z] = geometry::pair_channels(kLayout, i, pairs, 1);
  const opmath x1 = to_opmath(row[a * step]);
  const opmath x2 = to_opmath(row[z * step]);
  return first ? portable::rotate_first(x1, x2, cos_row[i], sin_row[i])
               : portable::rotate_second(x1, x2, cos_row[i], sin_row[i]);
}

// portable::rms_scale for a convention known at run time (the same for every thread: no divergence), which keeps
// the kernels at one instantiation for all four.
template <typename scalar_t, typename T>
__device__ __forceinline__ T normalized(T x, T w, T r, QkNorm convention) {
  switch (convention) {
    case QkNorm::Llama: return portable::rms_scale<QkNorm::Llama, scalar_t>(x, w, r);
    case QkNorm::Gemma: return portable::rms_scale<QkNorm::Gemma, scalar_t>(x, w, r);
    case QkNorm::Olmo2: return portable::rms_scale<QkNorm::Olmo2, scalar_t>(x, w, r);
    case QkNorm::Fused: break;
  }
  return portable::rms_scale<QkNorm::Fused, scalar_t>(x, w, r);
}

// Groups [g0, g0 + count) of token (b, s) of one view, with the token's coefficients in cos_row/sin_row. Called by
// every thread of the block; ends with a barrier.
template <RopeLayout kLayout, bool kBackward, typename scalar_t>
__device__ __forceinline__ void norm_rope_groups(const NormRopeView<scalar_t>& v, int64_t b, int64_t s,
                                                 int64_t g0, int64_t count, int64_t pairs,
                                                 const opmath_t<scalar_t>* cos_row, const opmath_t<scalar_t>* sin_row,
                                                 opmath_t<scalar_t>* partial_row, bool fresh_partial,
                                                 opmath_t<scalar_t>* group_r, opmath_t<scalar_t>* group_dot) {
  using opmath = opmath_t<scalar_t>;
  using portable::from_opmath;
  using portable::to_opmath;
  const auto& rows = v.rows;
  const auto& norm = v.norm;
  const int64_t head_dim = rows.head_dim;
  const int64_t group = norm.group;
  const int64_t heads_per_group = group / head_dim;
  // The forward's rows are the normalized input; the backward's, the gradient, and its norm reads the input.
  const scalar_t* grad = rows.in + b * rows.in_stride[0] + s * rows.in_stride[1];
  const scalar_t* input = kBackward ? norm.input + b * norm.input_stride[0] + s * norm.input_stride[1] : grad;
  const int64_t* input_stride = kBackward ? norm.input_stride : rows.in_stride;
  scalar_t* out = rows.out + b * rows.out_stride[0] + s * rows.out_stride[1];
  const opmath* weight = norm.weight;

  // Each team's group: sum of x^2 over the lanes, then (backward) of gz * w * xhat.
  const auto [lane, team, teams] = geometry::norm_team(threadIdx.x, blockDim.x);
  for (int64_t base = 0; base < count; base += teams) {  // the same trip count for every team of a warp
    const int64_t gi = base + team;
    const bool active = gi < count;
    const int64_t first_head = (g0 + gi) * heads_per_group;
    opmath lane_sum = 0;
    if (active) {
      GroupChannel at(first_head, lane, head_dim);
      for (int64_t c = lane; c < group; c += portable::kSumLanes, at.advance(portable::kSumLanes, head_dim)) {
        const opmath x = to_opmath(input[at.head * input_stride[2] + at.d * input_stride[3]]);
        lane_sum += x * x;
      }
    }
    const opmath r = portable::inverse_rms(fold_lanes(lane_sum), group, norm.eps);
    if constexpr (kBackward) {
      opmath dot_sum = 0;
      if (active) {
        GroupChannel at(first_head, lane, head_dim);
        for (int64_t c = lane; c < group; c += portable::kSumLanes, at.advance(portable::kSumLanes, head_dim)) {
          const opmath xhat = to_opmath(input[at.head * input_stride[2] + at.d * input_stride[3]]) * r;
          const opmath gz = rotated_channel<kLayout>(grad + at.head * rows.in_stride[2], rows.in_stride[3], at.d,
                                                     pairs, cos_row, sin_row);
          const opmath gxhat = gz * weight[c];
          dot_sum += gxhat * xhat;
        }
      }
      const opmath dot = fold_lanes(dot_sum);
      if (active && lane == 0) group_dot[gi] = dot / static_cast<opmath>(group);
    }
    if (active && lane == 0) group_r[gi] = r;
  }
  __syncthreads();

  if constexpr (kBackward) {
    // Thread by weight channel j: the token's groups in order, added to the chunk's row that only this thread
    // touches (the CPU's order: the chunk's tokens, then each token's groups).
    for (int64_t j = threadIdx.x; j < group; j += blockDim.x) {
      const auto [head_in_group, d] = geometry::group_channel(j, head_dim);
      const opmath w = weight[j];
      // The rotation's partner channel and coefficients, the same for every group.
      const bool rotated = d < 2 * pairs;
      const auto pair_of = geometry::channel_pair(kLayout, d, pairs);
      const bool is_first = pair_of.first;
      const int64_t i = rotated ? pair_of.pair : 0;
      const int64_t partner = rotated ? pair_of.partner : d;
      const opmath cos_i = rotated ? cos_row[i] : opmath(1);
      const opmath sin_i = rotated ? sin_row[i] : opmath(0);
      const scalar_t* x_at = input + head_in_group * input_stride[2] + d * input_stride[3];
      const scalar_t* g_at = grad + head_in_group * rows.in_stride[2] + d * rows.in_stride[3];
      const int64_t partner_offset = (partner - d) * rows.in_stride[3];
      scalar_t* y_at = out + head_in_group * rows.out_stride[2] + d * rows.out_stride[3];
      opmath acc = fresh_partial ? opmath(0) : partial_row[j];
      // Not unrolled: four groups at once hold some 40 more registers (120 in all, two blocks per multiprocessor).
#pragma unroll 1
      for (int64_t gi = 0; gi < count; ++gi) {
        const int64_t h = (g0 + gi) * heads_per_group;
        const opmath r = group_r[gi];
        const opmath xhat = to_opmath(x_at[h * input_stride[2]]) * r;
        const opmath own = to_opmath(g_at[h * rows.in_stride[2]]);
        const opmath other = to_opmath(g_at[h * rows.in_stride[2] + partner_offset]);
        const opmath gz = !rotated ? own
                          : is_first ? portable::rotate_first(own, other, cos_i, sin_i)
                                     : portable::rotate_second(other, own, cos_i, sin_i);
        acc += gz * xhat;
        const opmath gxhat = gz * w;
        y_at[h * rows.out_stride[2]] = from_opmath<scalar_t>(r * (gxhat - xhat * group_dot[gi]));
      }
      partial_row[j] = acc;
    }
  } else {
    // A pair of one head (pairs per head), or one channel past rotary_dim (head_dim - 2 * pairs per head).
    const int64_t per_head = head_dim - pairs;
    const int64_t first_head = g0 * heads_per_group;
    const int64_t units = count * heads_per_group * per_head;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      const auto [hb, k, gi] = geometry::norm_unit(u, per_head, heads_per_group);
      const opmath r = group_r[gi];
      const opmath* w = weight + (hb - gi * heads_per_group) * head_dim;  // the head's weights
      const scalar_t* x = input + (first_head + hb) * input_stride[2];
      scalar_t* y = out + (first_head + hb) * rows.out_stride[2];
      const int64_t xs = input_stride[3];
      const int64_t ys = rows.out_stride[3];
      if (k < pairs) {
        const auto [a, z] = geometry::pair_channels(kLayout, k, pairs, 1);
        const opmath x1 = normalized<scalar_t>(to_opmath(x[a * xs]), w[a], r, norm.convention);
        const opmath x2 = normalized<scalar_t>(to_opmath(x[z * xs]), w[z], r, norm.convention);
        y[a * ys] = from_opmath<scalar_t>(portable::rotate_first(x1, x2, cos_row[k], sin_row[k]));
        y[z * ys] = from_opmath<scalar_t>(portable::rotate_second(x1, x2, cos_row[k], sin_row[k]));
      } else {
        const int64_t d = pairs + k;
        y[d * ys] = from_opmath<scalar_t>(normalized<scalar_t>(to_opmath(x[d * xs]), w[d], r, norm.convention));
      }
    }
  }
  __syncthreads();  // the group scalars' readers are done before the next batch writes them
}

// Token (b, s) of one view: its groups in batches (in the forward, this block's share of them: gridDim.y splits a
// token's groups; the backward runs with gridDim.y = 1). `c`: the token's chunk, `first`: whether the token is the
// chunk's first.
template <RopeLayout kLayout, bool kBackward, typename scalar_t>
__device__ __forceinline__ void norm_rope_token(const NormRopeView<scalar_t>& v, int64_t b, int64_t s, int64_t c,
                                                bool first, int64_t pairs, const opmath_t<scalar_t>* cos_row,
                                                const opmath_t<scalar_t>* sin_row, opmath_t<scalar_t>* group_r,
                                                opmath_t<scalar_t>* group_dot) {
  const int64_t groups = v.rows.heads * v.rows.head_dim / v.norm.group;
  const auto [begin, stop] = geometry::block_share(groups, gridDim.y, blockIdx.y);
  opmath_t<scalar_t>* partial_row = kBackward ? v.partial + c * v.norm.group : nullptr;
  for (int64_t g0 = begin; g0 < stop; g0 += kGroupBatch) {
    const int64_t count = geometry::piece_length(stop, g0, kGroupBatch);
    norm_rope_groups<kLayout, kBackward>(v, b, s, g0, count, pairs, cos_row, sin_row, partial_row,
                                         first && g0 == begin, group_r, group_dot);
  }
}

// One view's tokens in chunks of `chunk` (the backward's tokens_per_chunk; 1 for the forward), a block per chunk
// walking its tokens in order and forming each token's cos/sin (c1 = c2, s1 = s2: AngleCoeffs) in cos_row/sin_row;
// `scaled` (q with a query scale): each times the token's query factor, rounded after the attention scale.
template <RopeLayout kLayout, bool kBackward, typename scalar_t, typename Coeffs>
__device__ __forceinline__ void norm_rope_view(const NormRopeView<scalar_t>& v, int64_t batch, int64_t seq,
                                               int64_t pairs, int64_t chunk, const Coeffs& coeffs, bool scaled,
                                               opmath_t<scalar_t>* cos_row, opmath_t<scalar_t>* sin_row,
                                               opmath_t<scalar_t>* group_r, opmath_t<scalar_t>* group_dot) {
  using opmath = opmath_t<scalar_t>;
  const double local_max = coeffs.max_frequency();
  const int64_t tokens = batch * seq;
  const int64_t chunks = (tokens + chunk - 1) / chunk;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const auto [first, end] = geometry::chunk_tokens(c, chunk, tokens);
    for (int64_t token = first; token < end; ++token) {
      const auto [b, s] = geometry::split(token, seq);
      const auto state = coeffs.token(b, s, local_max);
      const opmath query = scaled ? coeffs.query_factor(state) : opmath(1);
      __syncthreads();  // the previous token's readers of the coefficients are done
      for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
        opmath c1;
        opmath s1;
        opmath c2;
        opmath s2;
        coeffs.fill(state, i, c1, s1, c2, s2);
        cos_row[i] = scaled ? c1 * query : c1;
        sin_row[i] = scaled ? s1 * query : s1;
      }
      __syncthreads();
      norm_rope_token<kLayout, kBackward>(v, b, s, c, token == first, pairs, cos_row, sin_row, group_r, group_dot);
    }
  }
}

// blockIdx.z takes the view (q or k); v0 is q, the view coeffs' query scale applies to, when it has one. Each view is named, not chosen at run time, so that its fields stay operands in
// the parameter space: a run-time choice between the two puts them in some 40 more registers, and the backward
// spills. coeff_scratch: null (a token's cos/sin in dynamic shared memory, 2 * pairs of them) or a global row of
// 2 * pairs per block.
template <RopeLayout kLayout, bool kBackward, typename scalar_t, typename Coeffs>
__global__ void __launch_bounds__(kThreads)
    norm_rope_kernel(const __grid_constant__ NormRopeView<scalar_t> v0,
                     const __grid_constant__ NormRopeView<scalar_t> v1, int64_t batch, int64_t seq, int64_t pairs,
                     int64_t chunk, const __grid_constant__ Coeffs coeffs, opmath_t<scalar_t>* coeff_scratch) {
  using opmath = opmath_t<scalar_t>;
  extern __shared__ __align__(16) unsigned char norm_rope_shared[];
  __shared__ opmath group_r[kGroupBatch];
  __shared__ opmath group_dot[kBackward ? kGroupBatch : 1];
  const int64_t block = (int64_t{blockIdx.z} * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  opmath* cos_row =
      coeff_scratch != nullptr ? coeff_scratch + block * 2 * pairs : reinterpret_cast<opmath*>(norm_rope_shared);
  opmath* sin_row = cos_row + pairs;
  if (blockIdx.z == 0) {
    norm_rope_view<kLayout, kBackward>(v0, batch, seq, pairs, chunk, coeffs, coeffs.scales_query(), cos_row, sin_row,
                                       group_r, group_dot);
  } else {
    norm_rope_view<kLayout, kBackward>(v1, batch, seq, pairs, chunk, coeffs, false, cos_row, sin_row, group_r,
                                       group_dot);
  }
}

// weight_grad[j] = the chunks' partial rows added in chunk order in float64, as the CPU folds them.
template <typename opmath>
__global__ void __launch_bounds__(kThreads)
    fold_chunks_kernel(const opmath* partial, int64_t chunks, int64_t group, opmath* weight_grad) {
  for (int64_t j = geometry::stride_first(blockIdx.x, blockDim.x, threadIdx.x); j < group;
       j += geometry::stride_step(gridDim.x, blockDim.x)) {
    double sum = 0;
    for (int64_t c = 0; c < chunks; ++c) sum += static_cast<double>(partial[c * group + j]);
    weight_grad[j] = static_cast<opmath>(sum);
  }
}

template <RopeLayout kLayout, bool kBackward, typename scalar_t, typename Coeffs>
void launch_norm_rope_kernel(std::vector<NormRopeView<scalar_t>> views, int64_t batch, int64_t seq, int64_t pairs,
                             const Coeffs& coeffs, const at::TensorOptions& device) {
  using opmath = opmath_t<scalar_t>;
  const auto opmath_options = device.dtype(c10::CppTypeToScalarType<opmath>::value);
  const int64_t tokens = batch * seq;
  int64_t max_groups = 1;
  for (const auto& v : views) max_groups = std::max(max_groups, v.rows.heads * v.rows.head_dim / v.norm.group);
  // Forward: a block per token, a token's groups split when the tokens leave the device idle. Backward: a block per
  // chunk (about 1024 at most), never split: one thread owns a weight channel of the chunk. Past 32 KiB of cos/sin,
  // a row per block: as many blocks as fill the device, the grid-stride loop does the rest.
  const int64_t chunk = kBackward ? portable::norm_tokens_per_chunk(tokens) : 1;
  const auto plan = geometry::norm_rope_launch(tokens, chunk, max_groups, static_cast<int64_t>(views.size()), pairs,
                                               static_cast<int64_t>(sizeof(opmath)), kBackward, multiprocessors());
  const int64_t chunks = plan.chunks;
  const bool in_shared = plan.in_shared;
  const int64_t coeff_bytes = plan.coeff_bytes;
  at::Tensor scratch;
  if (!in_shared) scratch = at::empty({plan.grid.x * plan.grid.z * 2 * pairs}, opmath_options);
  at::Tensor partial;
  if (kBackward) {
    int64_t size = 0;
    for (const auto& v : views) size += chunks * v.norm.group;
    partial = at::empty({size}, opmath_options);
    opmath* row = partial.mutable_data_ptr<opmath>();
    for (auto& v : views) {
      v.partial = row;
      row += chunks * v.norm.group;
    }
  }
  const dim3 grid(static_cast<unsigned int>(plan.grid.x), static_cast<unsigned int>(plan.grid.y),
                  static_cast<unsigned int>(plan.grid.z));
  norm_rope_kernel<kLayout, kBackward, scalar_t>
      <<<grid, kThreads, in_shared ? static_cast<size_t>(coeff_bytes) : 0, current_stream()>>>(
          views[0], views.size() > 1 ? views[1] : views[0], batch, seq, pairs, chunk, coeffs,
          in_shared ? nullptr : scratch.mutable_data_ptr<opmath>());
  POSENC_CUDA_LAUNCH_CHECK();
  if constexpr (kBackward) {
    for (const auto& v : views) {
      const auto fold_blocks =
          static_cast<unsigned int>(geometry::grid_size(v.norm.group, kThreads, multiprocessors()));
      fold_chunks_kernel<opmath><<<fold_blocks, kThreads, 0, current_stream()>>>(
          v.partial, chunks, v.norm.group, v.norm.weight_grad);
      POSENC_CUDA_LAUNCH_CHECK();
    }
  }
}

// Every view normalized and rotated (backward: its gradient), views and their norms side by side.
template <typename scalar_t, typename Coeffs>
void launch_norm_rope(const std::vector<NormRopeView<scalar_t>>& views, int64_t batch, int64_t seq, int64_t pairs,
                      RopeLayout layout, bool backward, const Coeffs& coeffs, const at::TensorOptions& device) {
  if (views.empty() || batch * seq == 0) return;
  if (layout == RopeLayout::Neox) {
    backward ? launch_norm_rope_kernel<RopeLayout::Neox, true>(views, batch, seq, pairs, coeffs, device)
             : launch_norm_rope_kernel<RopeLayout::Neox, false>(views, batch, seq, pairs, coeffs, device);
  } else {
    backward ? launch_norm_rope_kernel<RopeLayout::Gptj, true>(views, batch, seq, pairs, coeffs, device)
             : launch_norm_rope_kernel<RopeLayout::Gptj, false>(views, batch, seq, pairs, coeffs, device);
  }
}

}  // namespace posenc::cuda
