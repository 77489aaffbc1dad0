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
  int64_t max_users = 0;  // the most outputs that read one input

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
      max_users = std::max(max_users, hi - lo);
    }
  }
};

#if defined(POSENC_BF16_BY_SSE2)
// round_to_odd_float in the baseline build, whose conversions have no rounding mode of their own: a float holds a
// double's exponent and its 23 leading mantissa bits where 2^-126 <= |value| < 2^128 (and zero), so there the
// double's lower 29 bits are cleared and, where any was set, its bit 29 (the float's last) set: a double that a float
// holds exactly, which the conversion to nearest keeps. Those bits all lie in the value's low 32-bit word. GCC's
// vectorization of round_to_odd_float packs its 64-bit masks into 32-bit lanes, a shuffle each: it took 38% of an
// AVX2 bf16 resample_learned.
POSENC_INLINE __m128d float_sized(__m128d value) {  // 2^-126 <= |value| < 2^128, or 0
  const __m128d size = _mm_andnot_pd(_mm_set1_pd(-0.0), value);
  return _mm_or_pd(_mm_and_pd(_mm_cmpge_pd(size, _mm_set1_pd(0x1p-126)), _mm_cmplt_pd(size, _mm_set1_pd(0x1p128))),
                   _mm_cmpeq_pd(size, _mm_setzero_pd()));
}

POSENC_INLINE __m128 odd_float_sized(__m128d value) {
  const __m128i bits = _mm_castpd_si128(value);
  const __m128i dropped = _mm_set1_epi64x((1 << 29) - 1);
  const __m128i exact = _mm_cmpeq_epi32(_mm_and_si128(bits, dropped), _mm_setzero_si128());
  const __m128i kept = _mm_or_si128(_mm_andnot_si128(dropped, bits), _mm_andnot_si128(exact, _mm_set1_epi64x(1 << 29)));
  return _mm_cvtpd_ps(_mm_castsi128_pd(kept));
}

// Four values of src rounded to odd into *odd; false, with nothing set, where one is not float-sized (a denormal
// float, an infinity, a NaN).
POSENC_INLINE bool odd_floats(const double* src, __m128* odd) {
  const __m128d low = _mm_loadu_pd(src), high = _mm_loadu_pd(src + 2);
  if (_mm_movemask_pd(_mm_and_pd(float_sized(low), float_sized(high))) != 0x3) return false;
  *odd = _mm_movelh_ps(odd_float_sized(low), odd_float_sized(high));
  return true;
}

POSENC_INLINE void store_floats(float* p, __m128 v) { _mm_storeu_ps(p, v); }
#endif

#if defined(POSENC_BF16_BY_AVX2)
// The AVX2 build rounds a float64 sum to bf16 or fp16 through the nearest float (vcvtpd2ps), not the float rounded
// to odd: both roundings to nearest are monotonic and every midpoint of bf16 and fp16 is a float, so the float lies
// on the double's side of each midpoint, or on the midpoint itself, and a second rounding to nearest even takes it
// where the double would go, except from a midpoint the double lies off. rounds_alike finds those lanes (bits
// below the narrower type's last place exactly half of it) and any outside [least, most): denormal floats, which a
// flush to zero would take, infinities and NaNs; they go by round_from_double. Per 16 bf16 values about 30 vector
// instructions against the rounding to odd's 60: DINOv2-L's table ([2117, 1024], Zen 2, 2 threads, separate
// processes) bf16 2.05 -> 1.90-1.98 ms, fp16 1.87 -> 1.63-1.69; its fused add 1.02-1.05x.
POSENC_INLINE __m256 nearest_floats(const double* src) {
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(src + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(src)));
}

