// Kernels of the rotary family, compiled once per CPU capability. Work is split over tokens; the
// coefficients of a token are formed once and reused by all its heads (and by q and k in rope_qk).
#include "cpu/kernels/capability.h"
#include "cpu/kernels/rope.h"

POSENC_KERNELS_BEGIN
#include "portable/angle.h"
#include "portable/rmsnorm.h"
#include "portable/rotary.h"
#include "portable/tiling.h"

namespace posenc::cpu {
inline namespace POSENC_CPU_CAPABILITY {
namespace {

using namespace posenc::portable;

// Token `index`'s position (one axis).
template <typename scalar_t>
double position_of(const RopeProblem<scalar_t>& problem, int64_t index) {
  return problem.positions != nullptr ? problem.positions[index] : static_cast<double>(problem.first_position + index);
}

// The kept table's row of a whole-number position: [cos | sin] of its pairs.
template <typename scalar_t>
const opmath_t<scalar_t>* kept_row(const RopeProblem<scalar_t>& problem, double position) {
  return problem.kept + static_cast<int64_t>(position) * 2 * problem.pairs;
}

// cos/sin of each pair of token `index` (the angle engine's row: one position, or one per axis; or the kept table's
// row of its position, the same bits), times the attention scale; sin negated for the inverse rotation.
template <typename scalar_t, typename opmath_t>
void angle_coeffs(const RopeProblem<scalar_t>& problem, int64_t index, opmath_t scale, opmath_t* cos,
                  opmath_t* sin) {
  const int64_t pairs = problem.pairs;
  const opmath_t* sin_from = sin;
  const opmath_t* cos_from = cos;
  if (problem.pair_axis == nullptr) {
    const double position = position_of(problem, index);
    if (problem.kept != nullptr) {
      cos_from = kept_row(problem, position);
      sin_from = cos_from + pairs;
    } else {
      sincos_row(position, problem.inv_freq, pairs, problem.max_abs_freq, sin, cos);
    }
  } else {
    sincos_row_axes(problem.positions + index * problem.n_axes, problem.n_axes, problem.pair_axis, problem.inv_freq,
                    pairs, problem.max_abs_freq, sin, cos);
  }
  const opmath_t sin_scale = problem.inverse ? -scale : scale;
  for (int64_t i = 0; i < pairs; ++i) {
    cos[i] = cos_from[i] * scale;
    sin[i] = sin_from[i] * sin_scale;
  }
}

// The backward's first pass over every head of a view's token: its gradient rows (from `grad`, the token's first
// row) rotated back and taken through the weights, with the token's channels x (maths precision, read from `input`)
// normalized (xhat = x * r, formed where it is used, not stored) and gz * xhat added to the chunk's weight gradient gw.
template <RopeLayout kLayout, typename scalar_t, typename opmath>
void rotate_back_heads(const RotaryView<scalar_t>& view, const scalar_t* grad, const RmsNormView<scalar_t, opmath>& norm,
                       const scalar_t* input, const opmath* inv_rms, PairCoeffs<opmath> k, int64_t pairs,
                       const opmath* x, opmath* gw, opmath* g) {
  const int64_t D = view.head_dim;
  const bool per_head = norm.group == D;
  for (int64_t h = 0; h < view.heads; ++h, grad += view.in_stride[2], x += D, g += D) {
    // The next token's rows of this head, gradient and input: 10% and 10% faster in A/Bs (float32 and bf16, one
    // thread); the forward, which reads each token once, ran slower with prefetches.
    if (view.in_stride[3] == 1) prefetch_row(grad + view.in_stride[1], D * sizeof(scalar_t));
    const scalar_t* next_input = input + norm.input_stride[1] + h * norm.input_stride[2];
    if (norm.input_stride[3] == 1) prefetch_row(next_input, D * sizeof(scalar_t));
    const int64_t w0 = per_head ? 0 : h * D;
    const opmath r = inv_rms[per_head ? h : 0];
    if (view.in_stride[3] == 1) {
      rms_rotate_back_row<kLayout, true>(grad, 1, k, pairs, D, x, r, norm.weight + w0, gw + w0, g);
    } else {
      rms_rotate_back_row<kLayout, false>(grad, view.in_stride[3], k, pairs, D, x, r, norm.weight + w0, gw + w0, g);
    }
  }
}

template <typename scalar_t, typename opmath>
void rotate_back_heads(RopeLayout layout, const RotaryView<scalar_t>& view, const scalar_t* grad,
                       const RmsNormView<scalar_t, opmath>& norm, const scalar_t* input, const opmath* inv_rms,
                       PairCoeffs<opmath> k, int64_t pairs, const opmath* x, opmath* gw, opmath* g) {
  if (layout == RopeLayout::Neox) {
    rotate_back_heads<RopeLayout::Neox>(view, grad, norm, input, inv_rms, k, pairs, x, gw, g);
  } else {
    rotate_back_heads<RopeLayout::Gptj>(view, grad, norm, input, inv_rms, k, pairs, x, gw, g);
  }
}

// A row of coefficients formed in the channels' order in `formed` [2 * pairs] (cos, then sin), each half put in
// neox_word_order into `row` (takes_words: bf16 only, in the baseline and AVX2 builds).
template <typename opmath>
void word_order_row(const opmath* formed, int64_t pairs, opmath* row) {
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
  if constexpr (std::is_same_v<opmath, float>) {
    word_order(formed, pairs, row);
    word_order(formed + pairs, pairs, row + pairs);
  }
#endif
}

// Positions shared by several batch rows: one table of [seq, 2 * pairs] coefficients (cos, then sin) for all of
// them, each row in neox_word_order where in_words; else none (each token forms its own).
template <typename scalar_t, typename opmath>
ScratchVector<opmath> coefficient_table(const RopeProblem<scalar_t>& problem, opmath scale, bool in_words) {
  const int64_t pairs = problem.pairs;
  if (!problem.shared_positions || problem.batch == 1) return {};
  ScratchVector<opmath> coeffs(problem.seq * 2 * pairs);
  // A sin/cos pair costs roughly as much as rotating 16 channels: weigh the grain accordingly.
  parallel_for(0, problem.seq, rows_per_task(pairs * 16), [&](int64_t begin, int64_t end) {
    SmallScratch<opmath> formed(in_words ? 2 * pairs : 0);
    for (int64_t s = begin; s < end; ++s) {
      opmath* row = &coeffs[s * 2 * pairs];
      opmath* into = in_words ? formed.data() : row;
      angle_coeffs(problem, s, scale, into, into + pairs);
      if (in_words) word_order_row(formed.data(), pairs, row);
    }
  });
  return coeffs;
}

// Where the tokens form their own rows but their positions take few values (an M-RoPE prompt's image tokens share
// their time position, each row of patches its height; [B, S] position ids repeat from row to row), the sin and cos
// of every pair at each integer value of their span [*lowest, *lowest + span), [span, 2 * pairs] (cos, then sin;
// each in neox_word_order where in_words), formed once for the tokens to gather from. Only where every position is
// an integer and every angle takes the fast reduction (or the data is float64, whose angles all take the exact one),
// so that a gathered row holds the bits its token would form itself, and the span is at most half the tokens; else
// none.
template <typename scalar_t, typename opmath>
ScratchVector<opmath> value_table(const RopeProblem<scalar_t>& problem, bool in_words, int64_t* lowest) {
  const int64_t tokens = problem.shared_positions ? problem.seq : problem.batch * problem.seq;
  if (problem.positions == nullptr || tokens < 2) return {};
  const double* positions = problem.positions;
  double low = positions[0], high = positions[0];
  bool integers = true;
  for (int64_t i = 0; i < tokens * problem.n_axes; ++i) {
    integers = integers && positions[i] == std::floor(positions[i]);  // NaN and infinities: false
    low = std::min(low, positions[i]);
    high = std::max(high, positions[i]);
  }
  const bool fast = std::max(-low, high) * problem.max_abs_freq <= kFastAngle || std::is_same_v<opmath, double>;
  if (!integers || !fast || high - low + 1 > tokens / 2) return {};
  const int64_t pairs = problem.pairs;
  const auto span = static_cast<int64_t>(high - low) + 1;
  *lowest = static_cast<int64_t>(low);
  ScratchVector<opmath> values(span * 2 * pairs);
  parallel_for(0, span, rows_per_task(pairs * 16), [&](int64_t begin, int64_t end) {
    SmallScratch<opmath> formed(in_words ? 2 * pairs : 0);
    for (int64_t v = begin; v < end; ++v) {
      opmath* row = &values[v * 2 * pairs];
      opmath* into = in_words ? formed.data() : row;
      sincos_row(low + v, problem.inv_freq, pairs, problem.max_abs_freq, into + pairs, into);
      if (in_words) word_order_row(formed.data(), pairs, row);
    }
  });
  return values;
}

// Pairs [begin, end) of a coefficient row, which all follow one axis.
struct AxisRun {
  int32_t axis;
  int64_t begin, end;
};

// The coefficient rows of a problem's tokens: a table shared by the batch when its positions are, else formed per
// token (or gathered from a value_table); q's rows (view scaled_view) times its query scale at the token's position
// when it has one.
template <typename scalar_t, typename opmath>
struct Coefficients {
  const RopeProblem<scalar_t>& problem;
  opmath scale;
  bool in_words;                  // the table's rows are in neox_word_order (takes_words)
  ScratchVector<opmath> table;    // [seq, 2 * pairs], or empty
  ScratchVector<opmath> q_table;  // the same rows scaled for q, or empty
  int64_t lowest = 0;
  ScratchVector<opmath> values;        // value_table's, where there is no table
  std::vector<AxisRun> runs;           // of values' pairs, by the axis they follow
  // The tokens' rows are the kept table's, as they are: one axis, no attention scale, a forward rotation. Separate
  // processes taking turns, q, k [1, 4096, 16|8, 128], 2 threads, Zen 2: rope_qk bf16 1.77-1.89 -> 1.59-1.68 ms, fp16
  // 1.04x (medians), float32 within noise; qk_norm_rope bf16 and float32 1.02-1.04x.
  bool reads_kept_rows = false;

  Coefficients(const RopeProblem<scalar_t>& p, opmath attention_scale)
      : problem(p), scale(attention_scale), in_words(takes_words(p)),
        table(coefficient_table(p, attention_scale, in_words)) {
    if (table.empty() && p.kept == nullptr) values = value_table<scalar_t, opmath>(p, in_words, &lowest);
    reads_kept_rows = table.empty() && p.kept != nullptr && p.pair_axis == nullptr && scale == opmath(1) && !p.inverse;
    if (!values.empty()) runs = axis_runs();
    if (table.empty() || p.scaled_view < 0) return;
    q_table.resize(table.size());
    for (int64_t s = 0; s < p.seq; ++s) scale_row(&table[s * 2 * p.pairs], query_factor(s), &q_table[s * 2 * p.pairs]);
  }

  // Whether a table's rows are formed in neox_word_order: every view a contiguous bf16 neox view whose pairs
  // rotates_bf16_words takes (the baseline and AVX2 builds), so that rotate_unit_heads and rotate_head_runs_by_words
  // read them as they are instead of reordering them once a token and view of every batch row. Separate processes
  // taking turns, AVX2 on a Zen 2, 2 threads: axial q, k [32, 1024, 16, 64] 1.04x, DINOv3's bhsd [16, 16, 1029, 64]
  // 1.03-1.05x, [2, 1024, 16, 64] on one thread 1.03x; the same bits.
  static bool takes_words(const RopeProblem<scalar_t>& p) {
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
    bool all = std::is_same_v<scalar_t, c10::BFloat16> && p.norms == nullptr && p.layout == RopeLayout::Neox &&
               rotates_bf16_words<RopeLayout::Neox>(p.pairs);
    for (int64_t v = 0; v < p.num_views; ++v) {
      all = all && p.views[v].in_stride[3] == 1 && p.views[v].out_stride[3] == 1;
    }
    return all;
#else
    return false;
#endif
  }

  opmath query_factor(int64_t index) const {
    return static_cast<opmath>(query_scale(position_of(problem, index), problem.q_scale));
  }

  void scale_row(const opmath* row, opmath factor, opmath* out) const {
    for (int64_t i = 0; i < 2 * problem.pairs; ++i) out[i] = row[i] * factor;
  }

  // Token n's rows, {every view's but q's, q's}, from the tables or formed in own [4 * pairs].
  std::pair<const opmath*, const opmath*> rows(int64_t n, opmath* own) const {
    const int64_t pairs = problem.pairs;
    const int64_t s = n % problem.seq;
    if (!table.empty()) return table_rows(s);
    const int64_t index = problem.shared_positions ? s : n;
    const opmath* row = own;
    if (reads_kept_rows) {
      row = kept_row(problem, position_of(problem, index));
    } else if (values.empty()) {
      angle_coeffs(problem, index, scale, own, own + pairs);
    } else {
      gather_values(index, own, own + pairs);
    }
    if (problem.scaled_view < 0) return {row, row};
    scale_row(row, query_factor(index), own + 2 * pairs);
    return {row, own + 2 * pairs};
  }

  // Runs of consecutive pairs that follow one axis, in the values' order (word order where in_words: the axes as
  // floats put in that order).
  std::vector<AxisRun> axis_runs() const {
    std::vector<float> axes(problem.pairs, 0.0f);
    if (problem.pair_axis != nullptr) std::copy_n(problem.pair_axis, problem.pairs, axes.begin());
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
    if (in_words) {
      const std::vector<float> channel_order = axes;
      word_order(channel_order.data(), problem.pairs, axes.data());
    }
#endif
    std::vector<AxisRun> runs;
    for (int64_t i = 0; i < problem.pairs; ++i) {
      const auto axis = static_cast<int32_t>(axes[i]);
      if (runs.empty() || runs.back().axis != axis) runs.push_back({axis, i, i});
      runs.back().end = i + 1;
    }
    return runs;
  }

  // Token `index`'s rows from the value table, a run of pairs at a time (a select per pair and axis, or a gather
  // per pair, cost most of what the table saved), times the scale as angle_coeffs scales them.
  void gather_values(int64_t index, opmath* cos, opmath* sin) const {
    const int64_t pairs = problem.pairs;
    const double* position = problem.positions + index * problem.n_axes;
    const opmath sin_scale = problem.inverse ? -scale : scale;
    for (const AxisRun& run : runs) {
      const opmath* row = &values[(static_cast<int64_t>(position[run.axis]) - lowest) * 2 * pairs];
      for (int64_t i = run.begin; i < run.end; ++i) {
        cos[i] = row[i] * scale;
        sin[i] = row[pairs + i] * sin_scale;
      }
    }
  }

  // Sequence index s's rows of the tables.
  std::pair<const opmath*, const opmath*> table_rows(int64_t s) const {
    const opmath* row = &table[s * 2 * problem.pairs];
    return {row, q_table.empty() ? row : &q_table[s * 2 * problem.pairs]};
  }

  // View v's rows of a token, from rows(): in word order where a table or the value table holds them so.
  PairCoeffs<opmath> of_view(int64_t v, std::pair<const opmath*, const opmath*> rows) const {
    const opmath* row = v == problem.scaled_view ? rows.second : rows.first;
    PairCoeffs<opmath> k{row, row + problem.pairs, row, row + problem.pairs};
    k.words = in_words && (!table.empty() || !values.empty());
    return k;
  }

  // View v's rows of sequence index s from the tables.
  PairCoeffs<opmath> of_table(int64_t v, int64_t s) const { return of_view(v, table_rows(s)); }
};

// Rows of a token's heads, channel step stride[3], widened into the contiguous row [heads * head_dim].
template <typename scalar_t, typename opmath>
void load_heads(const scalar_t* in, const int64_t* stride, int64_t heads, int64_t head_dim, opmath* row) {
  for (int64_t h = 0; h < heads; ++h, in += stride[2], row += head_dim) {
    if (stride[3] == 1) {
      widen(in, row, head_dim);
    } else {
      for (int64_t d = 0; d < head_dim; ++d) row[d] = to_opmath(in[d * stride[3]]);
    }
  }
}

// The backward's last step, after rotate_back_heads has formed the gradient g of xhat = x * r in the token's row:
// the gradient of x, r * (g - xhat * mean(g * xhat)) over each group (a head, or all of them), formed and stored
// head by head while the head's rows are in L1 (float32 rows past the caches where `stream`). Contiguous rows
// are stored as they are formed, without a pass through g (fp16 excepted: F16C narrows a row several times faster
// than the integer form rounds it value by value).
template <typename scalar_t, typename opmath>
void store_input_grad(const opmath* x, opmath* g, const opmath* inv_rms, int64_t group, scalar_t* out,
                      const int64_t* stride, int64_t heads, int64_t head_dim, bool stream) {
  opmath mean_dot = 0;
  for (int64_t h = 0; h < heads; ++h, out += stride[2]) {
    const int64_t first = h * head_dim;
    const opmath r = inv_rms[first / group];
    if (first % group == 0) mean_dot = normalized_dot(g + first, x + first, r, group) / static_cast<opmath>(group);
    if (stride[3] == 1 && !(stream && std::is_same_v<scalar_t, float>) && !std::is_same_v<scalar_t, c10::Half>) {
      rms_input_grad(x + first, g + first, head_dim, r, mean_dot, out);
      continue;
    }
    rms_input_grad(x + first, g + first, head_dim, r, mean_dot, g + first);
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (stream && stride[3] == 1) {
        store_streaming(g + first, out, head_dim);
        continue;
      }
    }
    if (stride[3] == 1) {
      narrow(g + first, out, head_dim);
    } else {
      for (int64_t d = 0; d < head_dim; ++d) out[d * stride[3]] = from_opmath<scalar_t>(g[first + d]);
    }
  }
}

// A token's channels [heads * head_dim] in maths precision: float32 heads side by side are read where they are,
// others widened into row.
template <typename scalar_t, typename opmath>
const opmath* token_channels(const scalar_t* in, const int64_t* stride, int64_t heads, int64_t head_dim, opmath* row) {
  if constexpr (std::is_same_v<scalar_t, opmath>) {
    if (stride[3] == 1 && stride[2] == head_dim) return in;
  }
  load_heads(in, stride, heads, head_dim, row);
  return row;
}

#if POSENC_CPU_CAPABILITY_INDEX == 2 && (defined(__x86_64__) || defined(__i386__))
// The inverse root mean square of each of `heads` rows of n floats (n a multiple of 16), 16 rows at a time: their lane
// sums (lane_sum's) accumulated side by side, independent chains where one row's would wait on each addition; folded
// by lane_sum's tree with two rows per addition; then 1 / sqrt(sum / n + eps) for the 16 in one vector. The same
// operations on the same values as lane_dot and inverse_rms row by row, so the same bits.
inline void inverse_rms_of_rows(const float* row, int64_t heads, int64_t n, float eps, float* inv_rms) {
  for (int64_t h0 = 0; h0 < heads; h0 += 16, row += 16 * n) {
    const int64_t count = std::min<int64_t>(16, heads - h0);
    __m512 v[16];
    for (int h = 0; h < 16; ++h) v[h] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      for (int h = 0; h < 16; ++h) {
        if (h >= count) break;
        const __m512 x = _mm512_loadu_ps(row + h * n + i);
        v[h] = _mm512_add_ps(v[h], _mm512_mul_ps(x, x));
      }
    }
    // lane j + lane j + 8: rows 2m and 2m + 1 side by side in w[m] (the masks of all lanes, here and below: GCC 12
    // warns of its own placeholder in the unmasked forms)
    __m512 w[8];
    for (int m = 0; m < 8; ++m) {
      w[m] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(0xFFFF, v[2 * m], v[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_maskz_shuffle_f32x4(0xFFFF, v[2 * m], v[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // + lane j + 4: rows 4m .. 4m + 3 in x[m], a 128-bit quarter each
    __m512 x[4];
    for (int m = 0; m < 4; ++m) {
      x[m] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(0xFFFF, w[2 * m], w[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_maskz_shuffle_f32x4(0xFFFF, w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    // + lane j + 2: quarter c holds rows c and c + 4 (z[0]), c + 8 and c + 12 (z[1]), two lanes each
    __m512 z[2];
    for (int m = 0; m < 2; ++m) {
      z[m] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // + lane 1: quarter c holds rows c, c + 4, c + 8, c + 12
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 mean = _mm512_div_ps(sums, _mm512_set1_ps(static_cast<float>(n)));
    const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                         _mm512_maskz_sqrt_ps(0xFFFF, _mm512_add_ps(mean, _mm512_set1_ps(eps))));
    const __m512i in_row_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_mask_storeu_ps(inv_rms + h0, static_cast<__mmask16>((1u << count) - 1),
                          _mm512_maskz_permutexvar_ps(0xFFFF, in_row_order, inverse));
  }
}
#elif POSENC_CPU_CAPABILITY_INDEX == 1 && (defined(__x86_64__) || defined(__i386__))
// The AVX2 build's inverse_rms_of_rows, 8 rows at a time: each row's 16 lane sums in two vectors (lanes j and j + 8),
// added; the fold's other steps across rows, as above; then one square root and one division for the 8, where the
// row-by-row loop's scalar ones took a fifth of the widening pass's samples on a Zen 2. The same bits. channels(h, i):
// row h's channels [i, i + 8).
template <typename Channels>
inline void inverse_rms_of_rows_from(const Channels& channels, int64_t heads, int64_t n, float eps, float* inv_rms) {
  for (int64_t h0 = 0; h0 < heads; h0 += 8) {
    const int64_t count = std::min<int64_t>(8, heads - h0);
    __m256 s[8];
    for (int h = 0; h < 8; ++h) {
      __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
      for (int64_t i = 0; h < count && i < n; i += 16) {
        const __m256 a = channels(h0 + h, i), b = channels(h0 + h, i + 8);
        low = _mm256_add_ps(low, _mm256_mul_ps(a, a));
        high = _mm256_add_ps(high, _mm256_mul_ps(b, b));
      }
      s[h] = _mm256_add_ps(low, high);  // lane j + lane j + 8
    }
    __m256 t[4];  // + lane j + 4: rows 2m and 2m + 1 in the halves of t[m]
    for (int m = 0; m < 4; ++m) {
      t[m] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * m], s[2 * m + 1], 0x20),
                           _mm256_permute2f128_ps(s[2 * m], s[2 * m + 1], 0x31));
    }
    __m256 u[2];  // + lane j + 2
    for (int m = 0; m < 2; ++m) {
      u[m] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // + lane 1: rows 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high
    const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256 mean = _mm256_div_ps(sums, _mm256_set1_ps(static_cast<float>(n)));
    const __m256 inverse =
        _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(_mm256_add_ps(mean, _mm256_set1_ps(eps))));
    alignas(32) float in_row_order[8];
    _mm256_store_ps(in_row_order, _mm256_permutevar8x32_ps(inverse, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    for (int64_t h = 0; h < count; ++h) inv_rms[h0 + h] = in_row_order[h];
  }
}

inline void inverse_rms_of_rows(const float* row, int64_t heads, int64_t n, float eps, float* inv_rms) {
  const auto channels = [&](int64_t h, int64_t i) { return _mm256_loadu_ps(row + h * n + i); };
  inverse_rms_of_rows_from(channels, heads, n, eps, inv_rms);
}
#endif

#if POSENC_CPU_CAPABILITY_INDEX == 2 && (defined(__x86_64__) || defined(__i386__))
// 16 values of a float32, bf16 or fp16 row in float32.
template <typename scalar_t>
inline __m512 load_floats(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return widen_halfx16(p);
  } else {
    return widen_bf16x16(p);
  }
}

// 16 floats stored as from_opmath rounds them (bf16: to nearest even in 32-bit lanes, NaN to 0x7FC0; fp16: by
// vcvtps2ph, which rounds as convert.h does).
template <typename scalar_t>
inline void store_floats(__m512 v, scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm512_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_maskz_cvtps_ph(0xFFFF, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(0xFFFF, bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_maskz_srli_epi32(
        0xFFFF, _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i kept = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(0xFFFF, kept));
  }
}

// The input gradient r * (g - xhat * mean_dot), xhat = x * r, of channels [c, c + 16) (rms_input_grad's formula).
inline __m512 input_grad16(const float* x, const float* g, int64_t c, __m512 r, __m512 mean_dot) {
  const __m512 xhat = _mm512_mul_ps(_mm512_loadu_ps(x + c), r);
  return _mm512_mul_ps(r, _mm512_sub_ps(_mm512_loadu_ps(g + c), _mm512_mul_ps(xhat, mean_dot)));
}

#if defined(POSENC_BF16_BY_AVX512BF16)
// The input gradient r * (g - xhat * mean_dot) of a bf16 head's n channels (a multiple of 32), stored rounded by
// vcvtne2ps2bf16 (convert.h), 32 a line past the caches where `stream` (out on a 64-byte line). Returns false, the
// head stored wrong, where a value rounds apart: the caller stores it again by the integer form.
POSENC_TARGET_AVX512BF16 inline bool store_input_grad_bf16(const float* x, const float* g, int64_t n, __m512 r,
                                                           __m512 mean_dot, c10::BFloat16* out, bool stream) {
  __mmask16 apart = 0;
  for (int64_t d = 0; d < n; d += 32) {
    const __m512 low = input_grad16(x, g, d, r, mean_dot);
    const __m512 high = input_grad16(x, g, d + 16, r, mean_dot);
    apart |= rounds_apart(low) | rounds_apart(high);
    store_bf16x32_line(low, high, out + d, stream);
  }
  return apart == 0;
}
#endif

// The backward of one contiguous head normalized on its own and rotated whole in neox pairs (pairs a multiple of 16),
// in two calls. neox_head_mean_dot: rms_rotate_back_row (g and gw), then normalized_dot (its 16 lanes in channel order,
// folded by lane_sum's tree) over the head's n channels, returned divided by n. store_neox_head_input_grad:
// rms_input_grad into out (past the caches from registers where `stream`, out on a 64-byte line: float32, bf16 rounded
// by AVX-512 BF16 or, in the AVX2 build, by integer operations, fp16 32 channels a line), or into g where out is null.
// The same operations on the same values, so the same bits; 1.1-1.2x faster than the loops GCC vectorizes (float32 at
// the bench shape, bf16 in cache). Always inlined: GCC called the fp16 one out of line, once a head, and the backward
// took 1.2-1.4x the time.
template <typename scalar_t>
__attribute__((always_inline)) inline float neox_head_mean_dot(const scalar_t* grad, PairCoeffs<float> k,
                                                               int64_t pairs, const float* x, float r, const float* w,
                                                               float* gw, float* g) {
  const __m512 vr = _mm512_set1_ps(r);
  // gw += gz * xhat and g = gz * w at channels [d, d + 16); returns g * xhat, the terms of normalized_dot
  const auto through_norm = [&](int64_t d, __m512 gz) {
    const __m512 xhat = _mm512_mul_ps(_mm512_loadu_ps(x + d), vr);
    _mm512_storeu_ps(gw + d, _mm512_add_ps(_mm512_loadu_ps(gw + d), _mm512_mul_ps(gz, xhat)));
    const __m512 gv = _mm512_mul_ps(gz, _mm512_loadu_ps(w + d));
    _mm512_storeu_ps(g + d, gv);
    return _mm512_mul_ps(gv, xhat);
  };
  // normalized_dot's lanes add channels 0, 16, ..., 2 * pairs - 16 in order: the first channels' terms as the loop
  // forms them, their partners' after it, from registers (the first kKept) or from g. Read back from g as they had
  // been written, the terms waited on the loop's stores: the backward took 1.06-1.10x the time.
  constexpr int64_t kKept = 8;
  __m512 partner_terms[kKept];
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; i += 16) {
    const __m512 a = load_floats(grad + i);
    const __m512 b = load_floats(grad + pairs + i);
    __m512 first, second;
    rotate_pairs16(a, b, k, i, first, second);
    lanes = _mm512_add_ps(lanes, through_norm(i, first));
    const __m512 partner = through_norm(pairs + i, second);
    if (i / 16 < kKept) partner_terms[i / 16] = partner;
  }
  for (int64_t i = 0; i < pairs; i += 16) {
    const int64_t d = pairs + i;
    lanes = _mm512_add_ps(lanes, i / 16 < kKept ? partner_terms[i / 16]
                                                : _mm512_mul_ps(_mm512_loadu_ps(g + d),
                                                                _mm512_mul_ps(_mm512_loadu_ps(x + d), vr)));
  }
  const __m256 eight = _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xFF, lanes, 0),
                                     _mm512_maskz_extractf32x8_ps(0xFF, lanes, 1));
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  const float dot = _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
  return dot / static_cast<float>(2 * pairs);
}

template <typename scalar_t>
__attribute__((always_inline)) inline void store_neox_head_input_grad(const float* x, float* g, int64_t n, float r,
                                                                      float mean_dot, scalar_t* out,
                                                                      bool by_instruction, bool stream) {
  const __m512 vr = _mm512_set1_ps(r);
  const __m512 vmean_dot = _mm512_set1_ps(mean_dot);
#if defined(POSENC_BF16_BY_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (by_instruction) {
      if (store_input_grad_bf16(x, g, n, vr, vmean_dot, out, stream)) return;
      if (stream) store_fence();  // its lines sent past the caches land before the loop below stores them again
    }
  }
#endif
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    if (stream && n % 32 == 0) {  // a line of 32 a step
      for (int64_t d = 0; d < n; d += 32) {
        const __m512 low = input_grad16(x, g, d, vr, vmean_dot);
        const __m512 high = input_grad16(x, g, d + 16, vr, vmean_dot);
        store_line(out + d, narrow_halfx32(low, high), true);
      }
      return;
    }
  }
  for (int64_t d = 0; d < n; d += 16) {
    const __m512 dx = input_grad16(x, g, d, vr, vmean_dot);
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (stream) {
        _mm512_stream_ps(out + d, dx);
        continue;
      }
    }
    if (out != nullptr) {
      store_floats(dx, out + d);
    } else {
      _mm512_storeu_ps(g + d, dx);
    }
  }
}
#elif POSENC_CPU_CAPABILITY_INDEX == 1 && (defined(__x86_64__) || defined(__i386__))
// 8 values of a float32, bf16 or fp16 row in float32 (the AVX2 build).
template <typename scalar_t>
inline __m256 load_floats(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return widen_halfx8(p);
  } else {
    return Bf16Vectors::widen(p);
  }
}

// 8 floats stored as from_opmath rounds them (bf16: convert.h's Bf16Vectors, one vector narrowed as two; fp16: by
// vcvtps2ph, which rounds as convert.h does).
template <typename scalar_t>
inline void store_floats(__m256 v, scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm256_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(Bf16Vectors::narrow(v, v)));
  }
}

