// How fast qk_norm_rope's bf16 forward and float32 backward could go on this core: the least arithmetic of each,
// written out with AVX-512 intrinsics for one shape (head_dim 128, neox, a weight per head, q 16 + k 8 heads a
// token), timed on one thread. Not the library's code and not its bits (its sums add in another order): a bound on
// what any implementation of the same roundings can reach, for docs/benchmarks-log.md ("QK-norm's bf16 forward
// against its arithmetic floor").
//
//   g++ -O3 -march=x86-64-v4 -ffp-contract=off scripts/probe_qk_norm_floor.cpp -o /tmp/probe && /tmp/probe
//
// With `-mavx512bf16 -DROUND_BY_BF16` every bf16 rounding is AVX-512 BF16's vcvtneps2bf16 instead, without the
// fix-ups its results need to be the conventions' bits (it flushes denormals and keeps NaN payloads): a lower bound
// for an implementation by that instruction.
//
// Per 16 channels the rows need: the widening of bf16 (2 instructions), the sum of squares (2), x * r and w * z
// (2), one integer round-to-nearest-even per rounding the convention asks for (5, and 2 more for the NaN select
// where a NaN may carry a payload below bit 16), the rotation (3), the stored rounding with its NaN select and
// narrowing (8). The backward per 16 channels: the gradient rotated back (3), through the norm into the weight
// gradient and the gradient of xhat (5, the weight gradient loaded and stored), the sum of g * xhat (3), the input
// gradient (5 and a store); its two sums per head are the chains.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kHeadDim = 128;
constexpr int kHeads = 24;  // q's 16 and k's 8 heads of a token
constexpr int kTokens = 4;  // 48 KiB read and 48 KiB written per pass: L1 and L2

// Round to nearest even at bf16's precision, kept in 32-bit lanes; kSelect: every NaN to 0x7FC00000 first.
template <bool kSelect>
__m512 round_bf16(__m512 v) {
#ifdef ROUND_BY_BF16
  const __m256i narrowed = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrowed), 16));
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  __m512i rounded = _mm512_and_si512(sum, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  if (kSelect) {
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  }
  return _mm512_castsi512_ps(rounded);
}

// The stored rounding: nearest even, every NaN 0x7FC0, narrowed to 16 bits.
__m256i narrow_bf16(__m512 v) {
#ifdef ROUND_BY_BF16
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#endif
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16<true>(v)), 16));
}

__m512 widen_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One token: every head's inverse RMS first (independent chains), then each head normalized, rotated and stored.
// kRoundings: 2 "llama" (x * r rounded, then w times it rounded), 1 "gemma"/"olmo2" (w * x * r rounded once), 0
// "fused". kInnerSelect: the NaN select on the first of llama's roundings too. kSums: false gives every head the
// same r (the rows' arithmetic alone).
template <int kRoundings, bool kInnerSelect, bool kSums>
__attribute__((noinline)) void token(const uint16_t* in, const float* w, const float* cos, const float* sin,
                                     uint16_t* out, float eps) {
  float inv_rms[kHeads];
  for (int h = 0; h < kHeads; ++h) {
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; kSums && i < kHeadDim; i += 16) {
      const __m512 x = widen_bf16(in + h * kHeadDim + i);
      sum = _mm512_add_ps(sum, _mm512_mul_ps(x, x));
    }
    inv_rms[h] = kSums ? 1.0f / std::sqrt(_mm512_reduce_add_ps(sum) / kHeadDim + eps) : eps;
  }
  for (int h = 0; h < kHeads; ++h, in += kHeadDim, out += kHeadDim) {
    const __m512 r = _mm512_set1_ps(inv_rms[h]);
    __m512 z[kHeadDim / 16];
    for (int i = 0; i < kHeadDim / 16; ++i) {
      const __m512 xr = _mm512_mul_ps(widen_bf16(in + 16 * i), r);
      const __m512 wi = _mm512_loadu_ps(w + 16 * i);
      if (kRoundings == 2) z[i] = round_bf16<true>(_mm512_mul_ps(wi, round_bf16<kInnerSelect>(xr)));
      if (kRoundings == 1) z[i] = round_bf16<true>(_mm512_mul_ps(wi, xr));
      if (kRoundings == 0) z[i] = _mm512_mul_ps(wi, xr);
    }
    for (int i = 0; i < kHeadDim / 32; ++i) {  // pairs (d, d + 64)
      const __m512 c = _mm512_loadu_ps(cos + 16 * i);
      const __m512 s = _mm512_loadu_ps(sin + 16 * i);
      const __m512 a = z[i];
      const __m512 b = z[i + kHeadDim / 32];
      const __m512 first = _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s));
      const __m512 second = _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * i), narrow_bf16(first));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kHeadDim / 2 + 16 * i), narrow_bf16(second));
    }
  }
}

