#pragma once
// The additive kernel of the sinusoidal and learned families on the GPU: out[n] = in(n) * scale + pe(n mod P)
// over rows n = l * P + p, where P positions are shared by L = rows / P leading indices (or P = rows: one
// position per row). in(n) is row n of x, row ids[n] of a token table, or nothing (the encoding alone); pe is
// a sinusoidal encoding (formed here in maths precision) or a table row.
//
// A block takes one position p and blockDim.x * V channels of it: each thread forms (or loads) the encoding of
// its V channels once, then streams those channels of every leading index in its range past it, so sin and
// cos are computed once per (position, channel) however many batch rows share the position. V = 16 bytes /
// element size where rows are whole 16-byte vectors and every pointer is aligned, else 1 (odd widths, offset
// views). When there are fewer (position, channel) tiles than the device has room for, the leading indices are
// split over gridDim.y.
#include "cuda/angle.cuh"
#include "cuda/geometry.h"
#include "cuda/utils.cuh"

namespace posenc::cuda {

// The sinusoidal encoding of positions (float64, or offset + index where absent), in maths precision. Row p
// encodes position sequence_position(sequence, p), or nothing (a prefix token: -0.0 added, which leaves every
// value as it is). Multi-axis (pair_axis not null): a position is n_axes values side by side, pair i encoding the
// one of axis pair_axis[i].
template <typename opmath>
struct SinusoidalEncoding {
  const double* positions;
  int64_t offset;
  const double* inv_freq;
  int64_t pairs;
  SinusoidalLayout layout;
  SequenceRows sequence;
  int64_t n_axes;
  const int32_t* pair_axis;
  const int32_t* channel_codes;  // "half_per_axis": channel d holds 2 * pair + (1 for its cosine)

  struct Position {
    double value;           // one axis
    const double* values;   // multi-axis: the token's n_axes positions
    bool slow;
    bool prefix;
  };

  __device__ double max_frequency() const { return posenc::cuda::max_frequency(inv_freq, pairs); }

  // Called by every thread of the block (p is the block's).
  __device__ Position position(int64_t p, double local_max) const {
    const int64_t index = portable::sequence_position(sequence, p);
    if (index < 0) return {0.0, nullptr, false, true};
    if (pair_axis != nullptr) {
      const double* values = positions + index * n_axes;
      return {0.0, values, slow_angles<opmath>(values, n_axes, local_max), false};
    }
    const double value = positions == nullptr ? static_cast<double>(offset + index) : positions[index];
    return {value, nullptr, slow_angles<opmath>(value, local_max), false};
  }

  // The angle of pair i; an axis outside [0, n_axes) (unchecked under graph capture) gives NaN.
  __device__ double angle(const Position& at, int64_t i) const {
    if (pair_axis == nullptr) return at.value * inv_freq[i];
    const int32_t axis = pair_axis[i];
    if (axis < 0 || axis >= n_axes) return quiet_nan<double>();
    return portable::pair_angle(at.values, pair_axis, inv_freq, i);
  }

  // pe[k] for the encoded channels d0 + k < 2 * pairs: [sin, cos] pairs (interleaved), halves, or halves per run
  // of pairs on one axis.
  template <int V>
  __device__ void values(const Position& at, int64_t d0, opmath (&pe)[V]) const {
    opmath sin_value = 0;
    opmath cos_value = 0;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t d = d0 + k;
      if (d >= 2 * pairs) break;
      if (at.prefix) {
        pe[k] = -0.0;
      } else if (layout == SinusoidalLayout::Interleaved) {
        if (k == 0 || d % 2 == 0) angle_sincos(angle(at, d / 2), at.slow, sin_value, cos_value);
        pe[k] = d % 2 == 0 ? sin_value : cos_value;
      } else if (layout == SinusoidalLayout::HalfPerAxis) {
        const int32_t code = channel_codes[d];
        angle_sincos(angle(at, code >> 1), at.slow, sin_value, cos_value);
        pe[k] = (code & 1) ? cos_value : sin_value;
      } else {
        const bool first_half = d < pairs;
        angle_sincos(angle(at, first_half ? d : d - pairs), at.slow, sin_value, cos_value);
        const bool is_sin = first_half == (layout == SinusoidalLayout::Half);
        pe[k] = is_sin ? sin_value : cos_value;
      }
    }
  }
};

// Rows of a table read at positions: rows[p] (int64, already offset), or offset + p where absent. A row outside
// the table (possible only where no host check ran: graph capture) reads nothing and gives NaN.
template <typename scalar_t>
struct TableEncoding {
  const scalar_t* table;
  const int64_t* rows;
  int64_t offset;
  int64_t num_rows;
  int64_t width;

  struct Position {
    int64_t row;
  };

  __device__ double max_frequency() const { return 0.0; }

  __device__ Position position(int64_t p, double) const { return {rows == nullptr ? offset + p : rows[p]}; }

  template <int V>
  __device__ void values(const Position& at, int64_t d0, opmath_t<scalar_t> (&pe)[V]) const {
    if (at.row < 0 || at.row >= num_rows) {
#pragma unroll
      for (int k = 0; k < V; ++k) pe[k] = quiet_nan<opmath_t<scalar_t>>();
      return;
    }
    const auto chunk = load_vec<V>(table + at.row * width + d0);
#pragma unroll
    for (int k = 0; k < V; ++k) pe[k] = portable::to_opmath(chunk.v[k]);
  }
};