template <uint32_t kHalfLastPlace>
POSENC_INLINE bool rounds_alike(__m256 nearest, float least, float most) {
  const __m256 size = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), nearest);
  const __m256 in_range = _mm256_and_ps(_mm256_cmp_ps(size, _mm256_set1_ps(least), _CMP_GE_OQ),
                                        _mm256_cmp_ps(size, _mm256_set1_ps(most), _CMP_LT_OQ));
  const __m256i below = _mm256_and_si256(_mm256_castps_si256(nearest), _mm256_set1_epi32(2 * kHalfLastPlace - 1));
  const __m256i midpoint = _mm256_cmpeq_epi32(below, _mm256_set1_epi32(kHalfLastPlace));
  return _mm256_movemask_ps(_mm256_andnot_ps(_mm256_castsi256_ps(midpoint), in_range)) == 0xFF;
}
#endif

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
#elif defined(POSENC_BF16_BY_SSE2)
  using V = Bf16Vectors;
  for (; d + V::kLanes <= n; d += V::kLanes) {
    V::Floats odd;
    if (odd_floats(src + d, &odd)) {
      store_floats(dst + d, odd);
    } else {
      for (int64_t k = 0; k < V::kLanes; ++k) dst[d + k] = round_to_odd_float(src[d + k]);
    }
  }
#endif
  for (; d < n; ++d) dst[d] = round_to_odd_float(src[d]);
}

// fp16 and bf16 go through float blocks rounded to odd, then narrow's vector conversions. The AVX2 build rounds
// both through the nearest floats in registers, the baseline's bf16 through floats rounded to odd in registers,
// without the block (a step holding a value that is neither goes value by value). out_t float (the fused add's
// rows, ResampledBlocks): each value rounded to scalar_t, then stored widened back to float.
template <typename scalar_t, typename out_t = scalar_t>
void round_row(const double* src, out_t* dst, int64_t width) {
  static_assert(std::is_same_v<out_t, scalar_t> || std::is_same_v<out_t, opmath_t<scalar_t>>);
  constexpr bool kWidened = !std::is_same_v<out_t, scalar_t>;
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>) {
    for (int64_t d = 0; d < width; ++d) dst[d] = round_from_double<scalar_t>(src[d]);
  } else {
    int64_t done = 0;
    const auto value_by_value = [&](int64_t n) {
      for (int64_t d = done; d < done + n; ++d) dst[d] = static_cast<out_t>(round_from_double<scalar_t>(src[d]));
    };
#if defined(POSENC_BF16_BY_AVX2)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      for (; done + 16 <= width; done += 16) {
        const __m256 low = nearest_floats(src + done), high = nearest_floats(src + done + 8);
        if (!rounds_alike<0x8000>(low, 0x1p-126f, INFINITY) || !rounds_alike<0x8000>(high, 0x1p-126f, INFINITY)) {
          value_by_value(16);
        } else if constexpr (kWidened) {
          Bf16Vectors::store_floats(dst + done, Bf16Vectors::round<false>(low));
          Bf16Vectors::store_floats(dst + done + 8, Bf16Vectors::round<false>(high));
        } else {
          Bf16Vectors::store<false>(dst + done, Bf16Vectors::narrow<false>(low, high));
        }
      }
    } else {
      for (; done + 8 <= width; done += 8) {
        const __m256 nearest = nearest_floats(src + done);
        if (!rounds_alike<0x1000>(nearest, 0x1p-14f, 0x1p16f)) {
          value_by_value(8);
          continue;
        }
        const __m128i halves = _mm256_cvtps_ph(nearest, _MM_FROUND_TO_NEAREST_INT);
        if constexpr (kWidened) {
          _mm256_storeu_ps(dst + done, _mm256_cvtph_ps(halves));
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + done), halves);
        }
      }
    }
#elif defined(POSENC_BF16_BY_SSE2)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      using V = Bf16Vectors;
      for (; done + 2 * V::kLanes <= width; done += 2 * V::kLanes) {
        V::Floats low, high;
        if (!odd_floats(src + done, &low) || !odd_floats(src + done + V::kLanes, &high)) {
          value_by_value(2 * V::kLanes);
        } else if constexpr (kWidened) {  // no NaN: float-sized
          V::store_floats(dst + done, V::round<false>(low));
          V::store_floats(dst + done + V::kLanes, V::round<false>(high));
        } else {
          V::store<false>(dst + done, V::narrow<false>(low, high));
        }
      }
    }
