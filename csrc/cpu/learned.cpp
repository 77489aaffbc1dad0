// CPU kernels of the learned family: rows of position (and token) tables gathered, scaled and added.
#include "common/convert.h"
#include "common/learned.h"
#include "common/parallel.h"
#include "common/positions.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace posenc {
namespace {

// The row of the position table each position reads: positions (or arange(seq_len)) plus offset, every
// one checked against [0, L_max) before any kernel touches the table. The error names the position
// and L_max, and where the position came from.
std::vector<int64_t> position_rows(const char* op, const char* table, const std::optional<at::Tensor>& positions,
                                   int64_t seq_len, int64_t offset, int64_t max_positions) {
  std::vector<int64_t> rows;
  auto check = [&](int64_t value, int64_t n, bool overflow, int64_t row) {
    TORCH_CHECK(!overflow && row >= 0 && row < max_positions, "posenc.", op, ": position ",
                (overflow ? "(overflow)" : std::to_string(row)), " is outside [0, L_max) with L_max = ",
                max_positions, " (the rows of ", table, "); it is ",
                (positions ? "positions.flatten()[" : "arange(S)["), n, "] = ", value, " plus offset ", offset);
  };
  if (!positions) {
    rows.resize(seq_len);
    for (const auto s : c10::irange(seq_len)) {
      const bool overflow = c10::add_overflows(s, offset, &rows[s]);
      check(s, s, overflow, rows[s]);
    }
    return rows;
  }
  const auto values = positions->contiguous();
  rows.resize(values.numel());
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "posenc_position_rows", [&] {
    const index_t* p = values.const_data_ptr<index_t>();
    for (const auto n : c10::irange(values.numel())) {
      const auto value = static_cast<int64_t>(p[n]);
      const bool overflow = c10::add_overflows(value, offset, &rows[n]);
      check(value, n, overflow, rows[n]);
    }
  });
  return rows;
}

// dst = src * scale + pe over one row, in maths precision, rounded once.
template <typename scalar_t>
void add_row(const scalar_t* __restrict__ src, const scalar_t* __restrict__ pe, scalar_t* __restrict__ dst,
             int64_t width, at::opmath_type<scalar_t> scale) {
  for (int64_t d = 0; d < width; ++d) dst[d] = from_opmath<scalar_t>(to_opmath(src[d]) * scale + to_opmath(pe[d]));
}

// out[n, :] = source(n) * scale + table[rows[p], :] for the rows n = l * P + p, P = rows.size() positions
// (shared by L = num_out_rows / P leading indices, or one per row: L = 1). The work is cut into tiles
// (block of positions, leading index), block-major: a tile is a contiguous run of rows, and a task streams
// the rows of every leading index it owns past the block's table rows, which stay in L2, so the table is
// read from memory about once per call, not once per leading index. kGathered: source rows come from a table
// in token order (embed_learned), so the next one is prefetched.
template <bool kGathered, typename scalar_t, typename Source>
void add_table_rows(const scalar_t* table, const std::vector<int64_t>& rows, int64_t num_out_rows, int64_t width,
                    Source source, double scale, scalar_t* out) {
  const auto row_scale = static_cast<at::opmath_type<scalar_t>>(scale);
  const auto num_positions = static_cast<int64_t>(rows.size());
  const int64_t leads = num_out_rows / num_positions;
  const int64_t block = std::min(num_positions, rows_per_block(width * static_cast<int64_t>(sizeof(scalar_t))));
  const int64_t num_blocks = at::divup(num_positions, block);
  at::parallel_for(0, num_blocks * leads, rows_per_task(block * width), [&](int64_t begin, int64_t end) {
    for (const auto tile : c10::irange(begin, end)) {
      const int64_t first = (tile / leads) * block;
      const int64_t last = std::min(num_positions, first + block);
      const int64_t n0 = (tile % leads) * num_positions;
      for (const auto p : c10::irange(first, last)) {
        if (kGathered && p + 1 < last) prefetch_row(source(n0 + p + 1), width * static_cast<int64_t>(sizeof(scalar_t)));
        add_row(source(n0 + p), table + rows[p] * width, out + (n0 + p) * width, width, row_scale);
      }
    }
  });
}

at::Tensor learned_cpu(const at::Tensor& weight, const at::Tensor& positions, int64_t offset,
                       std::optional<int64_t> padding_idx) {
  check_learned(weight, positions, padding_idx);
  const int64_t width = weight.size(1);
  const auto rows = position_rows("learned", "weight", positions, 0, offset, weight.size(0));
  auto sizes = positions.sizes().vec();
  sizes.push_back(width);
  auto out = at::empty(sizes, weight.options());
  if (out.numel() == 0) return out;
  const auto table = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, table.scalar_type(), "posenc_learned", [&] {
    const scalar_t* src = table.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(rows.size()), rows_per_task(width), [&](int64_t begin, int64_t end) {
      for (const auto n : c10::irange(begin, end)) {
        std::copy_n(src + rows[n] * width, width, dst + n * width);
      }
    });
  });
  return out;
}