// load_heads and inverse_rms_of_rows in one pass, for bf16 or fp16 heads of n contiguous channels (`head_stride`
// apart): each 8 widened in registers, stored into the token's row and squared there, not read back from the row.
// qk_norm_rope, q, k [4, 2048, 16|8, 128], Zen 2, 2 threads, separate processes taking turns: bf16 forward 1.06-1.09x
// (7.71-7.73 -> 7.08-7.29 ms), backward 1.06x, fp16 1.09x and 1.06-1.07x; in cache ([1, 256], one thread) the bf16
// forward 77 -> 71 ns a head.
template <typename scalar_t>
inline void widen_inverse_rms_of_heads(const scalar_t* in, int64_t head_stride, int64_t heads, int64_t n, float eps,
                                       float* row, float* inv_rms) {
  const auto channels = [&](int64_t h, int64_t i) {
    const __m256 v = load_floats(in + h * head_stride + i);
    _mm256_storeu_ps(row + h * n + i, v);
    return v;
  };
  inverse_rms_of_rows_from(channels, heads, n, eps, inv_rms);
}

// neox_head_mean_dot and store_neox_head_input_grad in the AVX2 build, 8 pairs a step: the same operations on the
// same values, the sum of normalized_dot's 16 lanes kept in two vectors (lanes 0-7 and 8-15) and folded by lane_sum's
// tree, so the same bits.
template <typename scalar_t>
__attribute__((always_inline)) inline float neox_head_mean_dot(const scalar_t* grad, PairCoeffs<float> k,
                                                               int64_t pairs, const float* x, float r, const float* w,
                                                               float* gw, float* g) {
  const __m256 vr = _mm256_set1_ps(r);
  const auto through_norm = [&](int64_t d, __m256 gz) {  // as the AVX-512 build's, 8 channels
    const __m256 xhat = _mm256_mul_ps(_mm256_loadu_ps(x + d), vr);
    _mm256_storeu_ps(gw + d, _mm256_add_ps(_mm256_loadu_ps(gw + d), _mm256_mul_ps(gz, xhat)));
    const __m256 gv = _mm256_mul_ps(gz, _mm256_loadu_ps(w + d));
    _mm256_storeu_ps(g + d, gv);
    return _mm256_mul_ps(gv, xhat);
  };
  // Channel c's term goes to lane c mod 16: low holds lanes 0-7, high 8-15. Two named vectors, 16 pairs a step:
  // an array of two indexed by the step lived on the stack, each sum waiting on the store of the one before
  // (separate processes taking turns, Zen 2, q, k [4, 2048, 16|8, 128], 2 threads: float32 1.04-1.19x, bf16 1.15x,
  // fp16 1.17-1.22x; one thread float32 1.10x; the same bits).
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
  const auto rotate_back8 = [&](int64_t i, __m256& lanes) {
    __m256 first, second;
    rotate_pairs8(load_floats(grad + i), load_floats(grad + pairs + i), k, i, first, second);
    lanes = _mm256_add_ps(lanes, through_norm(i, first));
    through_norm(pairs + i, second);
  };
  for (int64_t i = 0; i < pairs; i += 16) {  // pairs: a multiple of 16 (backward_by_vectors)
    rotate_back8(i, low);
    rotate_back8(i + 8, high);
  }
  const auto partner_term = [&](int64_t d) {
    return _mm256_mul_ps(_mm256_loadu_ps(g + d), _mm256_mul_ps(_mm256_loadu_ps(x + d), vr));
  };
  for (int64_t i = 0; i < pairs; i += 16) {  // the partners' terms after the first channels', read back from g
    low = _mm256_add_ps(low, partner_term(pairs + i));
    high = _mm256_add_ps(high, partner_term(pairs + i + 8));
  }
  const __m256 eight = _mm256_add_ps(low, high);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  const float dot = _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
  return dot / static_cast<float>(2 * pairs);
}

