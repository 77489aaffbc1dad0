#pragma once
// Kernel interface of the sinusoidal and learned families (the additive kernels): what the op layer
// (cpu/sinusoidal.cpp, cpu/learned.cpp) hands the per-capability kernels (cpu/kernels/additive.cpp).
#include "cpu/dispatch.h"
#include "portable/types.h"

namespace posenc::cpu {

// out[n] = in(n) * scale + PE(n mod P), rows = L * P: P rows of positions shared by L leading indices (or one
// per row: P = rows). Row p encodes position sequence_position(sequence, p) (none for a prefix token). PE has
// 2 * pairs channels in `layout`; channels past them (an odd width's last) get none. Multi-axis (pair_axis not
// null): a position is n_axes values side by side, pair i encoding the one of axis pair_axis[i].
template <typename scalar_t>
struct SinusoidalProblem {
  RowInput<scalar_t> in;
  scalar_t* out;
  int64_t rows;
  int64_t width;
  const double* positions;  // null: positions first_position + index (an arange)
  int64_t first_position;
  int64_t num_positions;
  SequenceRows sequence;
  int64_t n_axes;
  const int32_t* pair_axis;
  const double* inv_freq;
  int64_t pairs;
  double max_abs_freq;
  SinusoidalLayout layout;
  double scale;
  // Not null: the encodings of positions 0, 1, 2, ..., rows of 2 * pairs values computed already by this kernel (the
  // op layer's kept tables, cpu/sinusoidal.cpp), covering every position read, each a whole number; null: computed
  // here.
  const opmath_t<scalar_t>* encodings = nullptr;
};

// out[n] = in(n) * scale + table[table_rows[n mod P]], rows = L * P (in absent: the table rows alone).
template <typename scalar_t>
struct LearnedProblem {
  RowInput<scalar_t> in;
  scalar_t* out;
  int64_t rows;
  int64_t width;
  const scalar_t* table;
  const int64_t* table_rows;  // null: rows first_row + p (an arange)
  int64_t first_row;
  int64_t num_positions;
  double scale;
};

// out[b, s] = first + (count of real entries in row b before s) for a real entry, pad otherwise.
struct CountPositionsProblem {
  const bool* real;
  int64_t* out;
  int64_t rows;
  int64_t seq_len;
  int64_t first;
  int64_t pad;
};

template <typename scalar_t>
inline DispatchStub<void(const SinusoidalProblem<scalar_t>&)> sinusoidal_stub;
template <typename scalar_t>
inline DispatchStub<void(const LearnedProblem<scalar_t>&)> learned_stub;
inline DispatchStub<void(const CountPositionsProblem&)> count_positions_stub;

}  // namespace posenc::cpu
