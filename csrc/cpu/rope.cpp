// CPU kernels of the rotary family. Every op rotates channel pairs of [batch, seq, heads, head_dim] rows:
//   y1 = x1 * c1 - x2 * s1,   y2 = x2 * c2 + x1 * s2,
// with c1 = c2 = a cos(theta), s1 = s2 = a sin(theta) for rope (a = attention_scale; the backward is the
// same map with -theta) and per-channel tables for rope_cos_sin. Work is split over tokens; the
// coefficients of a token are formed once and reused by all its heads (and by q and k in rope_qk).
#include "common/angle.h"
#include "common/convert.h"
#include "common/parallel.h"
#include "common/positions.h"
#include "common/rope.h"

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace posenc {
namespace {

// The rotation coefficients of one token, one entry per channel pair.
template <typename opmath_t>
struct PairCoeffs {
  const opmath_t* c1;
  const opmath_t* s1;
  const opmath_t* c2;
  const opmath_t* s2;
};

// One tensor to rotate: input and output read through their strides as [batch, seq, heads, head_dim].
template <typename scalar_t>
struct RotaryView {
  const scalar_t* in;
  scalar_t* out;
  int64_t heads;
  int64_t head_dim;
  std::array<int64_t, 4> in_stride;
  std::array<int64_t, 4> out_stride;
};

std::array<int64_t, 4> strides_of(const at::Tensor& t, RopeFormat format) {
  const auto order = rope_dim_order(format);
  std::array<int64_t, 4> strides;
  for (const auto i : c10::irange(4)) strides[i] = order[i] < 0 ? 0 : t.stride(order[i]);
  return strides;
}

template <typename scalar_t>
RotaryView<scalar_t> view_of(const at::Tensor& in, const at::Tensor& out, RopeFormat format) {
  const auto order = rope_dim_order(format);
  return {in.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), in.size(order[2]), in.size(order[3]),
          strides_of(in, format), strides_of(out, format)};
}

// Iteration i of the pair loops reads and writes only pair i, so they carry no dependency even in place
// (out == in); saying so lets the compiler vectorize despite the possible aliasing.
#if defined(__clang__)
#define POSENC_NO_CARRIED_DEPENDENCY _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define POSENC_NO_CARRIED_DEPENDENCY _Pragma("GCC ivdep")
#else
#define POSENC_NO_CARRIED_DEPENDENCY
#endif

// x1 c - x2 s and x2 c + x1 s as GCC contracts them where the CPU has FMA: the second product rounded,
// then fused into the first. Spelled out, so that every copy the compiler makes of a loop (vector body,
// epilogue, a tail vectorized across y1 and y2) computes the same bits; that contraction is not
// guaranteed otherwise.
template <typename T>
inline T rotate_first(T x1, T x2, T c, T s) {
#if defined(__FMA__)
  return std::fma(x1, c, -(x2 * s));
#else
  return x1 * c - x2 * s;
#endif
}

template <typename T>
inline T rotate_second(T x1, T x2, T c, T s) {
#if defined(__FMA__)
  return std::fma(x2, c, x1 * s);
#else
  return x2 * c + x1 * s;
#endif
}

// One head's row: pair i is channels (i, i + pairs) for neox, (2i, 2i + 1) for gptj; the channels past
// 2 * pairs are copied. kUnit: both rows are contiguous, which fixes every stride at compile time.
template <RopeLayout kLayout, bool kUnit, typename scalar_t, typename opmath_t>
void rotate_row(const scalar_t* in, int64_t in_step, scalar_t* out, int64_t out_step, PairCoeffs<opmath_t> k,
                int64_t pairs, int64_t head_dim) {
  const int64_t is = kUnit ? 1 : in_step;
  const int64_t os = kUnit ? 1 : out_step;
  const int64_t first = kLayout == RopeLayout::Neox ? 1 : 2;       // channel of pair i = first * i
  const int64_t second = kLayout == RopeLayout::Neox ? pairs : 1;  // its partner, `second` channels on
  const scalar_t* x1 = in;
  const scalar_t* x2 = in + second * is;
  scalar_t* y1 = out;
  scalar_t* y2 = out + second * os;
  POSENC_NO_CARRIED_DEPENDENCY
  for (int64_t i = 0; i < pairs; ++i) {
    const auto a = static_cast<opmath_t>(x1[i * first * is]);
    const auto b = static_cast<opmath_t>(x2[i * first * is]);
    y1[i * first * os] = static_cast<scalar_t>(rotate_first(a, b, k.c1[i], k.s1[i]));
    y2[i * first * os] = static_cast<scalar_t>(rotate_second(a, b, k.c2[i], k.s2[i]));
  }
  if (in == out) return;  // in place: the channels past rotary_dim are already there
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d * os] = in[d * is];
}