#endif
    constexpr int64_t kBlock = 256;
    float odd[kBlock];
    scalar_t narrowed[kWidened ? kBlock : 1];
    for (int64_t d0 = done; d0 < width; d0 += kBlock) {
      const int64_t n = std::min(kBlock, width - d0);
      round_to_odd(src + d0, odd, n);
      if constexpr (kWidened) {
        narrow(odd, narrowed, n);
        widen(narrowed, dst + d0, n);
      } else {
        narrow(odd, dst + d0, n);
      }
    }
  }
}

#if defined(POSENC_HAS_F16C) && POSENC_CPU_CAPABILITY_INDEX >= 1
// Eight fp16 or bf16 values widened to float64 (fp16 by vcvtph2ps, bf16 as the high half of a float; then vcvtps2pd),
// one vector of the AVX-512 build or two of AVX2's, and the float64 arithmetic the sums below do on them: to_opmath's
// integer form, which GCC vectorizes into a dozen instructions a vector, took a third of the DINOv2-L fp16 adjoint's
// samples and a fifth of its forward's. AVX2, in-process A/B against that form, 2 threads: fp16 DINOv2-L fwd
// 1.11-1.13x, fwd+bwd 1.17-1.21x; ViT-B 1.03-1.05x, 1.15-1.16x. bf16 (Zen 2, separate processes): ViT-B's adjoint
// [32, 577, 768] 2.29-2.40 -> 1.83-1.87 ms, DINOv2-L's table 1.99 -> 1.75 ms.
struct EightDoubles {
  static constexpr int64_t kLanes = 8;
#if POSENC_CPU_CAPABILITY_INDEX == 2
  __m512d v;
  static EightDoubles of(__m256 f) { return {_mm512_maskz_cvtps_pd(0xFF, f)}; }
  static EightDoubles widen(const c10::Half* p) { return of(widen_halfx8(p)); }
  static EightDoubles widen(const c10::BFloat16* p) {  // a bf16 value is the high half of its float
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return of(_mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
  }
  static EightDoubles load(const double* p) { return {_mm512_loadu_pd(p)}; }
  static EightDoubles zero() { return {_mm512_setzero_pd()}; }
  void store(double* p) const { _mm512_storeu_pd(p, v); }
  EightDoubles operator+(EightDoubles o) const { return {_mm512_add_pd(v, o.v)}; }
  EightDoubles times(double w) const { return {_mm512_mul_pd(_mm512_set1_pd(w), v)}; }
#else
  __m256d low, high;
  static EightDoubles of(__m256 f) {
    return {_mm256_cvtps_pd(_mm256_castps256_ps128(f)), _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1))};
  }
  static EightDoubles widen(const c10::Half* p) { return of(widen_halfx8(p)); }
  // a bf16 value is the high half of its float: each half of the eight by an interleave with zero words, not
  // Bf16Vectors::widen's eight floats split again (ViT-B's bf16 adjoint 0.93x the time of that form)
  static EightDoubles widen(const c10::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i zero = _mm_setzero_si128();
    return {_mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpacklo_epi16(zero, bits))),
            _mm256_cvtps_pd(_mm_castsi128_ps(_mm_unpackhi_epi16(zero, bits)))};
  }
  static EightDoubles load(const double* p) { return {_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4)}; }
  static EightDoubles zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  void store(double* p) const {
    _mm256_storeu_pd(p, low);
    _mm256_storeu_pd(p + 4, high);
  }
  EightDoubles operator+(EightDoubles o) const { return {_mm256_add_pd(low, o.low), _mm256_add_pd(high, o.high)}; }
  EightDoubles times(double w) const {
    const __m256d weight = _mm256_set1_pd(w);
    return {_mm256_mul_pd(weight, low), _mm256_mul_pd(weight, high)};
  }
#endif
};
#define POSENC_EIGHT_DOUBLES 1
#endif