template <typename scalar_t>
__attribute__((always_inline)) inline void store_neox_head_input_grad(const float* x, float* g, int64_t n, float r,
                                                                      float mean_dot, scalar_t* out,
                                                                      bool /*by_instruction*/, bool stream) {
  const __m256 vr = _mm256_set1_ps(r);
  const __m256 vmean_dot = _mm256_set1_ps(mean_dot);
  const auto input_grad8 = [&](int64_t d) {
    const __m256 xhat = _mm256_mul_ps(_mm256_loadu_ps(x + d), vr);
    return _mm256_mul_ps(vr, _mm256_sub_ps(_mm256_loadu_ps(g + d), _mm256_mul_ps(xhat, vmean_dot)));
  };
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    if (stream && n % 32 == 0) {  // a line of 32 as two halves
      for (int64_t d = 0; d < n; d += 16) {
        store_half_line(out + d, narrow_halfx16(input_grad8(d), input_grad8(d + 8)), true);
      }
      return;
    }
  }
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    // 16 a step, two vectors rounded and packed together (store_floats rounds one vector as two); streamed, a line
    // as two halves. In-process A/B, q, k [4, 2048, 16|8, 128] fwd+bwd: 1.07-1.08x on 2 threads, 1.05x on one.
    if (out != nullptr && n % 16 == 0) {
      for (int64_t d = 0; d < n; d += 16) {
        if (stream) {
          Bf16Vectors::store_narrowed<true>(out + d, input_grad8(d), input_grad8(d + 8));
        } else {
          Bf16Vectors::store_narrowed<false>(out + d, input_grad8(d), input_grad8(d + 8));
        }
      }
      return;
    }
  }
  for (int64_t d = 0; d < n; d += 8) {
    const __m256 dx = input_grad8(d);
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (stream) {
        _mm256_stream_ps(out + d, dx);
        continue;
      }
    }
    if (out != nullptr) {
      store_floats(dx, out + d);
    } else {
      _mm256_storeu_ps(g + d, dx);
    }
  }
}
#endif

