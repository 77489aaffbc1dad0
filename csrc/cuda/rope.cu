// CUDA ops of the rotary family: the CPU op layer's checks and outputs, the shared per-element maths
// (portable/angle.h, portable/rotary.h), one kernel for every op.
//
// A block rotates one token: it forms the token's coefficients once in shared memory (cos and sin of each pair,
// from the angle engine or from rope_cos_sin's tables), then its threads rotate every head of x (or of q and
// k) with them. A thread's unit of work is V pairs of one head: V = 16 bytes / element size where every row
// is contiguous and 16-byte aligned (one load and one store per half for neox, two adjacent vectors for gptj),
// else V = 1 with the strides as they are. When there are fewer tokens than the device has room for (decoding),
// a token's heads are split over several blocks (gridDim.y), each forming the coefficients itself.
//
// Multi-axis rotary (pair_axis): the positions [n_axes, ...] are checked and offset as one-axis positions are
// (cuda/positions.cuh), then reordered token by token, so that a block finds its token's n_axes positions side
// by side, as the CPU's angle engine does; pair_axis is checked on the device, as the CPU checks it.
//
// qk_norm_rope (a Rotation with norms) takes the same positions and coefficients (AngleCoeffs) into kernels of its
// own (cuda/qk_norm.cuh): a group's sum of squares must be complete before any of its channels is rotated.
#include "common/kv_cache.h"
#include "common/positions.h"
#include "common/qk_norm.h"
#include "common/rope.h"
#include "cuda/angle.cuh"
#include "cuda/checks.cuh"
#include "cuda/geometry.h"
#include "cuda/positions.cuh"
#include "cuda/qk_norm.cuh"
#include "cuda/utils.cuh"
#include "portable/rotary.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>
#include <vector>

namespace posenc::cuda {
namespace {

using portable::from_opmath;
using portable::rotate_first;
using portable::rotate_second;
using portable::to_opmath;

// Pairs whose coefficients a block holds at once (a multiple of every vector width): 4 KiB of float32.
constexpr int64_t kChunkPairs = geometry::kChunkPairs;

// Coefficients from the angle engine, as the CPU forms them: c = a cos(p w_i), s = +-a sin(p w_i) with the
// attention scale a rounded to the maths type first. For float32 maths a token's angles take the fast
// reduction when |p| * max_i |w_i| <= kFastAngle (for each of its positions), else float64 sin/cos: the CPU's
// choice, made per token. Multi-axis (pair_axis not null): a token has n_axes positions side by side, and pair
// i's angle is the shared pair_angle, the position of axis pair_axis[i] times w_i. q_scale (beta != 0, one axis):
// the first view's (q's) coefficients each times (opmath) portable::query_scale at the token's position, rounded
// after the attention scale, as the CPU's Coefficients rounds them.
template <typename opmath>
struct AngleCoeffs {
  const double* positions;  // per token (shared: per sequence index), n_axes each; null: offset + s
  int64_t offset;
  bool shared;
  int64_t seq;
  int64_t n_axes;            // 1 without pair_axis
  const int32_t* pair_axis;  // [pairs], or null: every pair follows the token's one position
  const double* inv_freq;
  int64_t pairs;
  opmath scale;
  opmath sin_scale;
  QScale q_scale;  // of views[0], q (beta 0: none; the host passes none when q is empty and views[0] is k)

  struct Token {
    double position;          // one axis
    const double* positions;  // multi-axis: the token's n_axes positions
    bool slow;
  };

  __device__ double max_frequency() const { return posenc::cuda::max_frequency(inv_freq, pairs); }

  static constexpr bool kScalable = true;
  __host__ __device__ bool scales_query() const { return q_scale.beta != 0.0; }

  // The factor of q's coefficients at a token (one axis: the op layer refuses q_scale with pair_axis).
  __device__ opmath query_factor(const Token& t) const {
    return static_cast<opmath>(portable::query_scale(t.position, q_scale));
  }

  // Called by every thread of the block.
  __device__ Token token(int64_t b, int64_t s, double local_max) const {
    if (pair_axis != nullptr) {
      const double* p = positions + (shared ? s : b * seq + s) * n_axes;
      return {0.0, p, slow_angles<opmath>(p, n_axes, local_max)};
    }
    const double p = positions == nullptr ? static_cast<double>(offset + s) : positions[shared ? s : b * seq + s];
    return {p, nullptr, slow_angles<opmath>(p, local_max)};
  }