// Contiguous bf16 rows read and written as 32-bit words of two neighbouring channels (the lower channel in
// the low half): widening is a shift or a mask and two rounded results fill one word, so the loop needs no
// unpack or pack shuffles. The maths and the rounding (c10's: to nearest even, every NaN to 0x7FC0) are
// those of rotate_row, so the bits are too.
inline uint32_t load_word(const c10::BFloat16* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

inline void store_word(c10::BFloat16* p, uint32_t w) { std::memcpy(p, &w, sizeof(w)); }

// A word's two channels, and the word of two values rounded (convert.h's bf16 conversions).
inline float low_channel(uint32_t w) { return to_opmath(c10::BFloat16(uint16_t(w), c10::BFloat16::from_bits())); }

inline float high_channel(uint32_t w) {
  return to_opmath(c10::BFloat16(uint16_t(w >> 16), c10::BFloat16::from_bits()));
}

inline uint32_t pack_word(float low, float high) {
  return (uint32_t(from_opmath<c10::BFloat16>(high).x) << 16) | from_opmath<c10::BFloat16>(low).x;
}

// Asks for this head's row of the next token, read and written one token from now. A token's rows of a
// bshd tensor are a page or two (16 heads of 128 channels), and the hardware prefetchers stop at page
// boundaries, so every token would otherwise start with misses on all four streams of rope_qk (q, k and
// their outputs). Measured 10-15% faster on one thread for fp32 and bf16.
template <typename scalar_t>
inline void prefetch_next_token(const RotaryView<scalar_t>& v, const scalar_t* in, scalar_t* out) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t d = 0; d < v.head_dim; d += kLine) {
    __builtin_prefetch(in + v.in_stride[1] + d * v.in_stride[3]);
    __builtin_prefetch(out + v.out_stride[1] + d * v.out_stride[3], 1);
  }
}

// All heads of one token of a bf16 view with contiguous rows.
template <RopeLayout kLayout>
void rotate_heads_bf16(const RotaryView<c10::BFloat16>& v, int64_t b, int64_t s, PairCoeffs<float> k,
                       int64_t pairs) {
  // neox: word j of either half holds pairs 2j and 2j + 1. The coefficients of the even and of the odd
  // pairs are laid out apart once per token, so that every head's loop reads them without shuffles.
  const int64_t words = pairs / 2;
  constexpr int64_t kStackWords = 128;
  float on_stack[8 * kStackWords];
  std::vector<float> on_heap(kLayout == RopeLayout::Neox && words > kStackWords ? 8 * words : 0);
  float* split = on_heap.empty() ? on_stack : on_heap.data();
  const float* coeffs[4] = {k.c1, k.s1, k.c2, k.s2};
  for (const auto c : c10::irange(kLayout == RopeLayout::Neox ? 4 : 0)) {
    for (const auto j : c10::irange(words)) {
      split[2 * c * words + j] = coeffs[c][2 * j];
      split[(2 * c + 1) * words + j] = coeffs[c][2 * j + 1];
    }
  }
  const float* c1_even = split;
  const float* c1_odd = c1_even + words;
  const float* s1_even = c1_odd + words;
  const float* s1_odd = s1_even + words;
  const float* c2_even = s1_odd + words;
  const float* c2_odd = c2_even + words;
  const float* s2_even = c2_odd + words;
  const float* s2_odd = s2_even + words;
  for (const auto h : c10::irange(v.heads)) {
    const c10::BFloat16* in = v.in + b * v.in_stride[0] + s * v.in_stride[1] + h * v.in_stride[2];
    c10::BFloat16* out = v.out + b * v.out_stride[0] + s * v.out_stride[1] + h * v.out_stride[2];
    prefetch_next_token(v, in, out);
    if constexpr (kLayout == RopeLayout::Gptj) {  // word i is pair i
      POSENC_NO_CARRIED_DEPENDENCY
      for (int64_t i = 0; i < pairs; ++i) {
        const uint32_t w = load_word(in + 2 * i);
        const float a = low_channel(w);
        const float b = high_channel(w);
        store_word(out + 2 * i,
                   pack_word(rotate_first(a, b, k.c1[i], k.s1[i]), rotate_second(a, b, k.c2[i], k.s2[i])));
      }
    } else {
      const c10::BFloat16* x1 = in;
      const c10::BFloat16* x2 = in + pairs;
      c10::BFloat16* y1 = out;
      c10::BFloat16* y2 = out + pairs;
      POSENC_NO_CARRIED_DEPENDENCY
      for (int64_t j = 0; j < words; ++j) {
        const uint32_t w1 = load_word(x1 + 2 * j);
        const uint32_t w2 = load_word(x2 + 2 * j);
        const float a0 = low_channel(w1);
        const float a1 = high_channel(w1);
        const float b0 = low_channel(w2);
        const float b1 = high_channel(w2);
        store_word(y1 + 2 * j, pack_word(rotate_first(a0, b0, c1_even[j], s1_even[j]),
                                         rotate_first(a1, b1, c1_odd[j], s1_odd[j])));
        store_word(y2 + 2 * j, pack_word(rotate_second(a0, b0, c2_even[j], s2_even[j]),
                                         rotate_second(a1, b1, c2_odd[j], s2_odd[j])));
      }
      if (pairs % 2 == 1) {  // an odd last pair, alone
        const int64_t i = pairs - 1;
        const float a = to_opmath(x1[i]);
        const float b = to_opmath(x2[i]);
        y1[i] = from_opmath<c10::BFloat16>(rotate_first(a, b, k.c1[i], k.s1[i]));
        y2[i] = from_opmath<c10::BFloat16>(rotate_second(a, b, k.c2[i], k.s2[i]));
      }
    }
    if (in == out) continue;  // in place: the channels past rotary_dim are already there
    for (int64_t d = 2 * pairs; d < v.head_dim; ++d) out[d] = in[d];
  }
}