template <typename scalar_t>
struct AdditiveRows {
  const scalar_t* in;    // x rows (ids null), token table (ids given), or null: the encoding alone
  const int64_t* ids;    // token id of each row
  int64_t vocab;         // rows of the token table
  scalar_t* out;
  int64_t leads;
  int64_t num_positions;
  int64_t width;
  int64_t encoded;       // channels with an encoding: 2F or the table's width; an odd width's last has none
  int64_t chunks;        // channel tiles per position
  int64_t leads_per_block;
};

template <int V, typename scalar_t, typename Encoding>
__global__ void __launch_bounds__(kThreads)
    additive_kernel(const __grid_constant__ AdditiveRows<scalar_t> r, opmath_t<scalar_t> scale,
                    const __grid_constant__ Encoding encoding) {
  using opmath = opmath_t<scalar_t>;
  using portable::from_opmath;
  using portable::to_opmath;
  const double local_max = encoding.max_frequency();
  const int64_t tiles = r.num_positions * r.chunks;
  const auto [lead_begin, lead_end] = geometry::lead_range(blockIdx.y, r.leads_per_block, r.leads);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const auto [p, d0] = geometry::tile_piece(tile, r.chunks, blockDim.x, threadIdx.x, V);
    const auto at = encoding.position(p, local_max);  // every thread: it may hold a barrier
    if (d0 >= r.width) continue;
    opmath pe[V] = {};
    encoding.template values<V>(at, d0, pe);
#pragma unroll 4
    for (int64_t l = lead_begin; l < lead_end; ++l) {
      const int64_t n = geometry::additive_row(l, p, r.num_positions);
      scalar_t* __restrict__ dst = r.out + n * r.width + d0;
      Vec<scalar_t, V> y;
      if (r.in == nullptr) {
#pragma unroll
        for (int k = 0; k < V; ++k) y.v[k] = from_opmath<scalar_t>(pe[k]);
        store_vec<V>(dst, y);
        continue;
      }
      const scalar_t* __restrict__ src = r.in + n * r.width;
      if (r.ids != nullptr) {
        const int64_t id = r.ids[n];
        if (id < 0 || id >= r.vocab) {  // unchecked (graph capture) out-of-range token
#pragma unroll
          for (int k = 0; k < V; ++k) y.v[k] = from_opmath<scalar_t>(quiet_nan<opmath>());
          store_vec<V>(dst, y);
          continue;
        }
        src = r.in + id * r.width;
      }
      const auto x = load_vec<V>(src + d0);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const opmath scaled = to_opmath(x.v[k]) * scale;
        y.v[k] = from_opmath<scalar_t>(d0 + k < r.encoded ? scaled + pe[k] : scaled);
      }
      store_vec<V>(dst, y);
    }
  }
}

// The rows of `out` (P = num_positions positions shared by its rows / P leading indices) and what is added to
// the encoding: `in`'s rows (ids undefined), its rows ids (a token table), or nothing (in undefined).
template <typename scalar_t>
AdditiveRows<scalar_t> additive_rows(const at::Tensor& in, const at::Tensor& ids, const at::Tensor& out,
                                     int64_t num_positions, int64_t encoded) {
  const int64_t width = out.size(-1);
  return {in.defined() ? in.const_data_ptr<scalar_t>() : nullptr,
          ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr,
          ids.defined() ? in.size(0) : 0,
          out.mutable_data_ptr<scalar_t>(),
          out.numel() / width / num_positions,
          num_positions,
          width,
          encoded,
          0,
          0};
}

// V = 16 bytes / element size where rows are whole vectors and every pointer is 16-byte aligned, else 1.
template <typename scalar_t, typename Encoding>
void launch_additive(AdditiveRows<scalar_t> rows, double scale, const Encoding& encoding, bool encoding_aligned) {
  constexpr int V = kMaxVec<scalar_t>;
  const bool vectorized = geometry::additive_vectorizable(rows.width, rows.in, rows.out, encoding_aligned, V);
  const auto plan =
      geometry::additive_launch(rows.width, rows.leads, rows.num_positions, vectorized, V, multiprocessors());
  rows.chunks = plan.chunks;
  rows.leads_per_block = plan.leads_per_block;
  if (plan.grid.x == 0 || plan.grid.y == 0) return;  // nothing to write (the op layers return before)
  const dim3 grid(static_cast<unsigned int>(plan.grid.x), static_cast<unsigned int>(plan.grid.y));
  const auto maths_scale = static_cast<opmath_t<scalar_t>>(scale);
  if (vectorized) {
    additive_kernel<V, scalar_t><<<grid, kThreads, 0, current_stream()>>>(rows, maths_scale, encoding);
  } else {
    additive_kernel<1, scalar_t><<<grid, kThreads, 0, current_stream()>>>(rows, maths_scale, encoding);
  }
  POSENC_CUDA_LAUNCH_CHECK();
}

}  // namespace posenc::cuda
