// CPU kernel of embedding_backward: a scatter-add of gradient rows into a table, bitwise deterministic.
#include "common/embedding.h"
#include "common/parallel.h"
#include "common/positions.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

namespace posenc {
namespace {

// Threads split the channels, never the rows: every table entry sums its rows in row order, so the
// result is the same bits for any thread count.
at::Tensor embedding_backward_cpu(const at::Tensor& grad, const at::Tensor& indices, int64_t num_rows, double scale,
                                  std::optional<int64_t> padding_idx) {
  constexpr const char* op = "embedding_backward";
  check_embedding_backward(grad, indices, num_rows, padding_idx);
  check_indices_in_range(op, "indices", indices, num_rows, "num_rows");
  const int64_t width = grad.size(-1);
  const auto rows = grad.contiguous();
  const auto ids = indices.to(at::kLong).contiguous();
  const int64_t num_ids = ids.numel();
  const int64_t skip = padding_idx.value_or(-1);
  const auto acc_dtype = at::toOpMathType(grad.scalar_type());
  auto acc = at::zeros({num_rows, width}, grad.options().dtype(acc_dtype));
  if (num_ids == 0 || width == 0) return acc.to(grad.scalar_type());

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "posenc_embedding_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* src = rows.const_data_ptr<scalar_t>();
    const int64_t* id = ids.const_data_ptr<int64_t>();
    opmath_t* dst = acc.mutable_data_ptr<opmath_t>();
    const int64_t num_grad_rows = rows.numel() / width;
    const int64_t grain = std::max<int64_t>(16, kGrainSize / std::max<int64_t>(num_grad_rows, 1));
    at::parallel_for(0, width, grain, [&](int64_t begin, int64_t end) {
      for (const auto n : c10::irange(num_grad_rows)) {
        const int64_t row = id[n % num_ids];
        if (row == skip) continue;
        const scalar_t* g = src + n * width;
        opmath_t* w = dst + row * width;
        for (const auto d : c10::irange(begin, end)) w[d] += static_cast<opmath_t>(g[d]);
      }
    });
  });
  if (scale != 1.0) acc.mul_(scale);
  return acc.to(grad.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  m.impl("embedding_backward", TORCH_FN(embedding_backward_cpu));
}

}  // namespace posenc
