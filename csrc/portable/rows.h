#pragma once
// Row adders of the additive families (sinusoidal, learned): out = in * scale + pe over one row, in maths
// precision, rounded once. `pe` is the encoding (maths precision: sinusoidal) or a table row (storage
// precision: learned); the row's channels past `encoded` (an odd width's last channel) get no encoding.
#include "portable/convert.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace posenc::portable {
inline namespace POSENC_KERNEL_NAMESPACE {

#if !defined(__CUDACC__)
template <typename scalar_t, typename pe_t>
void add_row_direct(const scalar_t* __restrict__ in, const pe_t* __restrict__ pe, scalar_t* __restrict__ out,
                    int64_t encoded, int64_t width, opmath_t<scalar_t> scale) {
  if (in == nullptr) {  // the encoding alone
    for (int64_t d = 0; d < encoded; ++d) out[d] = from_opmath<scalar_t>(to_opmath(pe[d]));
    return;
  }
  for (int64_t d = 0; d < encoded; ++d) out[d] = from_opmath<scalar_t>(to_opmath(in[d]) * scale + to_opmath(pe[d]));
  for (int64_t d = encoded; d < width; ++d) out[d] = from_opmath<scalar_t>(to_opmath(in[d]) * scale);
}

// fp16 goes through float blocks, so that the capabilities with F16C convert eight values per instruction
// (the same bits as to_opmath / from_opmath).
template <typename pe_t>
void add_row_half(const c10::Half* in, const pe_t* pe, c10::Half* out, int64_t encoded, int64_t width, float scale) {
  constexpr int64_t kBlock = 256;
  float x[kBlock];
  float e[kBlock];
  for (int64_t d0 = 0; d0 < width; d0 += kBlock) {
    const int64_t n = std::min(kBlock, width - d0);
    const int64_t with_pe = std::clamp<int64_t>(encoded - d0, 0, n);
    const float* pe_block;
    if constexpr (std::is_same_v<pe_t, float>) {
      pe_block = pe + d0;
    } else {
      widen(pe + d0, e, with_pe);
      pe_block = e;
    }
    if (in == nullptr) {
      narrow(pe_block, out + d0, with_pe);
      continue;
    }
    widen(in + d0, x, n);
    for (int64_t d = 0; d < with_pe; ++d) x[d] = x[d] * scale + pe_block[d];
    for (int64_t d = with_pe; d < n; ++d) x[d] = x[d] * scale;
    narrow(x, out + d0, n);
  }
}

// out = in * scale + pe (in == nullptr: out = pe) over `width` channels, the first `encoded` with pe.
template <typename scalar_t, typename pe_t>
inline void add_row(const scalar_t* in, const pe_t* pe, scalar_t* out, int64_t encoded, int64_t width,
                    opmath_t<scalar_t> scale) {
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    add_row_half(in, pe, out, encoded, width, scale);
  } else {
    add_row_direct(in, pe, out, encoded, width, scale);
  }
}
#endif

}  // namespace POSENC_KERNEL_NAMESPACE
}  // namespace posenc::portable