// The inverse root mean square of every group of a token's row. bf16 and fp16 rows, widened into a row in L1, go 16
// groups at a time in the AVX-512 build and 8 in the AVX2 build (inverse_rms_of_rows: at the bench shape of
// docs/benchmarks.md, 1.08-1.12x the whole bf16 forward on AVX-512, 1.05-1.07x on a Zen 2); float32 rows are read
// where they are, from memory, where reading 16 rows at once measured 1.3x slower and reading them one after the
// other no faster than this loop.
template <typename scalar_t, typename opmath>
void inverse_rms_of_groups(const opmath* row, int64_t width, const RmsNormView<scalar_t, opmath>& norm,
                           opmath* inv_rms) {
  const int64_t n = norm.group;
#if POSENC_CPU_CAPABILITY_INDEX >= 1 && (defined(__x86_64__) || defined(__i386__))
  if constexpr (std::is_same_v<opmath, float> && !std::is_same_v<scalar_t, float>) {
    if (n % 16 == 0) return inverse_rms_of_rows(row, width / n, n, norm.eps, inv_rms);
  }
#endif
  for (int64_t g = 0; g * n < width; ++g) inv_rms[g] = inverse_rms(lane_dot(row + g * n, row + g * n, n), n, norm.eps);
}

// A token's channels in maths precision (token_channels) and the inverse RMS of each of their groups
// (inverse_rms_of_groups); in the AVX2 build, bf16 and fp16 heads normalized on their own in one pass.
template <typename scalar_t, typename opmath>
const opmath* normalized_channels(const scalar_t* in, const int64_t* stride, int64_t heads, int64_t head_dim,
                                  const RmsNormView<scalar_t, opmath>& norm, opmath* row, opmath* inv_rms) {
#if POSENC_CPU_CAPABILITY_INDEX == 1 && (defined(__x86_64__) || defined(__i386__))
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
    if (stride[3] == 1 && norm.group == head_dim && head_dim % 16 == 0) {
      widen_inverse_rms_of_heads(in, stride[2], heads, head_dim, norm.eps, row, inv_rms);
      return row;
    }
  }
#endif
  const opmath* x = token_channels(in, stride, heads, head_dim, row);
  inverse_rms_of_groups(x, heads * head_dim, norm, inv_rms);
  return x;
}

// Whether norm_rope_kernel's backward takes a view's heads through neox_head_mean_dot (AVX2 and AVX-512
// builds; float32, bf16 and fp16): contiguous heads normalized on their own and rotated whole in neox pairs, 16 or more.
template <typename scalar_t, typename opmath>
bool backward_by_vectors(const RotaryView<scalar_t>& view, const RmsNormView<scalar_t, opmath>& norm, RopeLayout layout,
                         int64_t pairs) {
#if POSENC_CPU_CAPABILITY_INDEX >= 1 && (defined(__x86_64__) || defined(__i386__))
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                std::is_same_v<scalar_t, c10::Half>) {
    return layout == RopeLayout::Neox && norm.group == view.head_dim && 2 * pairs == view.head_dim &&
           pairs % 16 == 0 && view.in_stride[3] == 1 && view.out_stride[3] == 1;
  }
#endif
  return false;
}

// The backward of a token's heads where backward_by_vectors: rotate_back_heads and store_input_grad, head by head,
// each head's input gradient stored after the next head's first call. Its mean_dot ends a chain of additions, a fold
// and a division, which stores made at once waited on. In-process A/B, q, k [4, 2048, 16|8, 128], 1 and 2 threads:
// bf16 1.04-1.08x and fp16 1.04-1.06x faster (AVX2 build 1.17x and 1.05-1.06x), float32, streamed, 0.99-1.01x; in
// cache ([4, 64, ...]) 1.03x float32, 1.14-1.25x bf16 and fp16; the same bits. float32 rows stored past the caches
// go from registers where they start on a line (through g, then store_streaming, they took 1.11-1.13x the time:
// in-process A/B, float32 [4, 2048, 16|8, 128], 1 and 2 threads).
template <typename scalar_t, typename opmath>
void backward_heads_by_vectors(const RotaryView<scalar_t>& view, const scalar_t* grad,
                               const RmsNormView<scalar_t, opmath>& norm, const scalar_t* input, const opmath* inv_rms,
                               PairCoeffs<opmath> k, int64_t pairs, const opmath* x, opmath* gw, opmath* g,
                               scalar_t* out, bool by_instruction) {
#if POSENC_CPU_CAPABILITY_INDEX >= 1 && (defined(__x86_64__) || defined(__i386__))
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                std::is_same_v<scalar_t, c10::Half>) {
    const int64_t D = view.head_dim;
    const auto store_head = [&](int64_t h, float mean_dot) {
      scalar_t* head_out = out + h * view.out_stride[2];
      const bool direct = view.stream && reinterpret_cast<uintptr_t>(head_out) % 64 == 0;
      constexpr bool kFloat = std::is_same_v<scalar_t, float>;
      store_neox_head_input_grad(x + h * D, g + h * D, D, inv_rms[h], mean_dot,
                                 kFloat && view.stream && !direct ? nullptr : head_out, by_instruction, direct);
      if constexpr (kFloat) {
        if (view.stream && !direct) store_streaming(g + h * D, head_out, D);
      }
    };
    float mean_dot = 0;
    for (int64_t h = 0; h < view.heads; ++h) {
      const scalar_t* head_grad = grad + h * view.in_stride[2];
      // the next token's rows of this head, as rotate_back_heads asks for them
      prefetch_row(head_grad + view.in_stride[1], D * sizeof(scalar_t));
      if (norm.input_stride[3] == 1) {
        prefetch_row(input + norm.input_stride[1] + h * norm.input_stride[2], D * sizeof(scalar_t));
      }
      const float next = neox_head_mean_dot(head_grad, k, pairs, x + h * D, inv_rms[h], norm.weight, gw, g + h * D);
      if (h > 0) store_head(h - 1, mean_dot);
      mean_dot = next;
    }
    if (view.heads > 0) store_head(view.heads - 1, mean_dot);  // the last head's, after the loop
  }