// Contiguous fp16 rows: c10::Half converts one value at a time (with F16C, the scalar instructions), which
// keeps rotate_row scalar. The rotated channels are widened into a float row, rotated there by the float
// kernel and narrowed back, eight at a time with the vector forms of the same instructions (so the same
// bits); the channels past rotary_dim are copied as they are.
inline void widen_half(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void narrow_half(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

template <RopeLayout kLayout>
void rotate_row_half(const c10::Half* in, c10::Half* out, PairCoeffs<float> k, int64_t pairs, int64_t head_dim) {
  constexpr int64_t kBlock = 128;  // pairs per pass through the float row
  float x[2 * kBlock];
  for (int64_t i = 0; i < pairs; i += kBlock) {
    const int64_t n = std::min(kBlock, pairs - i);
    const PairCoeffs<float> block{k.c1 + i, k.s1 + i, k.c2 + i, k.s2 + i};
    if constexpr (kLayout == RopeLayout::Neox) {  // the block's first channels, then their partners
      widen_half(in + i, x, n);
      widen_half(in + pairs + i, x + n, n);
      rotate_row<kLayout, true>(x, 1, x, 1, block, n, 2 * n);
      narrow_half(x, out + i, n);
      narrow_half(x + n, out + pairs + i, n);
    } else {
      widen_half(in + 2 * i, x, 2 * n);
      rotate_row<kLayout, true>(x, 1, x, 1, block, n, 2 * n);
      narrow_half(x, out + 2 * i, 2 * n);
    }
  }
  if (in == out) return;
  for (int64_t d = 2 * pairs; d < head_dim; ++d) out[d] = in[d];
}

template <RopeLayout kLayout, typename scalar_t, typename opmath_t>
void rotate_heads(const RotaryView<scalar_t>& v, int64_t b, int64_t s, PairCoeffs<opmath_t> k, int64_t pairs) {
  const bool unit = v.in_stride[3] == 1 && v.out_stride[3] == 1;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (unit) return rotate_heads_bf16<kLayout>(v, b, s, k, pairs);
  }
  for (const auto h : c10::irange(v.heads)) {
    const scalar_t* in = v.in + b * v.in_stride[0] + s * v.in_stride[1] + h * v.in_stride[2];
    scalar_t* out = v.out + b * v.out_stride[0] + s * v.out_stride[1] + h * v.out_stride[2];
    if (!unit) {
      rotate_row<kLayout, false>(in, v.in_stride[3], out, v.out_stride[3], k, pairs, v.head_dim);
      continue;
    }
    prefetch_next_token(v, in, out);
    if constexpr (std::is_same_v<scalar_t, c10::Half>) {
      rotate_row_half<kLayout>(in, out, k, pairs, v.head_dim);
    } else {
      rotate_row<kLayout, true>(in, 1, out, 1, k, pairs, v.head_dim);
    }
  }
}

template <typename scalar_t, typename opmath_t>
void rotate_token(const RotaryView<scalar_t>& v, int64_t b, int64_t s, PairCoeffs<opmath_t> k, int64_t pairs,
                  RopeLayout layout) {
  if (layout == RopeLayout::Neox) {
    rotate_heads<RopeLayout::Neox>(v, b, s, k, pairs);
  } else {
    rotate_heads<RopeLayout::Gptj>(v, b, s, k, pairs);
  }
}

// cos/sin of each pair of a position (the angle engine's row, vectorized), times the attention scale; sin
// negated for the inverse rotation.
template <typename opmath_t>
void angle_coeffs(double position, const double* inv_freq, int64_t pairs, opmath_t scale, bool inverse,
                  opmath_t* cos, opmath_t* sin) {
  sincos_row(position, inv_freq, pairs, sin, cos);
  const opmath_t sin_scale = inverse ? -scale : scale;
  for (int64_t i = 0; i < pairs; ++i) {
    cos[i] *= scale;
    sin[i] *= sin_scale;
  }
}

// Float64 position of every (shared) sequence index or (per-row) token, offset included; packed
// sequences without positions restart at offset at each cu_seqlens boundary.
at::Tensor rope_positions(const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& cu_seqlens,
                          int64_t seq_len, int64_t offset) {
  if (positions || !cu_seqlens) return positions_as_double(positions, seq_len, offset);
  auto pos = at::empty({seq_len}, at::TensorOptions().dtype(at::kDouble));
  double* p = pos.mutable_data_ptr<double>();
  const auto cu = cu_seqlens->to(at::kLong).contiguous();
  const int64_t* bounds = cu.const_data_ptr<int64_t>();
  for (const auto j : c10::irange(cu.numel() - 1)) {
    for (int64_t t = bounds[j]; t < bounds[j + 1]; ++t) p[t] = static_cast<double>(offset + t - bounds[j]);
  }
  return pos;
}

// cu_seqlens must start at 0, never decrease and end at T: checked before any token is read.
void check_cu_seqlens_values(const char* op, const std::optional<at::Tensor>& cu_seqlens, int64_t tokens) {
  if (!cu_seqlens) return;
  const auto cu = cu_seqlens->to(at::kLong).contiguous();
  const int64_t* bounds = cu.const_data_ptr<int64_t>();
  const int64_t n = cu.numel();
  TORCH_CHECK(bounds[0] == 0, "posenc.", op, ": cu_seqlens must start at 0, got ", bounds[0]);
  for (const auto j : c10::irange(1, n)) {
    TORCH_CHECK(bounds[j] >= bounds[j - 1], "posenc.", op, ": cu_seqlens must not decrease, got ", bounds[j - 1],
                " then ", bounds[j], " at index ", j);
  }
  TORCH_CHECK(bounds[n - 1] == tokens, "posenc.", op, ": cu_seqlens must end at the token count T = ", tokens,
              ", got ", bounds[n - 1]);
}

// Rotates every view by the angles of `pos` ([seq] shared by the batch, or [batch * seq]).
template <typename scalar_t>
void rotate_by_angles(const std::vector<RotaryView<scalar_t>>& views, const at::Tensor& pos, bool shared,
                      const at::Tensor& inv_freq, double attention_scale, bool inverse, RopeLayout layout,
                      int64_t batch, int64_t seq) {
  using opmath_t = at::opmath_type<scalar_t>;
  const double* p = pos.const_data_ptr<double>();
  const double* freq = inv_freq.const_data_ptr<double>();
  const int64_t pairs = inv_freq.numel();
  const auto scale = static_cast<opmath_t>(attention_scale);
  int64_t token_work = 0;
  for (const auto& v : views) token_work += v.heads * v.head_dim;

  // Positions shared by several batch rows: one table of [seq, 2 * pairs] coefficients for all of them.
  const bool table = shared && batch > 1;
  std::vector<opmath_t> coeffs(table ? seq * 2 * pairs : 0);
  if (table) {
    // A sin/cos pair costs roughly as much as rotating 16 channels: weigh the grain accordingly.
    at::parallel_for(0, seq, rows_per_task(pairs * 16), [&](int64_t begin, int64_t end) {
      for (const auto s : c10::irange(begin, end)) {
        opmath_t* row = &coeffs[s * 2 * pairs];
        angle_coeffs(p[s], freq, pairs, scale, inverse, row, row + pairs);
      }
    });
  }
  at::parallel_for(0, batch * seq, rows_per_task(token_work), [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> own(table ? 0 : 2 * pairs);
    for (const auto n : c10::irange(begin, end)) {
      const int64_t b = n / seq;
      const int64_t s = n % seq;
      const opmath_t* row = own.data();
      if (table) {
        row = &coeffs[s * 2 * pairs];
      } else {
        angle_coeffs(p[shared ? s : n], freq, pairs, scale, inverse, own.data(), own.data() + pairs);
      }
      const PairCoeffs<opmath_t> k{row, row + pairs, row, row + pairs};
      for (const auto& v : views) rotate_token(v, b, s, k, pairs, layout);
    }
  });
}

// The shared body of rope, rope_backward, rope_ (outputs alias inputs) and the qk variants.
void rope_kernel(const char* op, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                 const RopeArgs& args, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                 double attention_scale, int64_t offset, const std::optional<at::Tensor>& cu_seqlens, bool inverse) {
  const auto order = rope_dim_order(args.format);
  const int64_t batch = order[0] < 0 ? 1 : inputs[0].size(order[0]);
  const int64_t seq = inputs[0].size(order[1]);
  check_cu_seqlens_values(op, cu_seqlens, seq);
  bool empty = true;
  for (const auto& t : inputs) empty = empty && t.numel() == 0;
  if (empty) return;
  const auto pos = rope_positions(positions, cu_seqlens, seq, offset);
  const auto freq = inv_freq.to(at::kDouble).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, inputs[0].scalar_type(), "posenc_rope", [&] {
    std::vector<RotaryView<scalar_t>> views;
    for (const auto i : c10::irange(inputs.size())) {
      if (inputs[i].numel() > 0) views.push_back(view_of<scalar_t>(inputs[i], outputs[i], args.format));
    }
    rotate_by_angles<scalar_t>(views, pos, args.shared_positions, freq, attention_scale, inverse, args.layout, batch,
                               seq);
  });
}