// acc[d] = (acc[d] +) rows[0][d] + ... + rows[kRows - 1][d] in float64, the terms added in row order onto acc
// (`onto`) or onto the first row's: the sums of adding one row at a time, in one sweep over acc.
template <int kRows, typename scalar_t>
void sum_rows(const scalar_t* const* rows, double* acc, int64_t n, bool onto) {
  int64_t first = 0;
#if defined(POSENC_EIGHT_DOUBLES)
  if constexpr (std::is_same_v<scalar_t, c10::Half> || std::is_same_v<scalar_t, c10::BFloat16>) {
    for (; first + EightDoubles::kLanes <= n; first += EightDoubles::kLanes) {
      EightDoubles total = EightDoubles::widen(rows[0] + first);
      if (onto) total = EightDoubles::load(acc + first) + total;
      for (int k = 1; k < kRows; ++k) total = total + EightDoubles::widen(rows[k] + first);
      total.store(acc + first);
    }
  }
#endif
  const auto value = [&](int k, int64_t d) { return static_cast<double>(to_opmath(rows[k][d])); };
  const auto rest = [&](double total, int64_t d) {
    for (int k = 1; k < kRows; ++k) total += value(k, d);
    return total;
  };
  if (onto) {
    for (int64_t d = first; d < n; ++d) acc[d] = rest(acc[d] + value(0, d), d);
  } else {
    for (int64_t d = first; d < n; ++d) acc[d] = rest(value(0, d), d);
  }
}

// acc[d] = (acc[d] | 0) + weights[0] * rows[0][d] + ... over channels [first, n), the kRows terms added in order
// onto acc (`onto`) or onto the literal 0, in one sweep.
template <int kRows, typename T>
void weighted_sweep(const double* weights, const T* const* rows, double* acc, int64_t first, int64_t n, bool onto) {
  const T* row[kRows];
  double weight[kRows];
  for (int k = 0; k < kRows; ++k) {
    row[k] = rows[k];
    weight[k] = weights[k];
  }
  for (int64_t d = first; d < n; ++d) {
    double total = onto ? acc[d] : 0.0;
    for (int k = 0; k < kRows; ++k) total = total + weight[k] * static_cast<double>(to_opmath(row[k][d]));
    acc[d] = total;
  }
}

// acc[d] = 0 + sum_k weights[k] * rows[k][d] over n channels, the terms added in k order (the CUDA kernels' order),
// up to eight rows per sweep over acc: the adjoint's rows have 4-6 terms (an input row read by 4-6 outputs), which a
// sweep of four and a sweep of one more read and wrote acc twice for (DINOv2-L's adjoint, bf16 [8], Zen 2, 0.89-0.97x).
// The first sweep adds to the literal 0 rather than to acc cleared: the same sums, without clearing acc first (a
// memset that took 15% of a DINOv2-L resample's samples) and reading it back.
template <typename T>
void weighted_rows(const double* weights, const T* const* rows, int64_t count, double* acc, int64_t n) {
  int64_t first = 0;  // channels [0, first) summed already, eight at a time, in the same order
#if defined(POSENC_EIGHT_DOUBLES)
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    for (; count > 0 && first + EightDoubles::kLanes <= n; first += EightDoubles::kLanes) {
      EightDoubles total = EightDoubles::zero();
      for (int64_t k = 0; k < count; ++k) total = total + EightDoubles::widen(rows[k] + first).times(weights[k]);
      total.store(acc + first);
    }
  }