  // pair_axis is checked on the device, and the failure raised later (cuda/checks.cuh): meanwhile an axis
  // outside [0, n_axes) gives a NaN angle rather than a read past the token's positions.
  __device__ double angle(const Token& t, int64_t i) const {
    if (pair_axis == nullptr) return t.position * inv_freq[i];
    const int32_t axis = pair_axis[i];
    if (axis < 0 || axis >= n_axes) return quiet_nan<double>();
    return portable::pair_angle(t.positions, pair_axis, inv_freq, i);
  }

  __device__ void fill(const Token& t, int64_t i, opmath& c1, opmath& s1, opmath& c2, opmath& s2) const {
    opmath sin_value;
    opmath cos_value;
    angle_sincos(angle(t, i), t.slow, sin_value, cos_value);
    c1 = c2 = cos_value * scale;
    s1 = s2 = sin_value * sin_scale;
  }
};

// Coefficients gathered from explicit tables [rows, rotary_dim] (rope_cos_sin), channel by channel; the
// backward is the transpose: (c1, -s2, c2, -s1).
template <typename opmath>
struct TableCoeffs {
  const opmath* cos;
  const opmath* sin;
  bool shared;
  int64_t seq;
  int64_t rotary_dim;
  int64_t first;   // channel of pair i = first * i
  int64_t second;  // its partner, `second` channels on
  bool transpose;

  struct Token {
    int64_t row;
  };

  __device__ double max_frequency() const { return 0.0; }

  static constexpr bool kScalable = false;
  __host__ __device__ bool scales_query() const { return false; }

  __device__ opmath query_factor(const Token&) const { return opmath(1); }

  __device__ Token token(int64_t b, int64_t s, double) const { return {(shared ? s : b * seq + s) * rotary_dim}; }

  __device__ void fill(const Token& t, int64_t i, opmath& c1, opmath& s1, opmath& c2, opmath& s2) const {
    const int64_t a = t.row + first * i;
    const int64_t z = a + second;
    c1 = cos[a];
    c2 = cos[z];
    s1 = transpose ? -sin[z] : sin[a];
    s2 = transpose ? -sin[a] : sin[z];
  }
};

// The V pairs [pair, pair + V) of one head's row; `local` is the first one's index in the shared coefficients.
template <RopeLayout kLayout, int V, typename scalar_t, typename opmath>
__device__ __forceinline__ void rotate_unit(const scalar_t* in, int64_t in_step, scalar_t* out, int64_t out_step,
                                            int64_t pair, int64_t pairs, const opmath* c1, const opmath* s1,
                                            const opmath* c2, const opmath* s2) {
  // The pairs' channels (geometry.h): V from lo and V from hi (V = 1: one each, through the steps).
  const auto [lo, hi] = geometry::pair_channels(kLayout, pair, pairs, V);
  if constexpr (V == 1) {
    const opmath x1 = to_opmath(in[lo * in_step]);
    const opmath x2 = to_opmath(in[hi * in_step]);
    out[lo * out_step] = from_opmath<scalar_t>(rotate_first(x1, x2, c1[0], s1[0]));
    out[hi * out_step] = from_opmath<scalar_t>(rotate_second(x1, x2, c2[0], s2[0]));
  } else if constexpr (kLayout == RopeLayout::Neox) {
    const auto x1 = load_vec<V>(in + lo);
    const auto x2 = load_vec<V>(in + hi);
    Vec<scalar_t, V> y1;
    Vec<scalar_t, V> y2;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const opmath a = to_opmath(x1.v[k]);
      const opmath b = to_opmath(x2.v[k]);
      y1.v[k] = from_opmath<scalar_t>(rotate_first(a, b, c1[k], s1[k]));
      y2.v[k] = from_opmath<scalar_t>(rotate_second(a, b, c2[k], s2[k]));
    }
    store_vec<V>(out + lo, y1);
    store_vec<V>(out + hi, y2);
  } else {  // gptj: 2V channels from channel 2 * pair, as two vectors of V / 2 pairs each
    Vec<scalar_t, V> x[2] = {load_vec<V>(in + lo), load_vec<V>(in + hi)};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int k = 0; k < V / 2; ++k) {
        const int j = half * (V / 2) + k;
        const opmath a = to_opmath(x[half].v[2 * k]);
        const opmath b = to_opmath(x[half].v[2 * k + 1]);
        x[half].v[2 * k] = from_opmath<scalar_t>(rotate_first(a, b, c1[j], s1[j]));
        x[half].v[2 * k + 1] = from_opmath<scalar_t>(rotate_second(a, b, c2[j], s2[j]));
      }
    }
    store_vec<V>(out + lo, x[0]);
    store_vec<V>(out + hi, x[1]);
  }
}

