// Context parallelism's dual-chunk (zigzag) split: the positions of one rank's tokens, for one sequence or for
// packed sequences.
#include <posenc/rope.h>

#include "common/checks.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/where.h>

#include <limits>

namespace posenc {

namespace {

void check_cp(const char* op, int64_t cp_size, int64_t cp_rank) {
  TORCH_CHECK_VALUE(cp_size >= 1, "posenc.", op, ": cp_size must be at least 1, got ", cp_size);
  // The sequence is cut into 2 * cp_size chunks: that count must not overflow.
  TORCH_CHECK_VALUE(cp_size <= std::numeric_limits<int64_t>::max() / 2, "posenc.", op,
                    ": cp_size must be at most 2^62, got ", cp_size);
  TORCH_CHECK_VALUE(cp_rank >= 0 && cp_rank < cp_size, "posenc.", op, ": cp_rank ", cp_rank, " is outside [0, ",
                    cp_size, ")");
}

}  // namespace

at::Tensor zigzag_positions(int64_t seq_len, int64_t cp_size, int64_t cp_rank, at::TensorOptions options) {
  constexpr const char* op = "zigzag_positions";
  check_cp(op, cp_size, cp_rank);
  TORCH_CHECK_VALUE(seq_len >= 0 && seq_len % (2 * cp_size) == 0, "posenc.", op, ": seq_len ", seq_len,
                    " must be a multiple of 2 * cp_size = ", 2 * cp_size);
  const int64_t chunk = seq_len / (2 * cp_size);
  const int64_t mirror = 2 * cp_size - 1 - cp_rank;
  return at::cat({at::arange(cp_rank * chunk, (cp_rank + 1) * chunk, options),
                  at::arange(mirror * chunk, (mirror + 1) * chunk, options)});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> zigzag_positions_varlen(const at::Tensor& cu_seqlens, int64_t cp_size,
                                                                       int64_t cp_rank) {
  constexpr const char* op = "zigzag_positions_varlen";
  check_cp(op, cp_size, cp_rank);
  check_index(op, "cu_seqlens", cu_seqlens);
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, "posenc.", op,
              ": cu_seqlens must be 1-D [num_sequences + 1], got shape ", cu_seqlens.sizes());
  const auto cu = cu_seqlens.to(at::kLong);
  const auto lengths = cu.slice(0, 1).sub(cu.slice(0, 0, -1));
  // Compared, not subtracted: a difference of far-apart values would wrap around.
  const bool ordered = cu.slice(0, 1).ge(cu.slice(0, 0, -1)).all().item<bool>();
  TORCH_CHECK_VALUE(cu[0].item<int64_t>() == 0 && ordered, "posenc.", op,
                    ": cu_seqlens must start at 0 and never decrease, got ", cu_seqlens);
  TORCH_CHECK_VALUE(lengths.remainder(2 * cp_size).eq(0).all().item<bool>(), "posenc.", op,
                    ": every sequence length must be a multiple of 2 * cp_size = ", 2 * cp_size, ", got cu_seqlens ",
                    cu_seqlens);
  const auto chunk = lengths.div(2 * cp_size, "floor");
  const auto local_cu = cu.div(cp_size, "floor");
  const auto sequence = at::repeat_interleave(at::arange(lengths.size(0), cu.options()), chunk.mul(2));
  const auto local = at::arange(local_cu[-1].item<int64_t>(), cu.options()).sub(local_cu.index_select(0, sequence));
  const auto c = chunk.index_select(0, sequence);
  // The first half of a sequence's local tokens is chunk cp_rank, the second its mirror 2 cp_size - 1 - cp_rank.
  const auto positions = at::where(local.lt(c), c.mul(cp_rank).add(local),
                                   c.mul(2 * cp_size - 1 - cp_rank).add(local.sub(c)));
  const auto indices = cu.index_select(0, sequence).add(positions);
  return {positions, indices, local_cu.to(cu_seqlens.scalar_type())};
}

}  // namespace posenc
