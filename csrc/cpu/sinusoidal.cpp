// CPU kernels of the sinusoidal family: sin/cos of p * inv_freq written or added in a channel layout.
#include "common/angle.h"
#include "common/parallel.h"
#include "common/positions.h"
#include "common/sinusoidal.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

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

// out[n, :] = row(n) * scale + PE(position of row n). Positions shared by every leading index are
// encoded once into a [S, 2F] table; per-row positions are encoded row by row.
template <typename scalar_t, typename RowSource>
void add_encoding(const at::Tensor& positions, bool shared, const at::Tensor& inv_freq, SinusoidalLayout layout,
                  int64_t rows, int64_t width, double scale, RowSource row, scalar_t* out) {
  using opmath_t = at::opmath_type<scalar_t>;
  const double* pos = positions.const_data_ptr<double>();
  const double* freq = inv_freq.const_data_ptr<double>();
  const int64_t pairs = inv_freq.numel();
  const int64_t encoded = 2 * pairs;
  const int64_t seq_len = positions.numel();
  const auto row_scale = static_cast<opmath_t>(scale);

  std::vector<opmath_t> table;
  if (shared) {
    table.resize(seq_len * encoded);
    at::parallel_for(0, seq_len, rows_per_task(encoded), [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> scratch(encoded);
      for (const auto s : c10::irange(begin, end)) {
        encode_position(pos[s], freq, pairs, layout, &table[s * encoded], scratch.data());
      }
    });
  }
  at::parallel_for(0, rows, rows_per_task(width), [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> own(shared ? 0 : 2 * encoded);
    for (const auto n : c10::irange(begin, end)) {
      const opmath_t* pe = own.data();
      if (shared) {
        pe = &table[(n % seq_len) * encoded];
      } else {
        encode_position(pos[n], freq, pairs, layout, own.data(), own.data() + encoded);
      }
      const scalar_t* src = row(n);
      scalar_t* dst = out + n * width;
      for (const auto d : c10::irange(encoded)) {
        dst[d] = static_cast<scalar_t>(static_cast<opmath_t>(src[d]) * row_scale + pe[d]);
      }
      if (width > encoded) dst[encoded] = static_cast<scalar_t>(static_cast<opmath_t>(src[encoded]) * row_scale);
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
  const auto pos = positions_as_double(positions, 0, offset);
  const auto freq = inv_freq.to(at::kDouble).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "posenc_sinusoidal", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const double* p = pos.const_data_ptr<double>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, pos.numel(), rows_per_task(2 * pairs), [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> pe(4 * pairs);
      for (const auto n : c10::irange(begin, end)) {
        encode_position(p[n], freq.const_data_ptr<double>(), pairs, pair_layout, pe.data(), pe.data() + 2 * pairs);
        for (const auto d : c10::irange(2 * pairs)) dst[n * 2 * pairs + d] = static_cast<scalar_t>(pe[d]);
      }
    });
  });
  return out;
}

at::Tensor add_sinusoidal_cpu(const at::Tensor& x, const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                              double x_scale, c10::string_view layout, int64_t offset) {
  const bool shared = check_add_sinusoidal(x, positions, inv_freq, layout);
  const auto pair_layout = parse_sinusoidal_layout("add_sinusoidal", layout);
  const auto input = x.contiguous();
  auto out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (input.numel() == 0) return out;
  const int64_t width = input.size(-1);
  const auto pos = positions_as_double(positions, input.size(-2), offset);
  const auto freq = inv_freq.to(at::kDouble).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_sinusoidal", [&] {
    const scalar_t* src = input.const_data_ptr<scalar_t>();
    add_encoding<scalar_t>(pos, shared, freq, pair_layout, input.numel() / width, width, x_scale,
                           [&](int64_t n) { return src + n * width; }, out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor embed_sinusoidal_cpu(const at::Tensor& tokens, const at::Tensor& token_weight,
                                const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq, double token_scale,
                                std::optional<int64_t> padding_idx, c10::string_view layout, int64_t offset) {
  constexpr const char* op = "embed_sinusoidal";
  const bool shared = check_embed_sinusoidal(tokens, token_weight, positions, inv_freq, padding_idx, layout);
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
  const auto pos = positions_as_double(positions, tokens.size(-1), offset);
  const auto freq = inv_freq.to(at::kDouble).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "posenc_embed_sinusoidal", [&] {
    const scalar_t* table = weight.const_data_ptr<scalar_t>();
    const int64_t* id = ids.const_data_ptr<int64_t>();
    add_encoding<scalar_t>(pos, shared, freq, pair_layout, ids.numel(), width, token_scale,
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