#endif
}

// Whether norm_rope_kernel rounds a view's bf16 values by AVX-512 BF16 (the forward's normalized heads, rmsnorm.h;
// the backward's input gradients, store_input_grad_bf16): contiguous heads rotated whole in neox pairs, 16 or more,
// on a CPU that has it.
template <typename scalar_t>
bool rounds_by_instruction(const RotaryView<scalar_t>& view, RopeLayout layout, int64_t pairs) {
#if defined(POSENC_BF16_BY_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return layout == RopeLayout::Neox && view.out_stride[3] == 1 && 2 * pairs == view.head_dim && pairs % 16 == 0 &&
           has_avx512_bf16();
  }
#endif
  return false;
}

// What the forward knows of a token's view before it rounds by AVX-512 BF16 (rounds_by_instruction): the
// magnitudes of its channels and of its weights, for rounds_clean.
struct RoundingBounds {
#if defined(POSENC_BF16_BY_AVX512BF16)
  Magnitudes x = kUnknownMagnitudes;
  Magnitudes weight = kUnknownMagnitudes;
#endif
};

#if defined(POSENC_BF16_BY_AVX512BF16)
// A token's view's RoundingBounds: `weight` (the view's, once per call) with the magnitudes of the token's channels,
// read from their bf16 bits where its heads' channels are contiguous (in L1: the widening has just read them).
template <typename scalar_t>
RoundingBounds token_rounding_bounds(RoundingBounds weight, const scalar_t* in, const int64_t* stride, int64_t heads,
                                     int64_t head_dim) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (stride[3] == 1 && head_dim % 32 == 0) {
      BFloat16Magnitudes channels;
      for (int64_t h = 0; h < heads; ++h) channels.add(in + h * stride[2], head_dim);
      weight.x = channels.get();
    }
  }
  return weight;
}

// normalize_rotate_heads of the views rounds_by_instruction picks: each head rounded by vcvtne2ps2bf16, checked and
// redone by the integer form where a denormal or a NaN met there asks for it (rmsnorm.h), or unchecked where
// rounds_clean proves the token's heads clean. The proof costs a pass over the token's bf16 channels and one over its
// coefficients; in-process A/B on Zen 4, q, k [4, 2048, 16|8, 128]: "llama" 1.07-1.17x the forward (1.17-1.18x in
// cache), "gemma" 1.05x (1.14x), "olmo2" 1.10x (1.14x), "fused", which checks only its outputs, 1.00x; the same bits.
template <QkNorm kConvention>
POSENC_TARGET_AVX512BF16 void normalize_rotate_neox_bf16(const float* x, const RmsNormView<c10::BFloat16, float>& norm,
                                                         const float* inv_rms, PairCoeffs<float> k, int64_t pairs,
                                                         const RotaryView<c10::BFloat16>& view, c10::BFloat16* out,
                                                         const c10::BFloat16* next, const RoundingBounds& bounds) {
  const int64_t D = view.head_dim;
  const bool per_head = norm.group == D;
  const int64_t groups = per_head ? view.heads : 1;
  float r_least = inv_rms[0], r_largest = inv_rms[0];
  for (int64_t g = 1; g < groups; ++g) {  // a NaN kept, where std::min and std::max would drop it
    if (!(inv_rms[g] >= r_least)) r_least = inv_rms[g];
    if (!(inv_rms[g] <= r_largest)) r_largest = inv_rms[g];
  }
  FloatMagnitudes coefficients;
  coefficients.add(k.c1, pairs);
  coefficients.add(k.s1, pairs);
  if (!shares_rows(k)) {
    coefficients.add(k.c2, pairs);
    coefficients.add(k.s2, pairs);
  }
  const bool clean = rounds_clean<kConvention>(bounds.x, r_least, r_largest, bounds.weight, coefficients.get());
  for (int64_t h = 0; h < view.heads; ++h, x += D, out += view.out_stride[2]) {
    const float* w = per_head ? norm.weight : norm.weight + h * D;
    const float r = inv_rms[per_head ? h : 0];
    if (next != nullptr) prefetch_row(next + h * view.in_stride[2], D * sizeof(c10::BFloat16));
    const bool stream = view.stream && reinterpret_cast<uintptr_t>(out) % 64 == 0;
    if (clean) {
      rms_scale_rotate_neox_bf16<kConvention, false>(x, w, r, k, pairs, out, stream);
    } else {
      rms_scale_rotate_neox_bf16<kConvention, true>(x, w, r, k, pairs, out, stream);
    }
  }
}
#endif

// Every head of a view's token, from its channels x ([heads * head_dim], maths precision): normalized, rotated and
// stored (the forward of qk_norm_rope). Where the inputs are past the caches, `next` is the next token's rows (its
// heads side by side, bshd), asked for a head at a time as this token's heads are stored: a token's rows are a page
// or two, where the hardware prefetchers stop (a bhsd head's rows follow one another, and they follow those). All
// asked for at once, before the token, the requests filled the core's line buffers and its loads waited behind them.
// A head at a time, with the AVX-512 build's bf16 and fp16 heads sent past the caches as whole lines, in-process A/B
// on a 2-core Emerald Rapids guest, q, k [4, 2048, 16|8, 128] over the copy bound: bf16 1.61 -> 1.40 (2 threads) and
// 1.71 -> 1.36 (one), fp16 1.96 -> 1.21 and 2.17 -> 1.50, float32 0.97 -> 0.91; either change alone gained bf16
// little (1.62-1.69). AVX2 bf16 2.46 -> 2.20, the baseline's float32 1.35 -> 1.09.
template <RopeLayout kLayout, QkNorm kConvention, typename scalar_t, typename opmath>
void normalize_rotate_heads(const opmath* x, const RmsNormView<scalar_t, opmath>& norm, const opmath* inv_rms,
                            PairCoeffs<opmath> k, int64_t pairs, const RotaryView<scalar_t>& view, scalar_t* out,
                            const scalar_t* next, const RoundingBounds* by_instruction) {
  const int64_t D = view.head_dim;
  const bool per_head = norm.group == D;
#if defined(POSENC_BF16_BY_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kLayout == RopeLayout::Neox) {
    if (by_instruction != nullptr) {
      return normalize_rotate_neox_bf16<kConvention>(x, norm, inv_rms, k, pairs, view, out, next, *by_instruction);
    }
  }
#endif
  for (int64_t h = 0; h < view.heads; ++h, x += D, out += view.out_stride[2]) {
    const opmath* w = per_head ? norm.weight : norm.weight + h * D;
    const opmath r = inv_rms[per_head ? h : 0];
    if (next != nullptr) prefetch_row(next + h * view.in_stride[2], D * sizeof(scalar_t));
#if POSENC_CPU_CAPABILITY_INDEX >= 1 && (defined(__x86_64__) || defined(__i386__))
    if constexpr (std::is_same_v<scalar_t, float> && kLayout == RopeLayout::Neox) {
      if (view.stream && view.out_stride[3] == 1 && pairs % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0) {
        rms_scale_rotate_neox_f32_streamed(x, w, r, k, pairs, D, out);
        continue;
      }
    }
#endif
#if POSENC_CPU_CAPABILITY_INDEX == 0
    // The baseline's float32 heads past the caches through a row in L1, as its token walk streams them: separate
    // processes, q, k [4, 2048, 16|8, 128], 2 threads, 14 pairs in a noisy hour: 0.78-1.84x, median 1.09x, the
    // fastest calls 8.9 against 11.9 ms.
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (view.stream && view.out_stride[3] == 1 && D <= kStreamedRowChannels) {
        alignas(64) float row[kStreamedRowChannels];
        rms_scale_rotate_row<kLayout, kConvention, true>(x, w, r, k, pairs, D, row, 1);
        store_streaming(row, out, D);
        continue;
      }
    }
#endif
#if defined(POSENC_HAS_F16C) && POSENC_CPU_CAPABILITY_INDEX >= 1
    if constexpr (std::is_same_v<scalar_t, c10::Half> && kLayout == RopeLayout::Neox) {
      if (view.out_stride[3] == 1 && pairs % (POSENC_CPU_CAPABILITY_INDEX == 2 ? 16 : 8) == 0) {
        rms_scale_rotate_neox_half<kConvention>(x, w, r, k, pairs, D, out,
                                                view.stream && reinterpret_cast<uintptr_t>(out) % 64 == 0);
        continue;
      }
    }
#endif
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kLayout == RopeLayout::Neox) {
      if (view.out_stride[3] == 1 && pairs % (2 * Bf16Vectors::kLanes) == 0) {
        rms_scale_rotate_neox_bf16_vectors<kConvention>(x, w, r, k, pairs, D, out);
        continue;
      }
    }
#endif
    if (view.out_stride[3] == 1) {
      rms_scale_rotate_row<kLayout, kConvention, true>(x, w, r, k, pairs, D, out, 1);
    } else {
      rms_scale_rotate_row<kLayout, kConvention, false>(x, w, r, k, pairs, D, out, view.out_stride[3]);
    }
  }
}

