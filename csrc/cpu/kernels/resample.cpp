// resample_learned, its fused add (add_resampled_learned) and its adjoint, compiled once per CPU capability: a
// learned table's grid rows interpolated to a new grid one axis at a time (rows, then columns), added to an input's
// rows as they are formed, the adjoint the same two passes transposed, each sum in
// float64 in a fixed order (no thread ever adds into another's output), so the bits do not depend on the thread
// count.
#include "cpu/kernels/capability.h"
#include "cpu/kernels/resample.h"

POSENC_KERNELS_BEGIN
#include "cpu/kernels/row_tiles.h"
#include "portable/convert.h"
#include "portable/resample.h"

namespace posenc::cpu {
inline namespace POSENC_CPU_CAPABILITY {
namespace {

using namespace posenc::portable;

// One axis's weights as runs: output o reads inputs first[o] + k with weight weights[o * max_taps + k],
// k < count[o]. Its transpose, for the adjoint: input i is read by outputs users[user_start[i] ..
// user_start[i + 1]), the run resample_adjoint_range gives (the CUDA kernel's), in increasing order, with weights
// user_weights[...].
struct AxisTaps {
  std::vector<int64_t> first;
  std::vector<int64_t> count;
  std::vector<double> weights;
  int64_t max_taps = 0;
  std::vector<int64_t> user_start;
  std::vector<int64_t> users;
  std::vector<double> user_weights;

  explicit AxisTaps(const ResampleAxis& axis, bool transpose)
      : first(axis.out), count(axis.out), weights(axis.out * axis.max_taps), max_taps(axis.max_taps) {
    for (int64_t o = 0; o < axis.out; ++o) first[o] = resample_taps(axis, o, &count[o], &weights[o * max_taps]);
    if (!transpose) return;
    user_start.assign(1, 0);
    for (int64_t i = 0; i < axis.in; ++i) {
      int64_t lo = 0;
      int64_t hi = 0;
      resample_adjoint_range(axis, i, &lo, &hi);
      for (int64_t o = lo; o < hi; ++o) {
        users.push_back(o);
        user_weights.push_back(weights[o * max_taps + (i - first[o])]);
      }
      user_start.push_back(static_cast<int64_t>(users.size()));
    }
  }
};

// round_to_odd_float over n values. The AVX-512 build converts eight at a time toward zero (the conversion's own
// rounding mode) and sets the last bit where the conversion was inexact, a NaN included: the same bits, in half the
// instructions GCC makes of round_to_odd_float's compares and selects.
inline void round_to_odd(const double* src, float* dst, int64_t n) {
  int64_t d = 0;
#if POSENC_CPU_CAPABILITY_INDEX == 2 && (defined(__x86_64__) || defined(__i386__))
  for (; d + 8 <= n; d += 8) {
    const __m512d value = _mm512_loadu_pd(src + d);
    // (the masks of all lanes: GCC 12 warns of its own placeholder in the unmasked forms)
    const __m256 toward_zero = _mm512_maskz_cvt_roundpd_ps(0xFF, value, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask8 inexact = _mm512_cmp_pd_mask(_mm512_maskz_cvtps_pd(0xFF, toward_zero), value, _CMP_NEQ_UQ);
    const __m256i bits = _mm256_castps_si256(toward_zero);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                        _mm256_mask_or_epi32(bits, inexact, bits, _mm256_set1_epi32(1)));
  }
#endif
  for (; d < n; ++d) dst[d] = round_to_odd_float(src[d]);
}

// fp16 and bf16 go through float blocks rounded to odd, then narrow's vector conversions.
template <typename scalar_t>
void round_row(const double* src, scalar_t* dst, int64_t width) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
    for (int64_t d = 0; d < width; ++d) dst[d] = round_from_double<scalar_t>(src[d]);
  } else {
    constexpr int64_t kBlock = 256;
    float odd[kBlock];
    for (int64_t d0 = 0; d0 < width; d0 += kBlock) {
      const int64_t n = std::min(kBlock, width - d0);
      round_to_odd(src + d0, odd, n);
      narrow(odd, dst + d0, n);
    }
  }
}

// acc[d] = (acc[d] +) rows[0][d] + ... + rows[kRows - 1][d] in float64, the terms added in row order onto acc
// (`onto`) or onto the first row's: the sums of adding one row at a time, in one sweep over acc.
template <int kRows, typename scalar_t>
void sum_rows(const scalar_t* const* rows, double* acc, int64_t n, bool onto) {
  const auto value = [&](int k, int64_t d) { return static_cast<double>(to_opmath(rows[k][d])); };
  const auto rest = [&](double total, int64_t d) {
    for (int k = 1; k < kRows; ++k) total += value(k, d);
    return total;
  };
  if (onto) {
    for (int64_t d = 0; d < n; ++d) acc[d] = rest(acc[d] + value(0, d), d);
  } else {
    for (int64_t d = 0; d < n; ++d) acc[d] = rest(value(0, d), d);
  }
}

inline void axpy(double weight, const double* x, double* acc, int64_t width) {
  for (int64_t d = 0; d < width; ++d) acc[d] += weight * x[d];
}

template <typename scalar_t>
void axpy(double weight, const scalar_t* x, double* acc, int64_t width) {
  for (int64_t d = 0; d < width; ++d) acc[d] += weight * static_cast<double>(to_opmath(x[d]));
}

// The most outputs that read one input.
inline int64_t max_users(const AxisTaps& taps) {
  int64_t most = 0;
  for (size_t i = 0; i + 1 < taps.user_start.size(); ++i) most = std::max(most, taps.user_start[i + 1] - taps.user_start[i]);
  return most;
}

// acc[d] = 0 + sum_k weights[k] * rows[k][d] over n channels, the terms added in k order (the CUDA kernels' order),
// four rows per sweep over acc. The first sweep adds to the literal 0 rather than to acc cleared: the same sums,
// without clearing acc first (a memset that took 15% of a DINOv2-L resample's samples) and reading it back.
template <typename T>
void weighted_rows(const double* weights, const T* const* rows, int64_t count, double* acc, int64_t n) {
  const auto value = [](const T* row, int64_t d) { return static_cast<double>(to_opmath(row[d])); };
  if (count == 0) {
    std::fill_n(acc, n, 0.0);
    return;
  }
  if (count < 4) {
    for (int64_t d = 0; d < n; ++d) acc[d] = 0.0 + weights[0] * value(rows[0], d);
  }
  int64_t k = count < 4 ? 1 : 0;
  for (; k + 4 <= count; k += 4) {
    const T* a = rows[k];
    const T* b = rows[k + 1];
    const T* c = rows[k + 2];
    const T* e = rows[k + 3];
    const double wa = weights[k], wb = weights[k + 1], wc = weights[k + 2], we = weights[k + 3];
    const bool first = k == 0;
    for (int64_t d = 0; d < n; ++d) {
      acc[d] = ((((first ? 0.0 : acc[d]) + wa * value(a, d)) + wb * value(b, d)) + wc * value(c, d)) + we * value(e, d);
    }
  }
  for (; k < count; ++k) axpy(weights[k], rows[k], acc, n);
}

// A task's resampling of the table's grid rows, one output row at a time: along the rows first, mid[j] = sum_k
// rows(h, k) * table[first + k, j] for output grid row h (the taps are whole runs of table rows, read in order),
// float64 [Ws, width], which stays in L2 and is kept for the next output of the same h; then along the columns,
// out[h, w] = sum_l cols(w, l) * mid[first + l], rounded once.
template <typename scalar_t>
class GridRowResampler {
 public:
  GridRowResampler(const scalar_t* grid_table, int64_t width, const ResampleGrid& grid, const AxisTaps& rows,
                   const AxisTaps& cols)
      : table_(grid_table), width_(width), in_cols_(grid.width.in), rows_(rows), cols_(cols),
        mid_(in_cols_ * width), acc_(width), row_taps_(rows.max_taps), col_taps_(cols.max_taps) {}

