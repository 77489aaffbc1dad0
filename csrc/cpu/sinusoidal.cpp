// CPU kernels of the sinusoidal family: sin/cos of p * inv_freq written or added in a channel layout.
#include "common/angle.h"
#include "common/convert.h"
#include "common/parallel.h"
#include "common/positions.h"
#include "common/sinusoidal.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace posenc {
namespace {

// The encoding of one position, pe[0, 2F), in maths precision; `scratch` holds 2F values.
template <typename opmath_t>
void encode_position(double position, const double* inv_freq, int64_t pairs, SinusoidalLayout layout, opmath_t* pe,
                     opmath_t* scratch) {
  switch (layout) {
    case SinusoidalLayout::Half:
      sincos_row(position, inv_freq, pairs, pe, pe + pairs);
      break;
    case SinusoidalLayout::HalfCosFirst:
      sincos_row(position, inv_freq, pairs, pe + pairs, pe);
      break;
    case SinusoidalLayout::Interleaved:
      sincos_row(position, inv_freq, pairs, scratch, scratch + pairs);
      for (const auto i : c10::irange(pairs)) {
        pe[2 * i] = scratch[i];
        pe[2 * i + 1] = scratch[pairs + i];
      }
      break;
  }
}

// dst = src * scale + pe over one row, in maths precision, rounded once; an odd last channel has no encoding.
template <typename scalar_t>
void add_row(const scalar_t* __restrict__ src, const at::opmath_type<scalar_t>* __restrict__ pe,
             scalar_t* __restrict__ dst, int64_t encoded, int64_t width, at::opmath_type<scalar_t> scale) {
  for (int64_t d = 0; d < encoded; ++d) dst[d] = from_opmath<scalar_t>(to_opmath(src[d]) * scale + pe[d]);
  if (width > encoded) dst[encoded] = from_opmath<scalar_t>(to_opmath(src[encoded]) * scale);
}

// out[n, :] = row(n) * scale + PE(position of row n), rows n = l * P + p for P positions and L = rows / P
// leading indices (positions shared by the leading indices: P = S; one per row: P = rows, L = 1).
// The work is cut into tiles (block of positions, leading index), block-major: a tile is a contiguous run
// of rows, and a task encodes a block once, in maths precision, then streams the rows of every leading
// index it owns past the encodings, which stay in L2. sin/cos are thus computed about once per (position,
// frequency) however the tiles are split, and no table is bigger than a block; tiles also split a few
// positions with many leading indices (decoding: P = 1) over the threads. kGathered: rows come from a table
// in token order (embed_sinusoidal), so the next one is prefetched.
template <bool kGathered, typename scalar_t, typename RowSource>
void add_encoding(const PositionValues& positions, const double* inv_freq, int64_t pairs, SinusoidalLayout layout,
                  int64_t rows, int64_t width, double scale, RowSource row, scalar_t* out) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t encoded = 2 * pairs;
  const int64_t num_positions = positions.size();
  const int64_t leads = rows / num_positions;
  const auto row_scale = static_cast<opmath_t>(scale);
  const int64_t block = std::min(num_positions, rows_per_block(encoded * static_cast<int64_t>(sizeof(opmath_t))));
  const int64_t num_blocks = at::divup(num_positions, block);
  at::parallel_for(0, num_blocks * leads, rows_per_task(block * width), [&](int64_t begin, int64_t end) {
    // One block of encodings plus the interleaved layout's scratch row.
    std::vector<opmath_t> buffer((block + 1) * encoded);
    opmath_t* scratch = buffer.data() + block * encoded;
    int64_t encoded_block = -1;
    for (const auto tile : c10::irange(begin, end)) {
      const int64_t b = tile / leads;
      const int64_t first = b * block;
      const int64_t count = std::min(block, num_positions - first);
      if (b != encoded_block) {
        for (const auto p : c10::irange(count)) {
          encode_position(positions[first + p], inv_freq, pairs, layout, buffer.data() + p * encoded, scratch);
        }
        encoded_block = b;
      }
      const int64_t n0 = (tile % leads) * num_positions + first;
      for (const auto p : c10::irange(count)) {
        if (kGathered && p + 1 < count) prefetch_row(row(n0 + p + 1), width * static_cast<int64_t>(sizeof(scalar_t)));
        add_row(row(n0 + p), buffer.data() + p * encoded, out + (n0 + p) * width, encoded, width, row_scale);
      }
    }
  });
}