template <RopeLayout kLayout, typename scalar_t, typename opmath>
void normalize_rotate_heads(const opmath* x, const RmsNormView<scalar_t, opmath>& norm, const opmath* inv_rms,
                            PairCoeffs<opmath> k, int64_t pairs, const RotaryView<scalar_t>& view, scalar_t* out,
                            const scalar_t* next, const RoundingBounds* by_instruction) {
  constexpr auto kLlama = QkNorm::Llama, kGemma = QkNorm::Gemma, kOlmo2 = QkNorm::Olmo2, kFused = QkNorm::Fused;
  switch (norm.convention) {
    case kLlama:
      return normalize_rotate_heads<kLayout, kLlama>(x, norm, inv_rms, k, pairs, view, out, next, by_instruction);
    case kGemma:
      return normalize_rotate_heads<kLayout, kGemma>(x, norm, inv_rms, k, pairs, view, out, next, by_instruction);
    case kOlmo2:
      return normalize_rotate_heads<kLayout, kOlmo2>(x, norm, inv_rms, k, pairs, view, out, next, by_instruction);
    case kFused:
      return normalize_rotate_heads<kLayout, kFused>(x, norm, inv_rms, k, pairs, view, out, next, by_instruction);
  }
}

template <typename scalar_t, typename opmath>
void normalize_rotate_heads(RopeLayout layout, const opmath* x, const RmsNormView<scalar_t, opmath>& norm,
                            const opmath* inv_rms, PairCoeffs<opmath> k, int64_t pairs,
                            const RotaryView<scalar_t>& view, scalar_t* out, const scalar_t* next,
                            const RoundingBounds* by_instruction) {
  if (layout == RopeLayout::Neox) {
    normalize_rotate_heads<RopeLayout::Neox>(x, norm, inv_rms, k, pairs, view, out, next, by_instruction);
  } else {
    normalize_rotate_heads<RopeLayout::Gptj>(x, norm, inv_rms, k, pairs, view, out, next, by_instruction);
  }
}

// qk_norm_rope: every view's token rows gathered into one row of maths precision, normalized group by group,
// rotated head by head and stored; inverse: the backward, the gradient rotated back, then through the norm.
template <typename scalar_t>
void norm_rope_kernel(const RopeProblem<scalar_t>& problem) {
  using opmath = opmath_t<scalar_t>;
  const int64_t pairs = problem.pairs;
  const int64_t seq = problem.seq;
  const int64_t tokens = problem.batch * seq;
  const auto scale = static_cast<opmath>(problem.attention_scale);
  int64_t width = 0;
  int64_t min_group = width;
  int64_t input_bytes = 0;
  for (int64_t v = 0; v < problem.num_views; ++v) {
    const int64_t channels = problem.views[v].heads * problem.views[v].head_dim;
    min_group = v == 0 ? problem.norms[v].group : std::min(min_group, problem.norms[v].group);
    width = std::max(width, channels);
    input_bytes += tokens * channels * static_cast<int64_t>(sizeof(scalar_t));
  }
  const bool prefetches = !problem.inverse && past_caches(input_bytes);  // the next token (normalize_rotate_heads)
  const int64_t chunk = norm_tokens_per_chunk(tokens);
  const int64_t chunks = (tokens + chunk - 1) / chunk;
  const Coefficients<scalar_t, opmath> coefficients(problem, scale);
  std::vector<ScratchVector<opmath>> partial;  // backward: [chunks, group] per view
  std::vector<char> by_instruction(problem.num_views);  // rounds_by_instruction per view
  std::vector<RoundingBounds> weight_bounds(problem.num_views);  // forward: the magnitudes of each view's weights
  for (int64_t v = 0; v < problem.num_views; ++v) {
    by_instruction[v] = rounds_by_instruction(problem.views[v], problem.layout, pairs);
#if defined(POSENC_BF16_BY_AVX512BF16)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (by_instruction[v] && !problem.inverse) {
        FloatMagnitudes weight;
        weight.add(problem.norms[v].weight, problem.norms[v].group);
        weight_bounds[v].weight = weight.get();
      }
    }
#endif
  }
  for (int64_t v = 0; problem.inverse && v < problem.num_views; ++v) partial.emplace_back(chunks * problem.norms[v].group);
  std::vector<char> by_vectors(problem.num_views);  // backward: backward_by_vectors per view
  for (int64_t v = 0; problem.inverse && v < problem.num_views; ++v) {
    by_vectors[v] = backward_by_vectors(problem.views[v], problem.norms[v], problem.layout, pairs);
  }

  // Views [first_view, last_view) of every token.
  const auto walk = [&](int64_t first_view, int64_t last_view) {
    int64_t token_work = 0;
    for (int64_t v = first_view; v < last_view; ++v) {
      token_work += 4 * problem.views[v].heads * problem.views[v].head_dim;
    }
    parallel_for(0, chunks, std::max<int64_t>(1, rows_per_task(token_work) / chunk), [&](int64_t begin, int64_t end) {
      SmallScratch<opmath> own(4 * pairs + 2 * width + width / min_group);
      opmath* coeff_rows = own.data();
      opmath* row = coeff_rows + 4 * pairs;
      opmath* grad = row + width;
      opmath* inv_rms = grad + width;  // of each group of the row
      for (int64_t n = begin * chunk; n < std::min(end * chunk, tokens); ++n) {
        const int64_t b = n / seq;
        const int64_t s = n % seq;
        const auto token_rows = coefficients.rows(n, coeff_rows);
        for (int64_t v = first_view; v < last_view; ++v) {
          const auto k = coefficients.of_view(v, token_rows);
          const auto& view = problem.views[v];
          const auto& norm = problem.norms[v];
          const int64_t H = view.heads;
          const int64_t D = view.head_dim;
          const scalar_t* in = view.in + b * view.in_stride[0] + s * view.in_stride[1];
          scalar_t* out = view.out + b * view.out_stride[0] + s * view.out_stride[1];
          if (!problem.inverse) {
            const scalar_t* next = nullptr;
            if (prefetches && n + 1 < tokens && view.in_stride[3] == 1 && view.in_stride[2] == D) {
              next = in + (s + 1 < seq ? view.in_stride[1] : view.in_stride[0] - s * view.in_stride[1]);
            }
            const opmath* x = normalized_channels(in, view.in_stride, H, D, norm, row, inv_rms);
            RoundingBounds bounds;
#if defined(POSENC_BF16_BY_AVX512BF16)
            if (by_instruction[v]) bounds = token_rounding_bounds(weight_bounds[v], in, view.in_stride, H, D);
#endif
            normalize_rotate_heads(problem.layout, x, norm, inv_rms, k, pairs, view, out, next,
                                   by_instruction[v] ? &bounds : nullptr);
            continue;
          }
          const scalar_t* input = norm.input + b * norm.input_stride[0] + s * norm.input_stride[1];
          const opmath* x = normalized_channels(input, norm.input_stride, H, D, norm, row, inv_rms);
          opmath* weight_grad = &partial[v][(n / chunk) * norm.group];
          if (by_vectors[v]) {
            backward_heads_by_vectors(view, in, norm, input, inv_rms, k, pairs, x, weight_grad, grad, out,
                                      by_instruction[v]);
            continue;
          }
          rotate_back_heads(problem.layout, view, in, norm, input, inv_rms, k, pairs, x, weight_grad, grad);
          store_input_grad(x, grad, inv_rms, norm.group, out, view.out_stride, H, D, view.stream);
        }
      }
      store_fence();
    });
  };
  // Coefficients from a table: a view at a time, as rope_kernel walks them (q's streams, then k's: 20-30% faster
  // forward for float32 and "gemma" bf16 in an A/B on one thread, the backward unchanged). Else both views of a
  // token together, its coefficients formed once.
  if (coefficients.table.empty()) {
    walk(0, problem.num_views);
  } else {
    for (int64_t v = 0; v < problem.num_views; ++v) walk(v, v + 1);
  }
  for (int64_t v = 0; v < static_cast<int64_t>(partial.size()); ++v) {
    const auto& norm = problem.norms[v];
    parallel_for(0, norm.group, rows_per_task(chunks), [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        double sum = 0;
        for (int64_t c = 0; c < chunks; ++c) sum += partial[v][c * norm.group + j];
        norm.weight_grad[j] = static_cast<opmath>(sum);
      }
    });
  }
}

// Whether a view is rotated head by head over a tile of tokens (kHeadsPerRun heads at a time) rather than token by
// token: where the input's heads lie further apart than its tokens (bhsd in memory) and sequences have more than one
// token, each head's rows of the tile are then one contiguous run in (and one out, for a bhsd output). Out of place
// and in place alike: in place, four heads at a time against the token walk were 1.4-1.7x faster in float32 and
// bf16 on 2 threads, 1.3-2.2x on one, 1.1x in fp16 (DINOv3 and Flux-like bhsd shapes, in-process A/B; one head at
// a time had been 10-20% slower there). A decoding step (one token per sequence: no runs to gain) keeps the token
// walk, as do Hugging Face's bhsd views of bshd memory (q.transpose(1, 2)), whose inputs are a token's heads side
// by side: walked head by head there, bf16 was 7-10% slower.
template <typename scalar_t>
bool head_by_head(const RotaryView<scalar_t>& v, int64_t seq) {
  return seq > 1 && v.heads > 1 && v.in_stride[2] > v.in_stride[1];
}

// Heads walked together over a tile of tokens: their rows are that many runs read (and written) side by side. In
// in-process A/Bs (bhsd q and k, out of place; DINOv3 [16, 16, 1029, 64] and [1, ...], Flux-like [1, 24, 4608, 128],
// axial gptj [32, 16, 1024, 64]) four heads against one were 1.1-1.8x faster in bf16, 0.97-1.8x in float32 and
// 1.1x in fp16 (1 and 2 threads); two were halfway, six and eight no faster or slower. With four runs in flight
// asking for the next row gained nothing; only streamed bf16 gptj runs ask, 1 KiB ahead (kRunReadAheadBytes).
constexpr int64_t kHeadsPerRun = 4;

// How far ahead of its loads a streamed bf16 gptj run asks for its rows' input lines (rotate_head_run_bf16): with
// the output going past the caches the hardware prefetchers fell behind. In-process A/B, Flux-like bhsd q, k
// [32, 16, 1024, 64] bf16: 1.14-1.18x on 2 threads and one where the memory was in its slower state, 1.00-1.02 in
// its faster (0.5-1.5 KiB ahead alike, 2 KiB 1.14x, 4 KiB 1.03x). The other runs (float32, fp16, bf16 neox in the
// integer form) gained 0.94-1.09x that way and do not ask.
constexpr int64_t kRunReadAheadBytes = 1024;

