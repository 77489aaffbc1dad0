// CUDA ops of the learned family: the CPU op layer's checks and outputs, table rows added by the additive
// kernel of cuda/additive.cuh; make_positions and positions_from_mask as ATen scans.
#include "common/learned.h"
#include "common/positions.h"
#include "cuda/additive.cuh"
#include "cuda/positions.cuh"

#include <ATen/Dispatch.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ne.h>
#include <ATen/ops/where.h>
#include <torch/library.h>


namespace posenc::cuda {
namespace {

// out = in * scale + table[rows[p] (or offset + p)]: the rows read by P positions, shared by the
// out.numel() / width / P leading indices.
template <typename scalar_t>
void add_rows(const scalar_t* in, const at::Tensor& ids, int64_t vocab, const at::Tensor& out, const at::Tensor& table,
              const at::Tensor& rows, int64_t num_positions, int64_t offset, double scale) {
  const int64_t width = out.size(-1);
  const scalar_t* table_data = table.const_data_ptr<scalar_t>();
  const TableEncoding<scalar_t> encoding{table_data, rows.defined() ? rows.const_data_ptr<int64_t>() : nullptr, offset,
                                         table.size(0), width};
  launch_additive<scalar_t>({in, ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr, vocab,
                             out.mutable_data_ptr<scalar_t>(), out.numel() / width / num_positions, num_positions,
                             width, width, 0, 0},
                            scale, encoding, aligned(table_data));
}

at::Tensor learned_cuda(const at::Tensor& weight, const at::Tensor& positions, int64_t offset,
                        std::optional<int64_t> padding_idx) {
  constexpr const char* op = "learned";
  check_learned(weight, positions, padding_idx);
  const c10::cuda::CUDAGuard guard(weight.device());
  const auto rows = table_rows(op, positions, 0, offset, table_domain(weight.size(0), "weight"));
  auto sizes = positions.sizes().vec();
  sizes.push_back(weight.size(1));
  auto out = at::empty(sizes, weight.options());
  if (out.numel() == 0) return out;
  const auto table = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, table.scalar_type(), "posenc_learned_cuda", [&] {
    add_rows<scalar_t>(nullptr, {}, 0, out, table, rows, rows.numel(), offset, 1.0);
  });
  return out;
}

at::Tensor add_learned_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& positions,
                            int64_t offset, std::optional<int64_t> padding_idx) {
  constexpr const char* op = "add_learned";
  check_add_learned(x, weight, positions, padding_idx);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t seq = x.size(-2);
  const auto rows = table_rows(op, positions, seq, offset, table_domain(weight.size(0), "weight"));
  const auto input = x.contiguous();
  auto out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  const auto table = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "posenc_add_learned_cuda", [&] {
    add_rows<scalar_t>(input.const_data_ptr<scalar_t>(), {}, 0, out, table, rows, rows.defined() ? rows.numel() : seq,
                       offset, 1.0);
  });
  return out;
}

at::Tensor embed_learned_cuda(const at::Tensor& tokens, const at::Tensor& token_weight, const at::Tensor& pos_weight,
                              const std::optional<at::Tensor>& positions, double token_scale,
                              std::optional<int64_t> padding_idx, int64_t offset,
                              std::optional<int64_t> pos_padding_idx) {
  constexpr const char* op = "embed_learned";
  check_embed_learned(tokens, token_weight, pos_weight, positions, padding_idx, pos_padding_idx);
  const c10::cuda::CUDAGuard guard(tokens.device());
  check_indices_in_range(op, "tokens", tokens, token_weight.size(0), "the vocabulary of token_weight, size");
  const int64_t seq = tokens.size(-1);
  const auto rows = table_rows(op, positions, seq, offset, table_domain(pos_weight.size(0), "pos_weight"));
  auto sizes = tokens.sizes().vec();
  sizes.push_back(token_weight.size(1));
  auto out = at::empty(sizes, token_weight.options());
  if (out.numel() == 0) return out;
  const auto ids = tokens.to(at::kLong).contiguous();
  const auto token_table = token_weight.contiguous();
  const auto pos_table = pos_weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, token_table.scalar_type(), "posenc_embed_learned_cuda", [&] {
    add_rows<scalar_t>(token_table.const_data_ptr<scalar_t>(), ids, token_table.size(0), out, pos_table, rows,
                       rows.defined() ? rows.numel() : seq, offset, token_scale);
  });
  return out;
}

// Each row of a [..., S] mask is scanned along S: real entries get first + (count of real entries before
// them), the others `pad` (the CPU's count_positions, as an ATen scan).
at::Tensor count_positions(const at::Tensor& is_real, int64_t first, int64_t pad) {
  // first + (real entries up to and including this one) - 1
  const auto numbered = at::add(at::cumsum(is_real, -1, at::kLong), first - 1);
  return at::where(is_real, numbered, pad).contiguous();
}

at::Tensor make_positions_cuda(const at::Tensor& tokens, int64_t padding_idx) {
  check_make_positions(tokens, padding_idx);
  const c10::cuda::CUDAGuard guard(tokens.device());
  return count_positions(at::ne(tokens.to(at::kLong), padding_idx), padding_idx + 1, padding_idx);
}

at::Tensor positions_from_mask_cuda(const at::Tensor& attention_mask, int64_t pad_position) {
  check_positions_from_mask(attention_mask);
  const c10::cuda::CUDAGuard guard(attention_mask.device());
  return count_positions(at::ne(attention_mask, 0), 0, pad_position);
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CUDA, m) {
  m.impl("learned", TORCH_FN(learned_cuda));
  m.impl("add_learned", TORCH_FN(add_learned_cuda));
  m.impl("embed_learned", TORCH_FN(embed_learned_cuda));
  m.impl("make_positions", TORCH_FN(make_positions_cuda));
  m.impl("positions_from_mask", TORCH_FN(positions_from_mask_cuda));
}

}  // namespace posenc::cuda