at::Tensor sinusoidal_cpu(const at::Tensor& positions, const at::Tensor& inv_freq, c10::string_view layout,
                          std::optional<at::ScalarType> dtype, int64_t offset) {
  const auto out_dtype = check_sinusoidal(positions, inv_freq, layout, dtype);
  const auto pair_layout = parse_sinusoidal_layout("sinusoidal", layout);

  const int64_t pairs = inv_freq.size(0);
  auto sizes = positions.sizes().vec();
  sizes.push_back(2 * pairs);
  auto out = at::empty(sizes, positions.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  const PositionValues pos(positions, 0, offset);
  const DoubleValues freq(inv_freq);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "posenc_sinusoidal", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const int64_t encoded = 2 * pairs;
    at::parallel_for(0, pos.size(), rows_per_task(encoded), [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> pe(2 * encoded);
      for (const auto n : c10::irange(begin, end)) {
        encode_position(pos[n], freq.data(), pairs, pair_layout, pe.data(), pe.data() + encoded);
        scalar_t* __restrict__ row = dst + n * encoded;
        for (int64_t d = 0; d < encoded; ++d) row[d] = from_opmath<scalar_t>(pe[d]);
      }
    });
  });
  return out;
}

at::Tensor add_sinusoidal_cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                              double x_scale, c10::string_view layout, int64_t offset) {
  check_add_sinusoidal(x, positions, inv_freq, layout);
  const auto pair_layout = parse_sinusoidal_layout("add_sinusoidal", layout);
  const auto input = x.contiguous();
  auto out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (input.numel() == 0) return out;
  const int64_t width = input.size(-1);
  const PositionValues pos(positions, input.size(-2), offset);
  const DoubleValues freq(inv_freq);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_sinusoidal", [&] {
    const scalar_t* src = input.const_data_ptr<scalar_t>();
    add_encoding</*kGathered=*/false, scalar_t>(
        pos, freq.data(), inv_freq.size(0), pair_layout, input.numel() / width, width, x_scale,
        [&](int64_t n) { return src + n * width; }, out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor embed_sinusoidal_cpu(const at::Tensor& tokens, const at::Tensor& token_weight,
                                const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double token_scale,
                                std::optional<int64_t> padding_idx, c10::string_view layout, int64_t offset) {
  constexpr const char* op = "embed_sinusoidal";
  check_embed_sinusoidal(tokens, token_weight, positions, inv_freq, padding_idx, layout);
  const auto pair_layout = parse_sinusoidal_layout(op, layout);
  const int64_t vocab = token_weight.size(0);
  const int64_t width = token_weight.size(1);
  check_indices_in_range(op, "tokens", tokens, vocab, "the vocabulary of token_weight, size");
  auto sizes = tokens.sizes().vec();
  sizes.push_back(width);
  auto out = at::empty(sizes, token_weight.options());
  if (out.numel() == 0) return out;
  const auto ids = tokens.to(at::kLong).contiguous();
  const auto weight = token_weight.contiguous();
  const PositionValues pos(positions, tokens.size(-1), offset);
  const DoubleValues freq(inv_freq);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_embed_sinusoidal", [&] {
    const scalar_t* table = weight.const_data_ptr<scalar_t>();
    const int64_t* id = ids.const_data_ptr<int64_t>();
    add_encoding</*kGathered=*/true, scalar_t>(
        pos, freq.data(), inv_freq.size(0), pair_layout, ids.numel(), width, token_scale,
        [&](int64_t n) { return table + id[n] * width; }, out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("sinusoidal", TORCH_FN(sinusoidal_cpu));
  m.impl("add_sinusoidal", TORCH_FN(add_sinusoidal_cpu));
  m.impl("embed_sinusoidal", TORCH_FN(embed_sinusoidal_cpu));
}

}  // namespace posenc
