// CPU ops of the learned family: checks, table rows, allocation, dtype dispatch; the loops are in
// cpu/kernels/additive.cpp.
#include "common/learned.h"
#include "common/positions.h"
#include "cpu/kernels/additive.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ne.h>
#include <torch/library.h>


namespace posenc {
namespace {

// out = in * scale + table[table_rows[p]]: the rows read by P positions (shared by out's rows / P leading
// indices) added to out's rows.
template <typename scalar_t>
void add_rows(RowInput<scalar_t> in, const at::Tensor& out, const at::Tensor& table,
              const std::vector<int64_t>& table_rows, double scale) {
  const int64_t width = out.size(-1);
  cpu::learned_stub<scalar_t>({in, out.mutable_data_ptr<scalar_t>(), out.numel() / width, width,
                               table.const_data_ptr<scalar_t>(), table_rows.data(),
                               static_cast<int64_t>(table_rows.size()), scale});
}

at::Tensor learned_cpu(const at::Tensor& weight, const at::Tensor& positions, int64_t offset,
                       std::optional<int64_t> padding_idx) {
  constexpr const char* op = "learned";
  check_learned(weight, positions, padding_idx);
  const auto table_rows = read_positions<int64_t>(op, positions, 0, offset, table_domain(weight.size(0), "weight"));
  auto sizes = positions.sizes().vec();
  sizes.push_back(weight.size(1));
  auto out = at::empty(sizes, weight.options());
  if (out.numel() == 0) return out;
  const auto table = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, table.scalar_type(), "posenc_learned", [&] {
    add_rows<scalar_t>({}, out, table, table_rows, 1.0);
  });
  return out;
}

at::Tensor add_learned_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& positions,
                           int64_t offset, std::optional<int64_t> padding_idx) {
  constexpr const char* op = "add_learned";
  check_add_learned(x, weight, positions, padding_idx);
  const auto table_rows = read_positions<int64_t>(op, positions, x.size(-2), offset, table_domain(weight.size(0), "weight"));
  const auto input = x.contiguous();
  auto out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  const auto table = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_learned", [&] {
    add_rows<scalar_t>({input.const_data_ptr<scalar_t>()}, out, table, table_rows, 1.0);
  });
  return out;
}

at::Tensor embed_learned_cpu(const at::Tensor& tokens, const at::Tensor& token_weight, const at::Tensor& pos_weight,
                             const std::optional<at::Tensor>& positions, double token_scale,
                             std::optional<int64_t> padding_idx, int64_t offset,
                             std::optional<int64_t> pos_padding_idx) {
  constexpr const char* op = "embed_learned";
  check_embed_learned(tokens, token_weight, pos_weight, positions, padding_idx, pos_padding_idx);
  check_indices_in_range(op, "tokens", tokens, token_weight.size(0), "the vocabulary of token_weight, size");
  const auto table_rows =
      read_positions<int64_t>(op, positions, tokens.size(-1), offset, table_domain(pos_weight.size(0), "pos_weight"));
  auto sizes = tokens.sizes().vec();
  sizes.push_back(token_weight.size(1));
  auto out = at::empty(sizes, token_weight.options());
  if (out.numel() == 0) return out;
  const auto ids = tokens.to(at::kLong).contiguous();
  const auto token_table = token_weight.contiguous();
  const auto pos_table = pos_weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, token_table.scalar_type(), "posenc_embed_learned", [&] {
    add_rows<scalar_t>({token_table.const_data_ptr<scalar_t>(), ids.const_data_ptr<int64_t>()}, out, pos_table,
                       table_rows, token_scale);
  });
  return out;
}

// Each row of a [..., S] mask is scanned along S: real entries get first + (count of real entries before
// them), the others `pad`.
at::Tensor count_positions(const at::Tensor& is_real, int64_t first, int64_t pad) {
  const auto real = is_real.contiguous();
  auto out = at::empty(real.sizes(), real.options().dtype(at::kLong));
  if (out.numel() == 0) return out;
  const int64_t seq_len = real.size(-1);
  cpu::count_positions_stub(
      {real.const_data_ptr<bool>(), out.mutable_data_ptr<int64_t>(), real.numel() / seq_len, seq_len, first, pad});
  return out;
}

// fairseq: padding keeps padding_idx, real tokens count from padding_idx + 1.
at::Tensor make_positions_cpu(const at::Tensor& tokens, int64_t padding_idx) {
  check_make_positions(tokens, padding_idx);
  return count_positions(at::ne(tokens.to(at::kLong), padding_idx), padding_idx + 1, padding_idx);
}

// Left padding: real tokens (any nonzero mask value, NaN included) count from 0 (cumsum(mask) - 1), masked
// ones get pad_position.
at::Tensor positions_from_mask_cpu(const at::Tensor& attention_mask, int64_t pad_position) {
  check_positions_from_mask(attention_mask);
  return count_positions(at::ne(attention_mask, 0), 0, pad_position);
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