  // Output grid row (h, w), rounded, into out[0, width).
  void resample(int64_t h, int64_t w, scalar_t* out) {
    if (h != formed_) form_row(h);
    for (int64_t l = 0; l < cols_.count[w]; ++l) col_taps_[l] = mid_.data() + (cols_.first[w] + l) * width_;
    weighted_rows(&cols_.weights[w * cols_.max_taps], col_taps_.data(), cols_.count[w], acc_.data(), width_);
    round_row(acc_.data(), out, width_);
  }

 private:
  void form_row(int64_t h) {
    for (int64_t j = 0; j < in_cols_; ++j) {
      for (int64_t k = 0; k < rows_.count[h]; ++k) {
        row_taps_[k] = table_ + ((rows_.first[h] + k) * in_cols_ + j) * width_;
      }
      weighted_rows(&rows_.weights[h * rows_.max_taps], row_taps_.data(), rows_.count[h], mid_.data() + j * width_,
                    width_);
    }
    formed_ = h;
  }

  const scalar_t* table_;
  int64_t width_;
  int64_t in_cols_;
  const AxisTaps& rows_;
  const AxisTaps& cols_;
  ScratchVector<double> mid_;
  ScratchVector<double> acc_;
  std::vector<const scalar_t*> row_taps_;
  std::vector<const double*> col_taps_;
  int64_t formed_ = -1;
};

template <typename scalar_t>
void resample_kernel(const ResampleProblem<scalar_t>& problem) {
  const auto& grid = problem.grid;
  const int64_t width = problem.width;
  const int64_t prefix = grid.prefix;
  const AxisTaps rows(grid.height, false);
  const AxisTaps cols(grid.width, false);
  const int64_t in_cols = grid.width.in;
  const int64_t out_cols = grid.width.out;
  scalar_t* out = problem.out + prefix * width;
  std::copy_n(problem.table, prefix * width, problem.out);
  parallel_for(0, grid.height.out, rows_per_task(width * in_cols * rows.max_taps), [&](int64_t begin, int64_t end) {
    GridRowResampler<scalar_t> resampler(problem.table + prefix * width, width, grid, rows, cols);
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t w = 0; w < out_cols; ++w) resampler.resample(h, w, out + (h * out_cols + w) * width);
    }
  });
}