// Channels [channel, channel + V) copied (the channels past rotary_dim of a functional output).
template <int V, typename scalar_t>
__device__ __forceinline__ void copy_unit(const scalar_t* in, int64_t in_step, scalar_t* out, int64_t out_step,
                                          int64_t channel) {
  if constexpr (V == 1) {
    out[channel * out_step] = in[channel * in_step];
  } else {
    store_vec<V>(out + channel, load_vec<V>(in + channel));
  }
}

// One or two views (x; or q and k), rotated token by token. Every thread of a block runs the same token loop:
// the coefficient fills are separated by barriers. With a query scale (coeffs.scales_query()) a chunk holds half
// the pairs: each row's second half is the first's times the token's query factor, v0's (q's) coefficients. The views are read in place from the parameter space
// (__grid_constant__), so choosing one by a run-time condition makes no local copy.
// kCache (rope_qk_cache_): v1's token (k's) is stored at its cache slot (portable::output_index, found once per token;
// none out of range), and `copy` (v, when has_copy) is copied into its cache with the channels past rotary_dim; v0
// (q) is stored in place. A compile-time choice, so that the other rotary ops run the kernel without its registers.
template <RopeLayout kLayout, int V, bool kScaled, bool kCache, typename scalar_t, typename Coeffs>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(const __grid_constant__ RotaryView<scalar_t> v0, const __grid_constant__ RotaryView<scalar_t> v1,
                  int num_views, const __grid_constant__ RotaryView<scalar_t> copy, bool has_copy, int64_t batch,
                  int64_t seq, int64_t pairs, const __grid_constant__ Coeffs coeffs) {
  using opmath = opmath_t<scalar_t>;
  __shared__ alignas(32) opmath shared[4][kChunkPairs];
  const double local_max = coeffs.max_frequency();
  const int64_t tokens = batch * seq;
  // A token's units over the threads of its gridDim.y blocks (geometry.h).
  const int64_t stride = geometry::stride_step(gridDim.y, blockDim.x);
  // kScaled: chosen on the host, so that a call without a query scale runs the kernel without its registers.
  constexpr bool scaled = kScaled;
  constexpr int64_t chunk_pairs = scaled ? kChunkPairs / 2 : kChunkPairs;
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    const auto [b, s] = geometry::split(token, seq);
    const auto state = coeffs.token(b, s, local_max);
    opmath query = opmath(1);
    if constexpr (scaled) query = coeffs.query_factor(state);
    const int64_t s1 = kCache ? portable::output_index(v1, b, s) : s;
    for (int64_t first_pair = 0; first_pair < pairs; first_pair += chunk_pairs) {
      const int64_t n = geometry::piece_length(pairs, first_pair, chunk_pairs);
      __syncthreads();  // the previous chunk's readers are done
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        coeffs.fill(state, first_pair + i, shared[0][i], shared[1][i], shared[2][i], shared[3][i]);
        if constexpr (scaled) {
#pragma unroll
          for (int r = 0; r < 4; ++r) shared[r][chunk_pairs + i] = shared[r][i] * query;
        }
      }
      __syncthreads();
      const int64_t per_head = n / V;
      const int64_t units0 = v0.heads * per_head;
      const int64_t units = units0 + (num_views > 1 ? v1.heads * per_head : 0);
      for (int64_t u = geometry::stride_first(blockIdx.y, blockDim.x, threadIdx.x); u < units; u += stride) {
        const auto [second, h, local] = geometry::rotary_unit(u, units0, per_head, V);
        const int64_t row = local + (scaled && !second ? chunk_pairs : 0);
        const auto& v = second ? v1 : v0;
        const int64_t out_s = second ? s1 : s;
        if (kCache && out_s < 0) continue;
        rotate_unit<kLayout, V>(v.in + b * v.in_stride[0] + s * v.in_stride[1] + h * v.in_stride[2], v.in_stride[3],
                                v.out + b * v.out_stride[0] + out_s * v.out_stride[1] + h * v.out_stride[2],
                                v.out_stride[3], first_pair + local, pairs, shared[0] + row, shared[1] + row,
                                shared[2] + row, shared[3] + row);
      }
    }
    // The channels past rotary_dim of a view not rotated in place (in place, they are already there), then v's.
    if (!kCache && v0.in == v0.out) continue;
    const int64_t rest0 = v0.in == v0.out ? 0 : geometry::copied_units(v0.head_dim, 2 * pairs, V);
    const int64_t rest1 = num_views > 1 && v1.in != v1.out ? geometry::copied_units(v1.head_dim, 2 * pairs, V) : 0;
    const int64_t rest2 = kCache && has_copy ? geometry::copied_units(copy.head_dim, 0, V) : 0;
    const int64_t s2 = kCache && has_copy ? portable::output_index(copy, b, s) : s;
    const int64_t units0 = v0.heads * rest0;
    const int64_t units1 = units0 + (num_views > 1 ? v1.heads * rest1 : 0);
    const int64_t units = units1 + copy.heads * rest2;
    for (int64_t u = geometry::stride_first(blockIdx.y, blockDim.x, threadIdx.x); u < units; u += stride) {
      const auto [which, h, channel] = geometry::rotary_copy_unit(u, units0, units1, rest0, rest1, rest2, pairs, V);
      const auto& v = which == 0 ? v0 : which == 1 ? v1 : copy;
      const int64_t out_s = which == 0 ? s : which == 1 ? s1 : s2;
      if (kCache && out_s < 0) continue;
      copy_unit<V>(v.in + b * v.in_stride[0] + s * v.in_stride[1] + h * v.in_stride[2], v.in_stride[3],
                   v.out + b * v.out_stride[0] + out_s * v.out_stride[1] + h * v.out_stride[2], v.out_stride[3],
                   channel);
    }
  }
}

