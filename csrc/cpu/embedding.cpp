// CPU kernel of embedding_backward: a scatter-add of gradient rows into a table, bitwise deterministic.
#include "common/convert.h"
#include "common/embedding.h"
#include "common/parallel.h"
#include "common/positions.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace posenc {
namespace {

// Gradient rows grouped by the table row they go to, each group in increasing order (a stable counting
// sort): row r's gradient rows are order[start[r] .. start[r + 1]). The padding row gets none.
struct RowGroups {
  std::vector<int64_t> start;
  std::vector<int64_t> order;
};

RowGroups group_rows(const int64_t* id, int64_t num_ids, int64_t num_grad_rows, int64_t num_rows, int64_t skip) {
  RowGroups groups{std::vector<int64_t>(num_rows + 1, 0), {}};
  for (const auto n : c10::irange(num_grad_rows)) {
    const int64_t row = id[n % num_ids];
    if (row != skip) ++groups.start[row + 1];
  }
  for (const auto r : c10::irange(num_rows)) groups.start[r + 1] += groups.start[r];
  groups.order.resize(groups.start[num_rows]);
  std::vector<int64_t> next(groups.start.begin(), groups.start.end() - 1);
  for (const auto n : c10::irange(num_grad_rows)) {
    const int64_t row = id[n % num_ids];
    if (row != skip) groups.order[next[row]++] = n;
  }
  return groups;
}

// Threads split the table rows: each table row sums its gradient rows in row order, whichever thread
// owns it, so the result is the same bits for any thread count, and each thread writes whole rows
// (long contiguous runs of the table) and reads whole gradient rows. Each entry is accumulated in maths
// precision and written once, so no float copy of the table is needed for fp16/bf16.
at::Tensor embedding_backward_cpu(const at::Tensor& grad, const at::Tensor& indices, int64_t num_rows, double scale,
                                  std::optional<int64_t> padding_idx) {
  constexpr const char* op = "embedding_backward";
  check_embedding_backward(grad, indices, num_rows, padding_idx);
  check_indices_in_range(op, "indices", indices, num_rows, "num_rows");
  const int64_t width = grad.size(-1);
  auto out = at::empty({num_rows, width}, grad.options());
  if (out.numel() == 0) return out;
  const auto rows = grad.contiguous();
  const auto ids = indices.to(at::kLong).contiguous();
  const int64_t num_ids = ids.numel();
  const int64_t num_grad_rows = rows.numel() / width;
  const auto groups = group_rows(ids.const_data_ptr<int64_t>(), num_ids, num_grad_rows, num_rows,
                                 padding_idx.value_or(-1));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_embedding_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* src = rows.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const auto row_scale = static_cast<opmath_t>(scale);
    // A table row costs its width to write plus its width per gradient row: on average
    // (1 + num_grad_rows / num_rows) rows of work.
    const int64_t work_per_row = width + width * num_grad_rows / std::max<int64_t>(num_rows, 1);
    at::parallel_for(0, num_rows, rows_per_task(work_per_row), [&](int64_t begin, int64_t end) {
      std::vector<opmath_t> sum(width);
      opmath_t* __restrict__ acc = sum.data();
      // Gradient rows are read in table-row order, so scattered: the next one is prefetched.
      const int64_t last_of_task = groups.start[end];
      const int64_t row_bytes = width * static_cast<int64_t>(sizeof(scalar_t));
      for (const auto r : c10::irange(begin, end)) {
        scalar_t* __restrict__ w = dst + r * width;
        const int64_t first = groups.start[r];
        const int64_t last = groups.start[r + 1];
        if (first == last) {
          std::fill_n(w, width, scalar_t(0));
          continue;
        }
        // The sum starts from +0 (so a lone -0 gradient gives +0, as the sum of several does).
        for (const auto k : c10::irange(first, last)) {
          if (k + 1 < last_of_task) prefetch_row(src + groups.order[k + 1] * width, row_bytes);
          const scalar_t* __restrict__ g = src + groups.order[k] * width;
          if (k == first) {
            for (int64_t d = 0; d < width; ++d) acc[d] = opmath_t(0) + to_opmath(g[d]);
          } else {
            for (int64_t d = 0; d < width; ++d) acc[d] += to_opmath(g[d]);
          }
        }
        for (int64_t d = 0; d < width; ++d) w[d] = from_opmath<scalar_t>(acc[d] * row_scale);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("embedding_backward", TORCH_FN(embedding_backward_cpu));
}

}  // namespace posenc