// Heads [h, h + count) of tokens [first, last) of a view whose rows are contiguous, kPairs pairs each (0: any
// count); coeffs(n, s) gives token n's coefficients (s = n mod seq). A bhsd head's rows follow each other: the loop
// steps from row to row of a batch row without dividing by seq (a division per row of 64 channels made the walk
// 10-20% slower).
template <RopeLayout kLayout, int64_t kPairs, bool kWords = false, typename scalar_t, typename CoeffsOf>
void rotate_head_run(const RotaryView<scalar_t>& v, int64_t h, int64_t count, int64_t first, int64_t last,
                     int64_t seq, int64_t pairs, const CoeffsOf& coeffs) {
  for (int64_t n = first; n < last;) {
    const int64_t b = n / seq;
    const int64_t run_end = std::min(last, (b + 1) * seq);
    const scalar_t* in = v.in + b * v.in_stride[0] + (n - b * seq) * v.in_stride[1] + h * v.in_stride[2];
    for (; n < run_end; ++n, in += v.in_stride[1]) {
      const int64_t s = n - b * seq;
      scalar_t* out = output_token(v, b, s);
      if (out == nullptr) continue;
      out += h * v.out_stride[2];
      const auto k = coeffs(n, s);
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
      if constexpr (kWords) {
        for (int64_t g = 0; g < count; ++g) {
          rotate_bf16_words_row<kLayout, kPairs>(v, in + g * v.in_stride[2], out + g * v.out_stride[2], k, pairs);
        }
        continue;
      }
#endif
      for (int64_t g = 0; g < count; ++g) {
        const scalar_t* head_in = in + g * v.in_stride[2];
        scalar_t* head_out = out + g * v.out_stride[2];
        if constexpr (std::is_same_v<scalar_t, c10::Half>) {
          rotate_half_head<kLayout>(v, head_in, head_out, k, pairs);
#if defined(POSENC_ROTATES_F32_STREAMED_FROM_REGISTERS)
        } else if (streams_from_registers(v, head_in, head_out, pairs)) {
          if constexpr (std::is_same_v<scalar_t, float>) {  // the test above holds only for float32
            rotate_f32_row_streamed<kLayout>(head_in, head_out, k, pairs, v.head_dim);
          }
#endif
        } else {  // bf16 rows that would stream go by rotate_head_runs_by_words (their pairs fill whole words)
          rotate_contiguous_row<kLayout, kPairs>(head_in, head_out, k, pairs, v.head_dim);
        }
      }
    }
  }
}

// Whether a bf16 view's tokens are rotated by rotate_heads_bf16 (rounded by AVX-512 BF16): rows contiguous, pairs a
// multiple of 16, on a CPU that has it.
template <typename scalar_t>
bool rotates_by_instruction(const RotaryView<scalar_t>& v, int64_t pairs) {
#if defined(POSENC_BF16_BY_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return v.in_stride[3] == 1 && v.out_stride[3] == 1 && pairs % 16 == 0 && has_avx512_bf16();
  }
#endif
  return false;
}

#if defined(POSENC_BF16_BY_AVX512BF16)
// rotate_head_run of bf16 gptj rows rounded by AVX-512 BF16, a row on a line sent past the caches where v streams.
// Its walk is rotate_head_run's: written again here so that rotate_bf16_row inlines into a function with the
// instruction set's target (called a row at a time across that boundary it was slower). In-process A/B, bhsd q, k
// [32, 16, 1024, 64]: 1.11-1.14x on 2 threads, 1.08-1.16x on one ([4, ...]). neox rows (DINOv3's [16, 16, 1029,
// 64]) ran 0.82-0.97x so out of place and keep the integer form. Streamed, each row's input lines are asked for
// kRunReadAheadBytes ahead (the rows a head's run reads next).
template <RopeLayout kLayout, typename CoeffsOf>
POSENC_TARGET_AVX512BF16 void rotate_head_run_bf16(const RotaryView<c10::BFloat16>& v, int64_t h, int64_t count,
                                                   int64_t first, int64_t last, int64_t seq, int64_t pairs,
                                                   const CoeffsOf& coeffs) {
  const int64_t row_bytes = v.head_dim * static_cast<int64_t>(sizeof(c10::BFloat16));
  for (int64_t n = first; n < last;) {
    const int64_t b = n / seq;
    const int64_t run_end = std::min(last, (b + 1) * seq);
    const c10::BFloat16* in = v.in + b * v.in_stride[0] + (n - b * seq) * v.in_stride[1] + h * v.in_stride[2];
    for (; n < run_end; ++n, in += v.in_stride[1]) {
      const int64_t s = n - b * seq;
      c10::BFloat16* out = output_token(v, b, s);
      if (out == nullptr) continue;
      out += h * v.out_stride[2];
      const auto k = coeffs(n, s);
      for (int64_t g = 0; g < count; ++g) {
        const c10::BFloat16* row_in = in + g * v.in_stride[2];
        c10::BFloat16* row_out = out + g * v.out_stride[2];
        // hints, never faults: past the tensor they ask for nothing of use
        if (v.stream) prefetch_row(reinterpret_cast<const char*>(row_in) + kRunReadAheadBytes, row_bytes);
        rotate_bf16_row<kLayout>(row_in, row_out, k, pairs, v.head_dim,
                                 v.stream && reinterpret_cast<uintptr_t>(row_out) % 64 == 0);
      }
    }
  }
}
#endif

template <RopeLayout kLayout, typename scalar_t, typename CoeffsOf>
void rotate_head_run(const RotaryView<scalar_t>& v, int64_t h, int64_t count, int64_t first, int64_t last,
                     int64_t seq, int64_t pairs, const CoeffsOf& coeffs) {
#if defined(POSENC_BF16_BY_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kLayout == RopeLayout::Gptj) {
    if (rotates_by_instruction(v, pairs)) {
      return rotate_head_run_bf16<kLayout>(v, h, count, first, last, seq, pairs, coeffs);
    }
  }
#endif
  const int64_t fixed = std::is_same_v<scalar_t, c10::Half> ? 0 : pairs;
  if (fixed == 64) return rotate_head_run<kLayout, 64>(v, h, count, first, last, seq, pairs, coeffs);
  if (fixed == 32) return rotate_head_run<kLayout, 32>(v, h, count, first, last, seq, pairs, coeffs);
  rotate_head_run<kLayout, 0>(v, h, count, first, last, seq, pairs, coeffs);
}

#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
// The runs of heads of a contiguous bf16 view whose pairs rotates_bf16_words takes (the baseline and AVX2 builds),
// rotated a word of two channels at a time, neox rows with each token's coefficients put in neox_word_order once for
// every run. Reordered once a run instead (4 heads), DINOv3's [1, 16, 1029, 64] gained nothing (0.98x, one thread, in
// cache) where this gains 1.05x: the reorder took what the word form saved. Out of line, a function of few live
// values: rotate_tokens, with this inlined, rebuilt its rows' constants at every step (perf annotate; the gptj runs
// it then rotated itself, Flux-like [32, 16, 1024, 64], 2 threads, ran 0.92x as fast).
template <RopeLayout kLayout, typename CoeffsOf>
__attribute__((noinline)) void rotate_head_runs_by_words(const RotaryView<c10::BFloat16>& v, int64_t first,
                                                        int64_t last, int64_t seq, int64_t pairs,
                                                        const CoeffsOf& coeffs) {
  const bool reorders = kLayout == RopeLayout::Neox && !coeffs(first, first % seq).words;
  SmallScratch<float> rows(reorders ? (last - first) * 4 * pairs : 0);
  std::vector<PairCoeffs<float>> words(reorders ? last - first : 0);
  for (int64_t n = first; reorders && n < last; ++n) {
    words[n - first] = neox_word_order(coeffs(n, n % seq), pairs, &rows[(n - first) * 4 * pairs]);
  }
  const auto word_coeffs = [&](int64_t n, int64_t s) { return reorders ? words[n - first] : coeffs(n, s); };
  for (int64_t h = 0; h < v.heads; h += kHeadsPerRun) {
    const int64_t count = std::min(kHeadsPerRun, v.heads - h);
    if (pairs == 64) {
      rotate_head_run<kLayout, 64, true>(v, h, count, first, last, seq, pairs, word_coeffs);
    } else if (pairs == 32) {
      rotate_head_run<kLayout, 32, true>(v, h, count, first, last, seq, pairs, word_coeffs);
    } else {
      rotate_head_run<kLayout, 0, true>(v, h, count, first, last, seq, pairs, word_coeffs);
    }
  }
}
#endif

// Whether a bf16 view's rows may stream by rotate_bf16_vectors (the baseline and AVX2 builds): rows contiguous
// (rotate_unit_row and rotate_head_run stream those whose output starts on a line, as whole lines).
template <typename scalar_t>
bool view_streams_bf16_vectors(const RotaryView<scalar_t>& v) {
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
  return v.in_stride[3] == 1 && v.out_stride[3] == 1;
#else
  return false;
#endif
}

// Tokens [first, last) of view v, a few heads at a time or token by token (head_by_head); coeffs(n, s) gives
// token n's coefficients (s = n mod seq).
template <typename scalar_t, typename CoeffsOf>
void rotate_tokens(const RotaryView<scalar_t>& v, int64_t first, int64_t last, int64_t seq, int64_t pairs,
                   RopeLayout layout, const CoeffsOf& coeffs) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (v.stream && !rotates_by_instruction(v, pairs) && !view_streams_bf16_vectors(v)) {
      RotaryView<scalar_t> cached = v;  // bf16 rows stream only where rounded in registers, as whole lines
      cached.stream = false;
      return rotate_tokens(cached, first, last, seq, pairs, layout, coeffs);
    }
  }
  if (!head_by_head(v, seq)) {
#if defined(POSENC_BF16_BY_AVX512BF16)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (rotates_by_instruction(v, pairs)) {
        for (int64_t n = first; n < last; ++n) {
          if (layout == RopeLayout::Neox) {
            rotate_heads_bf16<RopeLayout::Neox>(v, n / seq, n % seq, coeffs(n, n % seq), pairs);
          } else {
            rotate_heads_bf16<RopeLayout::Gptj>(v, n / seq, n % seq, coeffs(n, n % seq), pairs);
          }
        }
        return;
      }
    }