// V = 16 bytes / element size where every row of every view is contiguous and 16-byte aligned and both the
// rotated and the copied channels split into whole vectors; else 1.
template <typename scalar_t>
int vector_width(const std::vector<RotaryView<scalar_t>>& views, int64_t pairs) {
  constexpr int V = kMaxVec<scalar_t>;
  if (pairs % V != 0) return 1;
  for (const auto& v : views) {
    if (!geometry::rotary_vectorizable(v.head_dim, v.in, v.in_stride, v.out, v.out_stride, V)) return 1;
  }
  return V;
}

template <RopeLayout kLayout, int V, typename scalar_t, typename Coeffs>
void launch_layout(const std::vector<RotaryView<scalar_t>>& views, const RotaryView<scalar_t>* copy, int64_t batch,
                   int64_t seq, int64_t pairs, const Coeffs& coeffs) {
  const int64_t tokens = batch * seq;
  // A token's units in its largest chunk, then the grid (geometry.h).
  int64_t units = copy != nullptr ? geometry::rotary_copy_token_units(copy->heads, copy->head_dim, V) : 0;
  for (const auto& v : views) units += geometry::rotary_token_units(v.heads, v.head_dim, pairs, V);
  const auto plan = geometry::rotary_grid(tokens, units, multiprocessors());
  const dim3 grid(static_cast<unsigned int>(plan.x), static_cast<unsigned int>(plan.y));
  const auto& v1 = views.size() > 1 ? views[1] : views[0];
  const int n_views = static_cast<int>(views.size());
  const auto& copied = copy != nullptr ? *copy : views[0];
  const auto launch = [&](auto scaled, auto cache) {
    rotary_kernel<kLayout, V, decltype(scaled)::value, decltype(cache)::value, scalar_t>
        <<<grid, kThreads, 0, current_stream()>>>(views[0], v1, n_views, copied, copy != nullptr, batch, seq, pairs,
                                                  coeffs);
  };
  // The query scale and the cache slots come from the angle engine's ops only (rope_qk, rope_qk_cache_).
  if constexpr (Coeffs::kScalable) {
    TORCH_INTERNAL_ASSERT(views[0].slots == nullptr, "posenc: the kernel stores its first view in place");
    const bool slots = copy != nullptr || (views.size() > 1 && views[1].slots != nullptr);
    if (coeffs.scales_query()) {
      slots ? launch(std::true_type(), std::true_type()) : launch(std::true_type(), std::false_type());
    } else {
      slots ? launch(std::false_type(), std::true_type()) : launch(std::false_type(), std::false_type());
    }
  } else {
    launch(std::false_type(), std::false_type());
  }
  POSENC_CUDA_LAUNCH_CHECK();
}