// A task's block of resampled table rows (add_to_rows' Blocks), rounded to scalar_t as resample_kernel rounds
// them, so that x + the table is add_learned's sum of the same rows. A block (128 KiB) holds part of an output grid
// row or a few; the resampler keeps the row pass of the last grid row it formed, so a task runs each grid row's
// row pass once. The table is never written out and read back: for DINOv2-L's [2117, 1024] float32 table that was
// 8.7 MB stored, then read again past the input's stream.
template <typename scalar_t>
class ResampledBlocks {
 public:
  ResampledBlocks(const AddResampledProblem<scalar_t>& problem, const AxisTaps& rows, const AxisTaps& cols,
                  int64_t block)
      : problem_(problem),
        resampler_(problem.table + problem.grid.prefix * problem.width, problem.width, problem.grid, rows, cols),
        buffer_(block * problem.width) {}

  void prepare(int64_t first, int64_t count) {
    const int64_t width = problem_.width;
    const int64_t prefix = problem_.grid.prefix;
    const int64_t out_cols = problem_.grid.width.out;
    for (int64_t p = 0; p < count; ++p) {
      scalar_t* row = buffer_.data() + p * width;
      const int64_t token = first + p;
      if (token < prefix) {
        std::copy_n(problem_.table + token * width, width, row);
      } else {
        resampler_.resample((token - prefix) / out_cols, (token - prefix) % out_cols, row);
      }
    }
    first_ = first;
  }

  void add(int64_t count, const scalar_t* const* in, int64_t position, scalar_t* const* out, int64_t width,
           opmath_t<scalar_t> scale, RowStores stores) const {
    add_rows(count, in, buffer_.data() + (position - first_) * width, out, width, width, scale, stores);
  }

 private:
  const AddResampledProblem<scalar_t>& problem_;
  GridRowResampler<scalar_t> resampler_;
  ScratchVector<scalar_t> buffer_;
  int64_t first_ = 0;
};

template <typename scalar_t>
void add_resampled_kernel(const AddResampledProblem<scalar_t>& problem) {
  const auto& grid = problem.grid;
  const AxisTaps rows(grid.height, false);
  const AxisTaps cols(grid.width, false);
  const int64_t tokens = resampled_tokens(grid);
  const int64_t block = std::min(tokens, rows_per_block(problem.width * static_cast<int64_t>(sizeof(scalar_t))));
  add_to_rows(RowInput<scalar_t>{problem.in, nullptr}, problem.out, problem.rows, problem.width, tokens, block, 1.0,
              [&] { return ResampledBlocks<scalar_t>(problem, rows, cols, block); });
}