#endif
    for (int64_t n = first; n < last; ++n) rotate_token(v, n / seq, n % seq, coeffs(n, n % seq), pairs, layout);
    return;
  }
  // A head's rows are long runs of its output. Where the output streams, float32 rows formed in registers
  // (rotate_head_run) and bf16 gptj rows rounded by instruction, 16 pairs a line (rotate_head_run_bf16; v.stream is
  // left to bf16 views only where they are), go past the caches: in-process A/Bs, DINOv3's neox [16, 16, 1029, 64]
  // float32 1.24-1.25x on 2 threads, 1.23 on one, 1.20 under AVX2; Flux-like gptj [32, 16, 1024, 64] float32
  // 1.20-1.35x, 1.21 on one, 1.17 under AVX2, bf16 1.18-1.26x, 1.16 on one. Formed through a row in L1 and copied
  // past the caches, float32 rows had been slower (3.48 -> 3.79 ms), and bf16 neox rows rounded by instruction
  // and streamed were too (0.77-0.88x): those keep ordinary stores. fp16 rows, rotated in registers by F16C
  // (rotate_half_row_by_instruction) where the pairs allow, stream in both layouts: in-process A/B against the float
  // row, DINOv3-like neox 1.23x, and streamed 1.25x more; Flux-like gptj 1.60x; in place 1.82x (2 threads; AVX2:
  // neox 1.83x, gptj 1.69x, rotary.h). Other fp16 rows keep ordinary stores (rotate_half_head). The baseline's and
  // AVX2's bf16 rows, rounded in registers by integer operations (rotate_bf16_words), stream as whole lines in both
  // layouts: in-process A/B against ordinary stores, AVX2, DINOv3's neox 1.10x (1.08x on one thread), fwd+bwd 1.08x
  // (1.20x), Flux-like gptj 1.12x (1.22x); the baseline 1.02-1.11x.
  RotaryView<scalar_t> run = v;
  run.stream = v.stream && (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::Half> ||
                            layout == RopeLayout::Gptj ||
                            (std::is_same_v<scalar_t, c10::BFloat16> && view_streams_bf16_vectors(v)));
  const bool unit = v.in_stride[3] == 1 && v.out_stride[3] == 1;
#if defined(POSENC_BF16_BY_SSE2) || defined(POSENC_BF16_BY_AVX2)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (unit && layout == RopeLayout::Neox && rotates_bf16_words<RopeLayout::Neox>(pairs)) {
      return rotate_head_runs_by_words<RopeLayout::Neox>(run, first, last, seq, pairs, coeffs);
    }
    if (unit && layout == RopeLayout::Gptj && rotates_bf16_words<RopeLayout::Gptj>(pairs)) {
      return rotate_head_runs_by_words<RopeLayout::Gptj>(run, first, last, seq, pairs, coeffs);
    }
  }
#endif
  RotaryView<scalar_t> head = run;
  head.heads = 1;
  head.stream = false;
  for (int64_t h = 0; h < v.heads; h += unit ? kHeadsPerRun : 1) {
    const int64_t count = std::min(kHeadsPerRun, v.heads - h);
    if (unit && layout == RopeLayout::Neox) {
      rotate_head_run<RopeLayout::Neox>(run, h, count, first, last, seq, pairs, coeffs);
    } else if (unit) {
      rotate_head_run<RopeLayout::Gptj>(run, h, count, first, last, seq, pairs, coeffs);
    } else {
      head.in = v.in + h * v.in_stride[2];
      head.out = v.out + h * v.out_stride[2];
      for (int64_t n = first; n < last; ++n) {
        rotate_token(head, n / seq, n % seq, coeffs(n, n % seq), pairs, layout);
      }
    }
  }
}

template <typename scalar_t>
void rope_kernel(const RopeProblem<scalar_t>& problem) {
  if (problem.norms != nullptr) return norm_rope_kernel(problem);
  using opmath = opmath_t<scalar_t>;
  const int64_t pairs = problem.pairs;
  const int64_t seq = problem.seq;
  const auto scale = static_cast<opmath>(problem.attention_scale);
  int64_t token_work = 0;
  bool any_by_head = false;
  for (int64_t v = 0; v < problem.num_views; ++v) {
    token_work += problem.views[v].heads * problem.views[v].head_dim;
    any_by_head = any_by_head || head_by_head(problem.views[v], seq);
  }
  if (problem.copy != nullptr) token_work += problem.copy->heads * problem.copy->head_dim;
  const Coefficients<scalar_t, opmath> coefficients(problem, scale);
  // Tokens per tile: a block of their coefficient rows (2 * pairs values each from a table, 4 * pairs formed per
  // token) stays in L2 while every head of every view passes over it. A token walk takes tiles too where a token's
  // rows of several views span a page or more (q's and k's, or a value's copy): each view then walks the tile on
  // its own, which halves the streams in flight, as with a table. In-process A/Bs, out-of-place M-RoPE and per-row
  // positions (q 16, k 8 heads of 128): 1.2-1.5x faster while other load held the memory, 0.94-1.17x on a quiet
  // machine; decoding steps the same. One view in place (0.9x) keeps its tokens whole.
  const int64_t coefficient_bytes =
      (coefficients.table.empty() ? 4 : 2) * pairs * static_cast<int64_t>(sizeof(opmath));
  const bool views_apart = problem.num_views + (problem.copy != nullptr ? 1 : 0) > 1 &&
                           token_work * static_cast<int64_t>(sizeof(scalar_t)) >= kPageBytes;
  const int64_t tile = any_by_head || views_apart ? rows_per_block(coefficient_bytes) : 1;
  if (!coefficients.table.empty()) {
    // The coefficients are a table: each view (q, then k) is walked on its own, which halves the rows in flight
    // per token.
    for (int64_t v = 0; v < problem.num_views; ++v) {
      const auto& view = problem.views[v];
      const auto coeffs = [&](int64_t, int64_t s) { return coefficients.of_table(v, s); };
      parallel_for(0, problem.batch * seq, rows_per_task(view.heads * view.head_dim), [&](int64_t begin, int64_t end) {
        for (int64_t first = begin; first < end; first += tile) {
          rotate_tokens(view, first, std::min(end, first + tile), seq, pairs, problem.layout, coeffs);
        }
        store_fence();
      });
    }
    if (problem.copy != nullptr) {
      const auto& view = *problem.copy;
      parallel_for(0, problem.batch * seq, rows_per_task(view.heads * view.head_dim), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) copy_token(view, n / seq, n % seq);
      });
    }
    return;
  }
  parallel_for(0, problem.batch * seq, rows_per_task(token_work), [&](int64_t begin, int64_t end) {
    const int64_t tokens_here = std::min(tile, end - begin);
    SmallScratch<opmath> own(tokens_here * 4 * pairs);
    std::vector<std::pair<const opmath*, const opmath*>> token_rows(tokens_here);
    for (int64_t first = begin; first < end; first += tile) {
      const int64_t last = std::min(end, first + tile);
      for (int64_t n = first; n < last; ++n) {
        token_rows[n - first] = coefficients.rows(n, &own[(n - first) * 4 * pairs]);
      }
      for (int64_t v = 0; v < problem.num_views; ++v) {
        const auto coeffs = [&](int64_t n, int64_t) { return coefficients.of_view(v, token_rows[n - first]); };
        rotate_tokens(problem.views[v], first, last, seq, pairs, problem.layout, coeffs);
      }
      if (problem.copy != nullptr) {
        for (int64_t n = first; n < last; ++n) copy_token(*problem.copy, n / seq, n % seq);
      }
    }
    store_fence();
  });
}

// Per-channel coefficients gathered from the tables. The backward is the transpose:
// g1' = g1 c1 + g2 s2, g2' = g2 c2 - g1 s1, i.e. the forward map with (c1, -s2, c2, -s1).
template <typename scalar_t, typename opmath>
void rope_tables_kernel(const RopeTablesProblem<scalar_t, opmath>& problem) {
  const auto& view = problem.view;
  const int64_t seq = problem.seq;
  const int64_t rotary_dim = problem.rotary_dim;
  const int64_t pairs = rotary_dim / 2;
  const int64_t step = problem.layout == RopeLayout::Neox ? 1 : 2;          // channel of pair i = step * i
  const int64_t partner = problem.layout == RopeLayout::Neox ? pairs : 1;  // its partner, `partner` channels on
  // Tokens per tile of a head-by-head walk (see rope_kernel): their gathered coefficients stay in L2.
  const int64_t tile = head_by_head(view, seq) ? rows_per_block(4 * pairs * static_cast<int64_t>(sizeof(opmath))) : 1;
  parallel_for(0, problem.batch * seq, rows_per_task(view.heads * view.head_dim), [&](int64_t begin, int64_t end) {
    SmallScratch<opmath> own(std::min(tile, end - begin) * 4 * pairs);  // c1, s1, c2, s2 of each token of a tile
    for (int64_t first = begin; first < end; first += tile) {
      const int64_t last = std::min(end, first + tile);
      for (int64_t n = first; n < last; ++n) {
        opmath* c1 = &own[(n - first) * 4 * pairs];
        opmath* s1 = c1 + pairs;
        opmath* c2 = s1 + pairs;
        opmath* s2 = c2 + pairs;
        const int64_t row = (problem.shared_rows ? n % seq : n) * rotary_dim;
        for (int64_t i = 0; i < pairs; ++i) {
          const int64_t a = row + step * i;
          const int64_t z = a + partner;
          c1[i] = problem.cos[a];
          c2[i] = problem.cos[z];
          s1[i] = problem.transpose ? -problem.sin[z] : problem.sin[a];
          s2[i] = problem.transpose ? -problem.sin[a] : problem.sin[z];
        }
      }
      const auto coeffs = [&](int64_t n, int64_t) {
        const opmath* c1 = &own[(n - first) * 4 * pairs];
        return PairCoeffs<opmath>{c1, c1 + pairs, c1 + 2 * pairs, c1 + 3 * pairs};
      };
      rotate_tokens(view, first, last, seq, pairs, problem.layout, coeffs);
    }
    store_fence();
  });
}

}  // namespace
POSENC_KERNELS_END  // the registrations below run when the library loads, on any CPU

POSENC_REGISTER_FLOATING_KERNELS(rope_stub, rope_kernel);
POSENC_REGISTER_KERNEL((rope_tables_stub<float, float>), (&rope_tables_kernel<float, float>));
POSENC_REGISTER_KERNEL((rope_tables_stub<double, double>), (&rope_tables_kernel<double, double>));
POSENC_REGISTER_KERNEL((rope_tables_stub<c10::Half, float>), (&rope_tables_kernel<c10::Half, float>));
POSENC_REGISTER_KERNEL((rope_tables_stub<c10::BFloat16, float>), (&rope_tables_kernel<c10::BFloat16, float>));
}  // namespace POSENC_CPU_CAPABILITY
}  // namespace posenc::cpu