// Functional outputs are fresh and contiguous in the input's own format (the Meta kernels agree).
at::Tensor rope_cpu_impl(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& positions,
                         const at::Tensor& inv_freq, double attention_scale, c10::string_view layout,
                         c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                         bool inverse) {
  const auto args = check_rope(op, {{inverse ? "grad" : "x", &x}}, positions, inv_freq, layout, format, cu_seqlens);
  auto out = at::empty(x.sizes(), x.options());
  rope_kernel(op, {x}, {out}, args, positions, inv_freq, attention_scale, offset, cu_seqlens, inverse);
  return out;
}

at::Tensor rope_cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                    double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
                    const std::optional<at::Tensor>& cu_seqlens) {
  return rope_cpu_impl("rope", x, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens, false);
}

at::Tensor rope_backward_cpu(const at::Tensor& grad, const std::optional<at::Tensor>& positions,
                             const at::Tensor& inv_freq, double attention_scale, c10::string_view layout,
                             c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens) {
  return rope_cpu_impl("rope_backward", grad, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                       true);
}

std::tuple<at::Tensor, at::Tensor> rope_qk_cpu_impl(const char* op, const at::Tensor& q, const at::Tensor& k,
                                                    const std::optional<at::Tensor>& positions,
                                                    const at::Tensor& inv_freq, double attention_scale,
                                                    c10::string_view layout, c10::string_view format, int64_t offset,
                                                    const std::optional<at::Tensor>& cu_seqlens, bool inverse) {
  const auto args = check_rope(op, {{inverse ? "grad_q" : "q", &q}, {inverse ? "grad_k" : "k", &k}}, positions,
                               inv_freq, layout, format, cu_seqlens);
  auto q_out = at::empty(q.sizes(), q.options());
  auto k_out = at::empty(k.sizes(), k.options());
  rope_kernel(op, {q, k}, {q_out, k_out}, args, positions, inv_freq, attention_scale, offset, cu_seqlens, inverse);
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rope_qk_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                               double attention_scale, c10::string_view layout,
                                               c10::string_view format, int64_t offset,
                                               const std::optional<at::Tensor>& cu_seqlens) {
  return rope_qk_cpu_impl("rope_qk", q, k, positions, inv_freq, attention_scale, layout, format, offset, cu_seqlens,
                          false);
}