__attribute__((noinline)) void copy(const uint16_t* in, const float*, const float*, const float*, uint16_t* out,
                                    float) {
  std::memcpy(out, in, kHeads * kHeadDim * sizeof(uint16_t));
}

// The float32 backward of one token, head by head: gz, the gradient rotated back; gw += gz * xhat; g = gz * w;
// then r * (g - xhat * mean(g * xhat)) stored.
__attribute__((noinline)) void backward_token(const float* grad, const float* x, const float* w, const float* cos,
                                              const float* sin, float* gw, float* out, float eps) {
  alignas(64) float g[kHeadDim];
  float inv_rms[kHeads];
  for (int h = 0; h < kHeads; ++h) {
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < kHeadDim; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + h * kHeadDim + i);
      sum = _mm512_add_ps(sum, _mm512_mul_ps(v, v));
    }
    inv_rms[h] = 1.0f / std::sqrt(_mm512_reduce_add_ps(sum) / kHeadDim + eps);
  }
  constexpr int kHalf = kHeadDim / 2;
  for (int h = 0; h < kHeads; ++h, grad += kHeadDim, x += kHeadDim, out += kHeadDim) {
    const __m512 r = _mm512_set1_ps(inv_rms[h]);
    __m512 dot = _mm512_setzero_ps();
    for (int i = 0; i < kHalf; i += 16) {
      const __m512 a = _mm512_loadu_ps(grad + i), b = _mm512_loadu_ps(grad + kHalf + i);
      const __m512 c = _mm512_loadu_ps(cos + i), s = _mm512_loadu_ps(sin + i);
      const __m512 gz[2] = {_mm512_add_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)),
                            _mm512_sub_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s))};
      for (int half = 0; half < 2; ++half) {
        const int d = i + half * kHalf;
        const __m512 xhat = _mm512_mul_ps(_mm512_loadu_ps(x + d), r);
        _mm512_storeu_ps(gw + d, _mm512_add_ps(_mm512_loadu_ps(gw + d), _mm512_mul_ps(gz[half], xhat)));
        const __m512 gd = _mm512_mul_ps(gz[half], _mm512_loadu_ps(w + d));
        _mm512_store_ps(g + d, gd);
        dot = _mm512_add_ps(dot, _mm512_mul_ps(gd, xhat));
      }
    }
    const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(dot) / kHeadDim);
    for (int d = 0; d < kHeadDim; d += 16) {
      const __m512 xhat = _mm512_mul_ps(_mm512_loadu_ps(x + d), r);
      _mm512_storeu_ps(out + d, _mm512_mul_ps(r, _mm512_sub_ps(_mm512_load_ps(g + d), _mm512_mul_ps(xhat, mean))));
    }
  }
}