template <typename scalar_t, typename Coeffs>
void launch_rotary(const std::vector<RotaryView<scalar_t>>& views, int64_t batch, int64_t seq, int64_t pairs,
                   RopeLayout layout, const Coeffs& coeffs, const RotaryView<scalar_t>* copy = nullptr) {
  if (views.empty() || batch * seq == 0) return;
  constexpr int V = kMaxVec<scalar_t>;
  auto all = views;
  if (copy != nullptr) all.push_back(*copy);
  const bool vectorized = vector_width(all, pairs) == V;
  if (layout == RopeLayout::Neox) {
    vectorized ? launch_layout<RopeLayout::Neox, V>(views, copy, batch, seq, pairs, coeffs)
               : launch_layout<RopeLayout::Neox, 1>(views, copy, batch, seq, pairs, coeffs);
  } else {
    vectorized ? launch_layout<RopeLayout::Gptj, V>(views, copy, batch, seq, pairs, coeffs)
               : launch_layout<RopeLayout::Gptj, 1>(views, copy, batch, seq, pairs, coeffs);
  }
}

// A norm as the kernels read it (cpu/rope.cpp's norm_view): the backward's input through its own strides.
template <typename scalar_t, typename opmath = opmath_t<scalar_t>>
NormRopeView<scalar_t> norm_rope_view(const at::Tensor& in, const at::Tensor& out, const RotationNorm& norm,
                                      RopeFormat format) {
  NormRopeView<scalar_t> view{rotary_view<scalar_t>(in, out, format),
                              {norm.weight.const_data_ptr<opmath>(), norm.group, static_cast<opmath>(norm.eps),
                               norm.convention, nullptr, {}, nullptr},
                              nullptr};
  if (norm.input.defined()) {
    const auto order = rope_dim_order(format);
    view.norm.input = norm.input.const_data_ptr<scalar_t>();
    for (int i = 0; i < 4; ++i) view.norm.input_stride[i] = order[i] < 0 ? 0 : norm.input.stride(order[i]);
    view.norm.weight_grad = norm.weight_grad.mutable_data_ptr<opmath>();
  }
  return view;
}

// Each cache row's first token at each slot: first[row * S_max + slot] is the smallest token n of the row stored
// there (tokens at a slot out of range are the range check's failure, skipped here). A row holds per_row tokens; a
// token's slot is slots[n % seq] when shared by the batch rows.
__global__ void first_token_kernel(const int64_t* slots, int64_t tokens, int64_t seq, bool shared, int64_t per_row,
                                   int64_t cache_seq, unsigned long long* first) {
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < tokens; n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t slot = slots[shared ? n % seq : n];
    if (slot >= 0 && slot < cache_seq) atomicMin(&first[n / per_row * cache_seq + slot], static_cast<unsigned long long>(n));
  }
}

// A token that is not the first at its slot repeats it: the smallest such row * S_max + slot is the CPU's first
// repeat (rows in order, then slots in order); `second` gets the smallest other token there.
__global__ void repeated_slot_kernel(const int64_t* slots, int64_t tokens, int64_t seq, bool shared, int64_t per_row,
                                     int64_t cache_seq, const unsigned long long* first, unsigned long long* first_bad) {
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < tokens; n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t slot = slots[shared ? n % seq : n];
    const int64_t key = n / per_row * cache_seq + slot;
    if (slot >= 0 && slot < cache_seq && first[key] != static_cast<unsigned long long>(n)) {
      atomicMin(first_bad, static_cast<unsigned long long>(key));
    }
  }
}