#endif
  if (count == 0) {
    std::fill_n(acc, n, 0.0);
    return;
  }
  for (int64_t k = 0; k < count;) {
    const int64_t m = std::min<int64_t>(count - k, 8);
    const bool onto = k > 0;
    switch (m) {
      case 8: weighted_sweep<8>(weights + k, rows + k, acc, first, n, onto); break;
      case 7: weighted_sweep<7>(weights + k, rows + k, acc, first, n, onto); break;
      case 6: weighted_sweep<6>(weights + k, rows + k, acc, first, n, onto); break;
      case 5: weighted_sweep<5>(weights + k, rows + k, acc, first, n, onto); break;
      case 4: weighted_sweep<4>(weights + k, rows + k, acc, first, n, onto); break;
      case 3: weighted_sweep<3>(weights + k, rows + k, acc, first, n, onto); break;
      case 2: weighted_sweep<2>(weights + k, rows + k, acc, first, n, onto); break;
      default: weighted_sweep<1>(weights + k, rows + k, acc, first, n, onto); break;
    }
    k += m;
  }
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

  // Output grid row (h, w), rounded to scalar_t, into out[0, width) (out_t: round_row's).
  template <typename out_t>
  void resample(int64_t h, int64_t w, out_t* out) {
    if (h != formed_) form_row(h);
    for (int64_t l = 0; l < cols_.count[w]; ++l) col_taps_[l] = mid_.data() + (cols_.first[w] + l) * width_;
    weighted_rows(&cols_.weights[w * cols_.max_taps], col_taps_.data(), cols_.count[w], acc_.data(), width_);
    round_row<scalar_t>(acc_.data(), out, width_);
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
// them, so that x + the table is add_learned's sum of the same rows; fp16 and bf16 rows are kept as the floats of
// their rounded values (round_row's out_t), so that add_rows does not widen a row again for every pair of batch rows
// (ViT-B, DINOv2-L bf16 fwd 0.96-0.97x, Zen 2) and the AVX2 build widens each rounded vector in registers rather
// than packing it and reading it back (ViT-B bf16 and fp16 fwd 0.95-0.96x more, DINOv2-L bf16 0.91x, fp16 1.00x). A
// block (128 KiB) holds part of an output grid row or a few; the resampler keeps the row pass of the last grid row it
// formed, so a task runs each grid row's row pass once. The table is never written out and read back: for
// DINOv2-L's [2117, 1024] float32 table that was 8.7 MB stored, then read again past the input's stream.
template <typename scalar_t>
class ResampledBlocks {
  using opmath = opmath_t<scalar_t>;
  static constexpr bool kWidened = !std::is_same_v<scalar_t, opmath>;

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
      opmath* row = buffer_.data() + p * width;
      const int64_t token = first + p;
      if (token >= prefix) {
        resampler_.resample((token - prefix) / out_cols, (token - prefix) % out_cols, row);
      } else if constexpr (kWidened) {
        widen(problem_.table + token * width, row, width);
      } else {
        std::copy_n(problem_.table + token * width, width, row);
      }
    }
    first_ = first;
  }

  void add(int64_t count, const scalar_t* const* in, int64_t position, scalar_t* const* out, int64_t width,
           opmath scale, RowStores stores) const {
    add_rows(count, in, buffer_.data() + (position - first_) * width, out, width, width, scale, stores);
  }

 private:
  const AddResampledProblem<scalar_t>& problem_;
  GridRowResampler<scalar_t> resampler_;
  ScratchVector<opmath> buffer_;
  int64_t first_ = 0;
};

template <typename scalar_t>
void add_resampled_kernel(const AddResampledProblem<scalar_t>& problem) {
  const auto& grid = problem.grid;
  const AxisTaps rows(grid.height, false);
  const AxisTaps cols(grid.width, false);
  const int64_t tokens = resampled_tokens(grid);
  const int64_t row_bytes = problem.width * static_cast<int64_t>(sizeof(opmath_t<scalar_t>));  // rows kept as floats
  const int64_t block = std::min(tokens, rows_per_block(row_bytes));
  add_to_rows(RowInput<scalar_t>{problem.in, nullptr}, problem.out, problem.rows, problem.width, tokens, block, 1.0,
              [&] { return ResampledBlocks<scalar_t>(problem, rows, cols, block); });
}

// to[w * to_stride + d] = the sum over blocks b < blocks of from[b * block + w * stride + d] (d < n, w < count) in
// float64, added in block order: up to eight blocks in one sweep over the count rows (sum_rows), then the next eight
// onto them, so that each block is read in one run of its rows.
template <typename scalar_t>
void sum_blocks(const scalar_t* from, int64_t blocks, int64_t block, int64_t count, int64_t stride, int64_t n,
                double* to, int64_t to_stride) {
  const scalar_t* rows[8];
  for (int64_t b = 0; b < blocks;) {
    const int64_t left = blocks - b;
    const int64_t m = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    for (int64_t w = 0; w < count; ++w) {
      for (int64_t k = 0; k < m; ++k) rows[k] = from + (b + k) * block + w * stride;
      double* acc = to + w * to_stride;
      switch (m) {
        case 8: sum_rows<8>(rows, acc, n, b > 0); break;
        case 4: sum_rows<4>(rows, acc, n, b > 0); break;
        case 2: sum_rows<2>(rows, acc, n, b > 0); break;
        default: sum_rows<1>(rows, acc, n, b > 0); break;
      }
    }
    b += m;
  }
}