std::tuple<at::Tensor, at::Tensor> rope_qk_backward_cpu(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                                        const std::optional<at::Tensor>& positions,
                                                        const at::Tensor& inv_freq, double attention_scale,
                                                        c10::string_view layout, c10::string_view format,
                                                        int64_t offset, const std::optional<at::Tensor>& cu_seqlens) {
  return rope_qk_cpu_impl("rope_qk_backward", grad_q, grad_k, positions, inv_freq, attention_scale, layout, format,
                          offset, cu_seqlens, true);
}

void rope__cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
               double attention_scale, c10::string_view layout, c10::string_view format, int64_t offset,
               const std::optional<at::Tensor>& cu_seqlens) {
  constexpr const char* op = "rope_";
  const auto args = check_rope(op, {{"x", &x}}, positions, inv_freq, layout, format, cu_seqlens);
  // Rows that share memory (an expanded x) would be rotated twice.
  TORCH_CHECK(at::has_internal_overlap(x) != at::MemOverlap::Yes, "posenc.", op,
              ": x has elements that share memory (e.g. an expanded tensor); rotate a copy with posenc.rope");
  rope_kernel(op, {x}, {x}, args, positions, inv_freq, attention_scale, offset, cu_seqlens, false);
}

// rope_cos_sin: per-channel coefficients gathered from the tables. The backward is the transpose:
// g1' = g1 c1 + g2 s2, g2' = g2 c2 - g1 s1, i.e. the forward map with (c1, -s2, c2, -s1).
at::Tensor rope_cos_sin_cpu_impl(const char* op, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 c10::string_view layout, c10::string_view format, bool transpose) {
  const auto args = check_rope_cos_sin(op, transpose ? "grad" : "x", x, cos, sin, layout, format);
  auto out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const auto order = rope_dim_order(args.format);
  const int64_t batch = order[0] < 0 ? 1 : x.size(order[0]);
  const int64_t seq = x.size(order[1]);
  const int64_t rotary_dim = cos.size(-1);
  const int64_t pairs = rotary_dim / 2;
  const int64_t first = args.layout == RopeLayout::Neox ? 1 : 2;
  const int64_t second = args.layout == RopeLayout::Neox ? pairs : 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "posenc_rope_cos_sin", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto opmath = c10::CppTypeToScalarType<opmath_t>::value;
    const auto cos_table = cos.to(opmath).contiguous();
    const auto sin_table = sin.to(opmath).contiguous();
    const opmath_t* cos_data = cos_table.const_data_ptr<opmath_t>();
    const opmath_t* sin_data = sin_table.const_data_ptr<opmath_t>();
    const auto view = view_of<scalar_t>(x, out, args.format);
    at::parallel_for(0, batch * seq, rows_per_task(view.heads * view.head_dim), [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> own(4 * pairs);
      opmath_t* c1 = own.data();
      opmath_t* s1 = c1 + pairs;
      opmath_t* c2 = s1 + pairs;
      opmath_t* s2 = c2 + pairs;
      for (const auto n : c10::irange(begin, end)) {
        const int64_t b = n / seq;
        const int64_t s = n % seq;
        const int64_t row = (args.shared_positions ? s : n) * rotary_dim;
        for (const auto i : c10::irange(pairs)) {
          const int64_t a = row + first * i;
          const int64_t z = a + second;
          c1[i] = cos_data[a];
          c2[i] = cos_data[z];
          s1[i] = transpose ? -sin_data[z] : sin_data[a];
          s2[i] = transpose ? -sin_data[a] : sin_data[z];
        }
        rotate_token(view, b, s, PairCoeffs<opmath_t>{c1, s1, c2, s2}, pairs, args.layout);
      }
    });
  });
  return out;
}

at::Tensor rope_cos_sin_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, c10::string_view layout,
                            c10::string_view format) {
  return rope_cos_sin_cpu_impl("rope_cos_sin", x, cos, sin, layout, format, false);
}

at::Tensor rope_cos_sin_backward_cpu(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                                     c10::string_view layout, c10::string_view format) {
  return rope_cos_sin_cpu_impl("rope_cos_sin_backward", grad, cos, sin, layout, format, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("rope", TORCH_FN(rope_cpu));
  m.impl("rope_backward", TORCH_FN(rope_backward_cpu));
  m.impl("rope_qk", TORCH_FN(rope_qk_cpu));
  m.impl("rope_qk_backward", TORCH_FN(rope_qk_backward_cpu));
  m.impl("rope_", TORCH_FN(rope__cpu));
  m.impl("rope_cos_sin", TORCH_FN(rope_cos_sin_cpu));
  m.impl("rope_cos_sin_backward", TORCH_FN(rope_cos_sin_backward_cpu));
}

}  // namespace posenc