__global__ void second_token_kernel(const int64_t* slots, int64_t tokens, int64_t seq, bool shared, int64_t per_row,
                                    int64_t cache_seq, const unsigned long long* first, const unsigned long long* repeat,
                                    unsigned long long* second) {
  const unsigned long long key = *repeat;
  if (key == kNoFailure) return;
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < tokens; n += int64_t{gridDim.x} * blockDim.x) {
    const int64_t slot = slots[shared ? n % seq : n];
    if (slot >= 0 && slot < cache_seq && static_cast<unsigned long long>(n / per_row * cache_seq + slot) == key &&
        first[key] != static_cast<unsigned long long>(n)) {
      atomicMin(second, static_cast<unsigned long long>(n));
    }
  }
}

struct RepeatedSlotAt {
  const unsigned long long* first;
  const unsigned long long* second;
  __device__ FailureValues operator()(int64_t key) const {
    return {static_cast<int64_t>(first[key]), static_cast<int64_t>(*second)};
  }
};

// No two tokens of one cache row (a batch row, or every token for a pool) at one slot: read_cache_slots' check on
// the device, with a word per slot of each row (rows * S_max).
void check_repeated_slots(const Rotation& r, const at::Tensor& slots, bool shared, int64_t cache_seq) {
  const bool pooled = r.cache->format == RopeFormat::THD;
  const int64_t rows = pooled || shared ? 1 : r.batch;
  const int64_t per_row = pooled ? r.batch * r.seq : r.seq;
  if (per_row <= 1) return;
  const int64_t tokens = rows * per_row;
  auto words = at::empty({rows * cache_seq + 1}, slots.options());
  C10_CUDA_CHECK(cudaMemsetAsync(words.mutable_data_ptr<int64_t>(), 0xFF, words.nbytes(), current_stream()));
  auto* first = reinterpret_cast<unsigned long long*>(words.mutable_data_ptr<int64_t>());
  auto* second = first + rows * cache_seq;
  const DeviceCheck check(slots);
  const auto blocks = grid_size(tokens, kThreads);
  const auto* s = slots.const_data_ptr<int64_t>();
  first_token_kernel<<<blocks, kThreads, 0, current_stream()>>>(s, tokens, r.seq, shared, per_row, cache_seq, first);
  POSENC_CUDA_LAUNCH_CHECK();
  repeated_slot_kernel<<<blocks, kThreads, 0, current_stream()>>>(s, tokens, r.seq, shared, per_row, cache_seq, first,
                                                                   check.word());
  POSENC_CUDA_LAUNCH_CHECK();
  second_token_kernel<<<blocks, kThreads, 0, current_stream()>>>(s, tokens, r.seq, shared, per_row, cache_seq, first,
                                                                  check.word(), second);
  POSENC_CUDA_LAUNCH_CHECK();
  check.report(RepeatedSlotAt{first, second}, [op = std::string(r.op), cache_seq, pooled](const CheckFailure& f) {
    repeated_slot_error(op.c_str(), f.value, f.other, f.index % cache_seq, pooled);
  });
}

// rope_qk_cache_'s slots on the device, [seq] shared by the batch rows or [batch * seq], with whether they are shared,
// checked on the device as read_cache_slots checks them on the CPU. The kernel stores no token whose slot is out of
// range, so an unreported failure writes nothing outside the caches.
std::pair<at::Tensor, bool> device_slots(const Rotation& r) {
  const auto& cache_positions = r.cache->cache_positions;
  const int64_t cache_seq = rope_sizes(r.outputs[1], r.cache->format)[1].expect_int();
  const auto domain = slot_domain(cache_seq);
  at::Tensor slots;
  bool shared = r.args.shared_positions;
  if (cache_positions) {
    shared = cache_positions->dim() == 1;
    slots = checked_indices(*cache_positions, 0, 0, cache_seq - 1, at::kLong,
                            [op = std::string(r.op), cache_seq](int64_t n, int64_t value) {
                              cache_position_error(op.c_str(), n, value, cache_seq);
                            });
  } else if (r.positions) {
    slots = table_rows(r.op, r.positions, 0, r.offset, domain);
  } else if (r.cu_seqlens) {
    slots = packed_positions(r.op, *r.cu_seqlens, r.seq, r.offset, domain, at::kLong);
  } else {
    check_arange<int64_t>(r.op, r.seq, r.seq, r.offset, domain);
    slots = at::arange(r.offset, r.offset + r.seq, r.inputs[0].options().dtype(at::kLong));
  }
  check_repeated_slots(r, slots, shared, cache_seq);
  return {slots, shared};
}