// One input grid row i of the adjoint, over n channels: mid[w] = sum over the output rows h reading row i of
// rows(h, i) * sums[h, w], float64 [W, n], then out[j] = sum over the output columns w reading column j of
// cols(w, j) * mid[w], rounded once. grid_row(h) gives output grid row h's sums, its W rows `stride` apart; out's
// rows are `out_stride` apart.
template <typename scalar_t>
class AdjointRows {
 public:
  AdjointRows(const AxisTaps& rows, const AxisTaps& cols, int64_t out_cols, int64_t n)
      : rows_(rows), cols_(cols), out_cols_(out_cols), n_(n), mid_(out_cols * n), acc_(n),
        grid_rows_(rows.max_users), taps_(std::max(rows.max_users, cols.max_users)) {}

  template <typename GridRow>
  void run(int64_t i, const GridRow& grid_row, int64_t stride, scalar_t* out, int64_t out_stride) {
    const int64_t u0 = rows_.user_start[i];
    const int64_t users = rows_.user_start[i + 1] - u0;
    for (int64_t u = 0; u < users; ++u) grid_rows_[u] = grid_row(rows_.users[u0 + u]);
    for (int64_t w = 0; w < out_cols_; ++w) {
      for (int64_t u = 0; u < users; ++u) taps_[u] = grid_rows_[u] + w * stride;
      weighted_rows(&rows_.user_weights[u0], taps_.data(), users, mid_.data() + w * n_, n_);
    }
    for (int64_t j = 0; j + 1 < static_cast<int64_t>(cols_.user_start.size()); ++j) {
      const int64_t v0 = cols_.user_start[j];
      const int64_t readers = cols_.user_start[j + 1] - v0;
      for (int64_t v = 0; v < readers; ++v) taps_[v] = mid_.data() + cols_.users[v0 + v] * n_;
      weighted_rows(&cols_.user_weights[v0], taps_.data(), readers, acc_.data(), n_);
      round_row<scalar_t>(acc_.data(), out + j * out_stride, n_);
    }
  }

 private:
  const AxisTaps& rows_;
  const AxisTaps& cols_;
  int64_t out_cols_;
  int64_t n_;
  ScratchVector<double> mid_;
  ScratchVector<double> acc_;
  std::vector<const double*> grid_rows_;
  std::vector<const double*> taps_;
};

// The adjoint, the forward's passes transposed in reverse (AdjointRows), the gradient's leading blocks summed in block
// order first. Two ways to cut it into tasks:
// - by input grid rows, a run of them per thread: a task forms the sums of each output grid row its rows read, all
//   channels, where it first needs them, into a window of the last `window` formed (the output rows reading an input
//   row are a run whose ends never decrease). Up to window - 1 grid rows next to each cut are read by both sides, so
//   there the gradient is read twice.
// - by runs of channels, the whole sum formed first (float64 [tokens, width], written and read back).
// The first is taken where its gradient read twice is at most the sum's bytes (the sum first writes and reads them;
// the rows read twice fall on the tasks beside the cuts alone). Before, tasks were runs of channels only, each
// forming its sums in a window (up to 4 bytes of leading blocks) or from the sum formed first, each block read in
// pieces of a run's width (the window did not fit Zen 2's L2 either). Separate processes taking turns, 2 threads,
// Zen 2, by rows: DINOv2-L [8, 2117, 1024] bf16 4.0-4.7 -> 3.2-3.4 ms, fp16 4.3-4.5 -> 3.5, float32 4.9-5.3 ->
// 3.9, bf16 [1] 2.5-3.1 -> 2.1-2.5; ViT-B [8, 577, 768] 0.92-0.97 -> 0.84-0.90; ViT-B [32] takes the sum first (by
// rows 1.92-2.02 ms against 1.66-1.74: a quarter of its grid rows formed twice). Slower: a task's passes in runs of
// 128-512 channels (1.05-1.2x the time of whole rows), the sum first in runs of 64-256 channels (1.1-1.5x). Every
// sum of a channel is the same in any cut, and no task writes another's outputs.
constexpr int64_t kAdjointRunBytes = 2 * 1024 * 1024;  // a run's mid rows (the sum first) at most