// ns per head of the float32 backward, median of 15 runs over `tokens` tokens (64: 3 MiB an array, as the library's
// in-cache figures; 8192: the bench shape's 100 MB, from memory).
double backward_ns_per_head(int tokens) {
  const size_t n = static_cast<size_t>(tokens) * kHeads * kHeadDim;
  std::vector<float> grad(n), x(n), out(n), w(kHeadDim, 1.1f), gw(kHeadDim), cos(kHeadDim / 2), sin(kHeadDim / 2);
  for (size_t i = 0; i < n; ++i) x[i] = 0.5f + (i * 37 % 101) / 100.0f, grad[i] = (i * 13 % 97) / 97.0f - 0.5f;
  for (int i = 0; i < kHeadDim / 2; ++i) cos[i] = std::cos(0.1f * i), sin[i] = std::sin(0.1f * i);
  const int passes = std::max(3, 80000 / tokens);
  std::vector<double> runs;
  for (int run = 0; run < 15; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int pass = 0; pass < passes; ++pass) {
      for (int t = 0; t < tokens; ++t) {
        const size_t at = static_cast<size_t>(t) * kHeads * kHeadDim;
        backward_token(grad.data() + at, x.data() + at, w.data(), cos.data(), sin.data(), gw.data(), out.data() + at,
                       1e-6f);
      }
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    runs.push_back(took.count() / (double(passes) * tokens * kHeads));
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2] + (gw[3] == 12345.0f);  // the weight gradient is used
}

using Token = void (*)(const uint16_t*, const float*, const float*, const float*, uint16_t*, float);

// ns per head, median of 15 runs of 20000 passes over the tokens.
double ns_per_head(Token fn, const std::vector<uint16_t>& in, std::vector<uint16_t>& out, const float* w,
                   const float* cos, const float* sin) {
  std::vector<double> runs;
  for (int run = 0; run < 15; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int pass = 0; pass < 20000; ++pass) {
      for (int t = 0; t < kTokens; ++t) {
        fn(in.data() + t * kHeads * kHeadDim, w, cos, sin, out.data() + t * kHeads * kHeadDim, 1e-6f);
      }
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    runs.push_back(took.count() / (20000.0 * kTokens * kHeads));
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

}  // namespace

int main() {
  std::vector<uint16_t> in(kTokens * kHeads * kHeadDim), out(in.size());
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint16_t>(0x3F00 + (i * 37) % 255);  // 0.5 .. 2
  std::vector<float> w(kHeadDim, 1.0f), cos(kHeadDim / 2), sin(kHeadDim / 2);
  for (int i = 0; i < kHeadDim / 2; ++i) cos[i] = std::cos(0.1f * i), sin[i] = std::sin(0.1f * i);
  const auto time = [&](Token fn) { return ns_per_head(fn, in, out, w.data(), cos.data(), sin.data()); };
#ifdef ROUND_BY_BF16
  std::printf("ns per head, one thread, in cache (median of 15); bf16 rounded by vcvtneps2bf16, no fix-ups\n");
#else
  std::printf("ns per head, one thread, in cache (median of 15); bf16 rounded by integer arithmetic\n");
#endif
  std::printf("  llama, every rounding with its NaN select:  %5.1f\n", time(&token<2, true, true>));
  std::printf("  llama, the first rounding without:          %5.1f\n", time(&token<2, false, true>));
  std::printf("  gemma / olmo2 (one rounding):               %5.1f\n", time(&token<1, true, true>));
  std::printf("  fused (no rounding before the store):       %5.1f\n", time(&token<0, true, true>));
  std::printf("  llama rows alone (r given, no sums):        %5.1f\n", time(&token<2, false, false>));
  std::printf("  gemma rows alone:                           %5.1f\n", time(&token<1, true, false>));
  std::printf("  fused rows alone:                           %5.1f\n", time(&token<0, true, false>));
  std::printf("  memcpy of the rows:                         %5.1f\n", time(&copy));
  std::printf("float32 backward, 64 tokens (3 MiB an array):   %5.1f\n", backward_ns_per_head(64));
  std::printf("float32 backward, 8192 tokens (100 MB, memory):   %5.1f\n", backward_ns_per_head(8192));
  return out[5] == 0x1234;  // the outputs are used
}