template <typename scalar_t>
void resample_adjoint_kernel(const ResampleAdjointProblem<scalar_t>& problem) {
  const auto& grid = problem.grid;
  const int64_t width = problem.width;
  const int64_t prefix = grid.prefix;
  const int64_t out_rows = grid.height.out;
  const int64_t out_cols = grid.width.out;
  const int64_t in_cols = grid.width.in;
  const int64_t tokens = prefix + out_rows * out_cols;
  const AxisTaps rows(grid.height, true);
  const AxisTaps cols(grid.width, true);
  // The gradient summed over its leading blocks, in block order: sum[s], float64 [tokens, width] (every row
  // written whole before it is read). A task's rows are one contiguous run of every block, up to eight blocks' runs
  // added in one sweep over the task's sum (a task's sum of DINOv2-L's is 8.7 MB: a sweep per block read and wrote it
  // seven times; in-process A/B, resample_learned_backward of [8, 2117, 1024] 1.17x float32 and 1.20x bf16, of
  // [32, 577, 768] 1.45x and 1.15x, 2 threads). Rows one by one, each from its own block, in chunks of a task's run
  // were slower (0.72-0.97x): the blocks' rows lie a block apart and map to the same cache sets.
  const std::unique_ptr<double[]> sums(new double[tokens * width]);
  double* sum = sums.get();
  parallel_for(0, tokens, rows_per_task(width * problem.leads), [&](int64_t begin, int64_t end) {
    const int64_t count = (end - begin) * width;
    const scalar_t* rows[8];
    for (int64_t b = 0; b < problem.leads;) {
      const int64_t left = problem.leads - b;
      const int64_t m = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      for (int64_t k = 0; k < m; ++k) rows[k] = problem.grad + ((b + k) * tokens + begin) * width;
      double* acc = sum + begin * width;
      switch (m) {
        case 8: sum_rows<8>(rows, acc, count, b > 0); break;
        case 4: sum_rows<4>(rows, acc, count, b > 0); break;
        case 2: sum_rows<2>(rows, acc, count, b > 0); break;
        default: sum_rows<1>(rows, acc, count, b > 0); break;
      }
      b += m;
    }
  });
  round_row(sum, problem.out, prefix * width);
  const double* grid_sum = sum + prefix * width;
  scalar_t* out = problem.out + prefix * width;
  // One table row i at a time, the forward's passes transposed in reverse: mid[w] = sum over the output rows h
  // reading i of rows(h, i) * sum[h, w], float64 [W, width]; then out[i, j] = sum over the output columns w
  // reading j of cols(w, j) * mid[w], rounded once.
  const int64_t in_rows = grid.height.in;
  parallel_for(0, in_rows, rows_per_task(width * out_cols * rows.max_taps), [&](int64_t begin, int64_t end) {
    ScratchVector<double> mid(out_cols * width);
    ScratchVector<double> acc(width);
    std::vector<const double*> row_taps(max_users(rows));
    std::vector<const double*> col_taps(max_users(cols));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t u0 = rows.user_start[i];
      const int64_t users = rows.user_start[i + 1] - u0;
      for (int64_t w = 0; w < out_cols; ++w) {
        for (int64_t u = 0; u < users; ++u) row_taps[u] = grid_sum + (rows.users[u0 + u] * out_cols + w) * width;
        weighted_rows(&rows.user_weights[u0], row_taps.data(), users, mid.data() + w * width, width);
      }
      for (int64_t j = 0; j < in_cols; ++j) {
        const int64_t v0 = cols.user_start[j];
        const int64_t readers = cols.user_start[j + 1] - v0;
        for (int64_t v = 0; v < readers; ++v) col_taps[v] = mid.data() + cols.users[v0 + v] * width;
        weighted_rows(&cols.user_weights[v0], col_taps.data(), readers, acc.data(), width);
        round_row(acc.data(), out + (i * in_cols + j) * width, width);
      }
    }
  });
}

}  // namespace
POSENC_KERNELS_END  // the registrations below run when the library loads, on any CPU

POSENC_REGISTER_FLOATING_KERNELS(resample_stub, resample_kernel);
POSENC_REGISTER_FLOATING_KERNELS(add_resampled_stub, add_resampled_kernel);
POSENC_REGISTER_FLOATING_KERNELS(resample_adjoint_stub, resample_adjoint_kernel);
}  // namespace POSENC_CPU_CAPABILITY
}  // namespace posenc::cpu