at::Tensor add_learned_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& positions,
                           int64_t offset, std::optional<int64_t> padding_idx) {
  check_add_learned(x, weight, positions, padding_idx);
  const int64_t width = x.size(-1);
  const auto rows = position_rows("add_learned", "weight", positions, x.size(-2), offset, weight.size(0));
  const auto input = x.contiguous();
  auto out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  const auto table = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_learned", [&] {
    const scalar_t* src = input.const_data_ptr<scalar_t>();
    add_table_rows</*kGathered=*/false, scalar_t>(
        table.const_data_ptr<scalar_t>(), rows, input.numel() / width, width,
        [&](int64_t n) { return src + n * width; }, 1.0, out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor embed_learned_cpu(const at::Tensor& tokens, const at::Tensor& token_weight, const at::Tensor& pos_weight,
                             const std::optional<at::Tensor>& positions, double token_scale,
                             std::optional<int64_t> padding_idx, int64_t offset,
                             std::optional<int64_t> pos_padding_idx) {
  constexpr const char* op = "embed_learned";
  check_embed_learned(tokens, token_weight, pos_weight, positions, padding_idx, pos_padding_idx);
  const int64_t vocab = token_weight.size(0);
  const int64_t width = token_weight.size(1);
  check_indices_in_range(op, "tokens", tokens, vocab, "the vocabulary of token_weight, size");
  const auto rows = position_rows(op, "pos_weight", positions, tokens.size(-1), offset, pos_weight.size(0));
  auto sizes = tokens.sizes().vec();
  sizes.push_back(width);
  auto out = at::empty(sizes, token_weight.options());
  if (out.numel() == 0) return out;
  const auto ids = tokens.to(at::kLong).contiguous();
  const auto token_table = token_weight.contiguous();
  const auto pos_table = pos_weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, token_table.scalar_type(), "posenc_embed_learned", [&] {
    const scalar_t* words = token_table.const_data_ptr<scalar_t>();
    const int64_t* id = ids.const_data_ptr<int64_t>();
    add_table_rows</*kGathered=*/true, scalar_t>(
        pos_table.const_data_ptr<scalar_t>(), rows, ids.numel(), width,
        [&](int64_t n) { return words + id[n] * width; }, token_scale, out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

// Scans each row of a [..., S] tensor along S, counting the entries `is_real` accepts: real entries
// get first + (count - 1), the others `pad`.
template <typename scalar_t, typename IsReal>
at::Tensor count_positions(const at::Tensor& input, IsReal is_real, int64_t first, int64_t pad) {
  const auto values = input.contiguous();
  auto out = at::empty(values.sizes(), values.options().dtype(at::kLong));
  const int64_t seq_len = values.size(-1);
  if (out.numel() == 0) return out;
  const scalar_t* src = values.const_data_ptr<scalar_t>();
  int64_t* dst = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, values.numel() / seq_len, rows_per_task(seq_len), [&](int64_t begin, int64_t end) {
    for (const auto b : c10::irange(begin, end)) {
      int64_t next = first;
      for (const auto s : c10::irange(b * seq_len, (b + 1) * seq_len)) {
        const bool real = is_real(src[s]);
        dst[s] = real ? next : pad;
        next += real;
      }
    }
  });
  return out;
}

// fairseq: padding keeps padding_idx, real tokens count from padding_idx + 1.
at::Tensor make_positions_cpu(const at::Tensor& tokens, int64_t padding_idx) {
  check_make_positions(tokens);
  // The last position is padding_idx + S: it must fit in int64.
  const int64_t seq_len = tokens.size(-1);
  TORCH_CHECK(padding_idx < std::numeric_limits<int64_t>::max() - seq_len, "posenc.make_positions: padding_idx ",
              padding_idx, " leaves no room for ", seq_len, " positions in int64");
  at::Tensor out;
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "posenc_make_positions", [&] {
    out = count_positions<index_t>(tokens, [&](index_t t) { return static_cast<int64_t>(t) != padding_idx; },
                                   padding_idx + 1, padding_idx);
  });
  return out;
}

// Left padding: real tokens count from 0 (cumsum(mask) - 1), masked ones get pad_position.
at::Tensor positions_from_mask_cpu(const at::Tensor& attention_mask, int64_t pad_position) {
  check_positions_from_mask(attention_mask);
  at::Tensor out;
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, attention_mask.scalar_type(),
                             "posenc_positions_from_mask", [&] {
    out = count_positions<scalar_t>(attention_mask, [](scalar_t m) { return static_cast<double>(m) != 0.0; }, 0,
                                    pad_position);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("learned", TORCH_FN(learned_cpu));
  m.impl("add_learned", TORCH_FN(add_learned_cpu));
  m.impl("embed_learned", TORCH_FN(embed_learned_cpu));
  m.impl("make_positions", TORCH_FN(make_positions_cpu));
  m.impl("positions_from_mask", TORCH_FN(positions_from_mask_cpu));
}

}  // namespace posenc