template <typename scalar_t>
void resample_adjoint_kernel(const ResampleAdjointProblem<scalar_t>& problem) {
  const auto& grid = problem.grid;
  const int64_t width = problem.width;
  const int64_t prefix = grid.prefix;
  const int64_t out_cols = grid.width.out;
  const int64_t in_rows = grid.height.in;
  const int64_t in_cols = grid.width.in;
  const int64_t tokens = prefix + grid.height.out * out_cols;
  const int64_t block = tokens * width;
  const AxisTaps rows(grid.height, true);
  const AxisTaps cols(grid.width, true);
  const int64_t window = std::max<int64_t>(1, rows.max_users);
  const int64_t threads = num_threads();
  const int64_t row_bytes = out_cols * width * static_cast<int64_t>(sizeof(scalar_t));  // a grid row of one block
  const int64_t twice_read = (threads - 1) * (window - 1) * row_bytes * problem.leads;
  scalar_t* const grid_out = problem.out + prefix * width;
  if (threads <= in_rows && twice_read <= tokens * width * static_cast<int64_t>(sizeof(double))) {
    parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      AdjointRows<scalar_t> adjoint(rows, cols, out_cols, width);
      // grid row h's sums in slot h % window, [W, width]; not cleared: every slot is formed before it is read
      const std::unique_ptr<double[]> sums(new double[window * out_cols * width]);
      for (int64_t task = begin; task < end; ++task) {
        std::vector<int64_t> held(window, -1);
        if (task == 0) {
          for (int64_t t = 0; t < prefix; ++t) {
            sum_blocks(problem.grad + t * width, problem.leads, block, 1, 0, width, sums.get(), 0);
            round_row<scalar_t>(sums.get(), problem.out + t * width, width);
          }
        }
        const auto grid_row = [&](int64_t h) -> const double* {
          double* slot = sums.get() + (h % window) * out_cols * width;
          if (held[h % window] != h) {  // its W tokens are contiguous in each block: one run of each
            sum_blocks(problem.grad + (prefix + h * out_cols) * width, problem.leads, block, 1, 0, out_cols * width,
                       slot, 0);
            held[h % window] = h;
          }
          return slot;
        };
        for (int64_t i = in_rows * task / threads; i < in_rows * (task + 1) / threads; ++i) {
          adjoint.run(i, grid_row, width, grid_out + i * in_cols * width, width);
        }
      }
    });
    return;
  }
  const std::unique_ptr<double[]> summed(new double[block]);
  parallel_for(0, tokens, rows_per_task(width * problem.leads), [&](int64_t begin, int64_t end) {
    sum_blocks(problem.grad + begin * width, problem.leads, block, 1, 0, (end - begin) * width,
               summed.get() + begin * width, 0);
  });
  // runs of channels, one per thread or a multiple of the threads where a run's mid rows would pass
  // kAdjointRunBytes; a multiple of 16
  const int64_t most = std::max<int64_t>(16, kAdjointRunBytes / (out_cols * static_cast<int64_t>(sizeof(double))));
  const int64_t runs = threads * ((width + threads * most - 1) / (threads * most));
  const int64_t lanes = ((width + runs - 1) / runs + 15) / 16 * 16;
  parallel_for(0, (width + lanes - 1) / lanes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t run = begin; run < end; ++run) {
      const int64_t first = run * lanes;
      const int64_t n = std::min(lanes, width - first);
      AdjointRows<scalar_t> adjoint(rows, cols, out_cols, n);
      for (int64_t t = 0; t < prefix; ++t) {
        round_row<scalar_t>(summed.get() + t * width + first, problem.out + t * width + first, n);
      }
      const auto grid_row = [&](int64_t h) -> const double* {
        return summed.get() + (prefix + h * out_cols) * width + first;
      };
      for (int64_t i = 0; i < in_rows; ++i) {
        adjoint.run(i, grid_row, width, grid_out + i * in_cols * width + first, width);
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