struct CudaRope : CudaDevice {

  static void rotate(const Rotation& r) {
    const auto [pos, n_axes, axes] =
        axis_positions(r.op, r.positions, r.seq, r.offset, rotary_domain(), r.pair_axis, r.cu_seqlens);
    const auto [slots, shared_slots] = r.cache != nullptr ? device_slots(r) : std::pair<at::Tensor, bool>();
    bool empty = true;
    for (const auto& t : r.inputs) empty = empty && t.numel() == 0;
    if (empty) return;
    const auto freq = r.inv_freq.to(at::kDouble).contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.inputs[0].scalar_type(), "posenc_rope_cuda", [&] {
      using opmath = opmath_t<scalar_t>;
      std::vector<RotaryView<scalar_t>> views;
      std::vector<NormRopeView<scalar_t>> norm_views;
      for (size_t i = 0; i < r.inputs.size(); ++i) {
        // An empty q stays the first view of a cache write: the kernel stores that one in place.
        if (r.inputs[i].numel() == 0 && r.cache == nullptr) continue;
        if (r.norms != nullptr) {
          norm_views.push_back(norm_rope_view<scalar_t>(r.inputs[i], r.outputs[i], (*r.norms)[i], r.args.format));
        } else if (r.cache != nullptr && i == 1) {
          views.push_back(cache_view<scalar_t>(r, r.inputs[i], r.outputs[i], slots.const_data_ptr<int64_t>(),
                                               shared_slots));
        } else {
          views.push_back(rotary_view<scalar_t>(r.inputs[i], r.outputs[i], r.args.format));
        }
      }
      const bool copies = r.cache != nullptr && r.cache->v.numel() != 0;
      const auto v_view = copies ? cache_view<scalar_t>(r, r.cache->v, r.cache->v_cache,
                                                        slots.const_data_ptr<int64_t>(), shared_slots)
                                 : RotaryView<scalar_t>{};
      const auto scale = static_cast<opmath>(r.attention_scale);
      const AngleCoeffs<opmath> coeffs{pos.defined() ? pos.const_data_ptr<double>() : nullptr,
                                       r.offset,
                                       r.args.shared_positions,
                                       r.seq,
                                       n_axes,
                                       axes.defined() ? axes.const_data_ptr<int32_t>() : nullptr,
                                       freq.const_data_ptr<double>(),
                                       freq.numel(),
                                       scale,
                                       r.inverse ? -scale : scale,
                                       r.inputs[0].numel() != 0 ? r.q_scale : QScale{}};
      if (r.norms != nullptr) {
        launch_norm_rope(norm_views, r.batch, r.seq, freq.numel(), r.args.layout, r.inverse, coeffs,
                         r.inputs[0].options());
      } else {
        launch_rotary(views, r.batch, r.seq, freq.numel(), r.args.layout, coeffs, copies ? &v_view : nullptr);
      }
    });
  }

  template <typename scalar_t, typename opmath>
  static void rotate_by_tables(const RotaryView<scalar_t>& view, int64_t batch, int64_t seq, const at::Tensor& cos,
                               const at::Tensor& sin, const RopeArgs& args, bool transpose) {
    const int64_t pairs = cos.size(-1) / 2;
    const bool neox = args.layout == RopeLayout::Neox;
    const TableCoeffs<opmath> coeffs{cos.const_data_ptr<opmath>(), sin.const_data_ptr<opmath>(),
                                     args.shared_positions, seq, cos.size(-1), neox ? 1 : 2, neox ? pairs : 1,
                                     transpose};
    launch_rotary<scalar_t>({view}, batch, seq, pairs, args.layout, coeffs);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  RopeOps<CudaRope>::register_kernels(m);
  QkNormOps<CudaRope>::register_kernels(m);
  KvCacheOps<CudaRope>::register_kernels(m);
}

}  // namespace posenc::cuda
