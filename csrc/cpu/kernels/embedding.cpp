// embedding_backward, compiled once per CPU capability: a scatter-add of gradient rows into a table, bitwise
// deterministic.
#include "cpu/kernels/capability.h"
#include "cpu/kernels/embedding.h"

POSENC_KERNELS_BEGIN
#include "portable/convert.h"
#include "portable/tiling.h"

namespace posenc::cpu {
inline namespace POSENC_CPU_CAPABILITY {
namespace {

using namespace posenc::portable;

// Gradient rows grouped by the table row they go to, each group in increasing order (a stable counting
// sort): row r's gradient rows are order[start[r] .. start[r + 1]). The skipped (padding) row gets none.
struct RowGroups {
  std::vector<int64_t> start;
  std::vector<int64_t> order;
};

RowGroups group_rows(const int64_t* id, int64_t num_ids, int64_t num_grad_rows, int64_t num_rows, int64_t skip) {
  RowGroups groups{std::vector<int64_t>(num_rows + 1, 0), {}};
  for (int64_t n = 0; n < num_grad_rows; ++n) {
    const int64_t row = id[n % num_ids];
    if (row != skip) ++groups.start[row + 1];
  }
  for (int64_t r = 0; r < num_rows; ++r) groups.start[r + 1] += groups.start[r];
  groups.order.resize(groups.start[num_rows]);
  std::vector<int64_t> next(groups.start.begin(), groups.start.end() - 1);
  for (int64_t n = 0; n < num_grad_rows; ++n) {
    const int64_t row = id[n % num_ids];
    if (row != skip) groups.order[next[row]++] = n;
  }
  return groups;
}

// acc = +0 + v (start) or acc + v, v widened to maths precision value by value.
template <typename T, typename opmath>
void accumulate(const T* __restrict__ v, opmath* __restrict__ acc, int64_t width, bool start) {
  if (start) {
    for (int64_t d = 0; d < width; ++d) acc[d] = opmath(0) + to_opmath(v[d]);
  } else {
    for (int64_t d = 0; d < width; ++d) acc[d] += to_opmath(v[d]);
  }
}

// Threads split the table rows: each table row sums its gradient rows in row order, whichever thread owns
// it, so the result is the same bits for any thread count, and each thread writes whole rows (long
// contiguous runs of the table) and reads whole gradient rows. Each entry is accumulated in maths precision
// and written once, so no float copy of the table is needed for fp16/bf16.
template <typename scalar_t>
void embedding_backward_kernel(const EmbeddingBackwardProblem<scalar_t>& problem) {
  using opmath = opmath_t<scalar_t>;
  // fp16 rows widened by convert.h's vector conversions (F16C where the build has it) into a row in L1 and the sums
  // narrowed by them, where to_opmath / from_opmath value by value took GCC's integer form: the same bits. Zen 2, 2
  // threads, grad [8, 2048, 1024] (separate processes taking turns): into 2048 position rows 0.89x the time, into a
  // 32000-token table 0.72x. bf16, whose to_opmath is a shift, kept GCC's loops (its token table 1.10x slower through
  // the row).
  constexpr bool kWidens = std::is_same_v<scalar_t, c10::Half>;
  const int64_t width = problem.width;
  const auto groups = group_rows(problem.ids, problem.num_ids, problem.num_grad_rows, problem.num_rows, problem.skip);
  const scalar_t* src = problem.grad;
  scalar_t* dst = problem.out;
  const auto row_scale = static_cast<opmath>(problem.scale);
  // A table row costs its width to write plus its width per gradient row: on average
  // (1 + num_grad_rows / num_rows) rows of work.
  const int64_t work_per_row = width + width * problem.num_grad_rows / std::max<int64_t>(problem.num_rows, 1);
  parallel_for(0, problem.num_rows, rows_per_task(work_per_row), [&](int64_t begin, int64_t end) {
    ScratchVector<opmath> sum(width);
    ScratchVector<opmath> widened(kWidens ? width : 0);
    opmath* __restrict__ acc = sum.data();
    // Gradient rows are read in table-row order, so scattered: the next one is prefetched.
    const int64_t last_of_task = groups.start[end];
    const int64_t row_bytes = width * static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* __restrict__ w = dst + r * width;
      const int64_t first = groups.start[r];
      const int64_t last = groups.start[r + 1];
      if (first == last) {
        std::fill_n(w, width, from_opmath<scalar_t>(opmath(0)));
        continue;
      }
      // The sum starts from +0 (so a lone -0 gradient gives +0, as the sum of several does).
      for (int64_t k = first; k < last; ++k) {
        if (k + 1 < last_of_task) prefetch_row(src + groups.order[k + 1] * width, row_bytes);
        const scalar_t* g = src + groups.order[k] * width;
        if constexpr (kWidens) {
          widen(g, widened.data(), width);
          accumulate(widened.data(), acc, width, k == first);
        } else {
          accumulate(g, acc, width, k == first);
        }
      }
      if constexpr (kWidens) {
        for (int64_t d = 0; d < width; ++d) acc[d] *= row_scale;
        narrow(acc, w, width);
      } else {
        for (int64_t d = 0; d < width; ++d) w[d] = from_opmath<scalar_t>(acc[d] * row_scale);
      }
    }
  });
}

}  // namespace
POSENC_KERNELS_END  // the registrations below run when the library loads, on any CPU

POSENC_REGISTER_FLOATING_KERNELS(embedding_backward_stub, embedding_backward_kernel);
}  // namespace POSENC_CPU_CAPABILITY
}  // namespace posenc::cpu
