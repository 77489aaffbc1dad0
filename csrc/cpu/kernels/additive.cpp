// Kernels of the additive families, compiled once per CPU capability: sinusoidal encodings and learned table
// rows added to rows of an input (or written alone), and the position counters of the learned family.
#include "cpu/kernels/capability.h"
#include "cpu/kernels/additive.h"

POSENC_KERNELS_BEGIN
#include "portable/angle.h"
#include "portable/rows.h"
#include "portable/tiling.h"

namespace posenc::cpu {
inline namespace POSENC_CPU_CAPABILITY {
namespace {

using namespace posenc::portable;

// The encoding of one position, pe[0, 2F), in maths precision; `scratch` holds 2F values.
template <typename opmath_t>
void encode_position(double position, const double* inv_freq, int64_t pairs, double max_abs_freq,
                     SinusoidalLayout layout, opmath_t* pe, opmath_t* scratch) {
  switch (layout) {
    case SinusoidalLayout::Half:
      sincos_row(position, inv_freq, pairs, max_abs_freq, pe, pe + pairs);
      break;
    case SinusoidalLayout::HalfCosFirst:
      sincos_row(position, inv_freq, pairs, max_abs_freq, pe + pairs, pe);
      break;
    case SinusoidalLayout::Interleaved:
      sincos_row(position, inv_freq, pairs, max_abs_freq, scratch, scratch + pairs);
      for (int64_t i = 0; i < pairs; ++i) {
        pe[2 * i] = scratch[i];
        pe[2 * i + 1] = scratch[pairs + i];
      }
      break;
  }
}

template <typename scalar_t>
const scalar_t* input_row(const RowInput<scalar_t>& in, int64_t n, int64_t width) {
  if (in.data == nullptr) return nullptr;
  return in.data + (in.ids == nullptr ? n : in.ids[n]) * width;
}

// out[n] = in(n) * scale + pe(n mod P) for rows n = l * P + p, P positions shared by L = rows / P leading
// indices. The work is cut into tiles (block of positions, leading index), block-major: a tile is a
// contiguous run of rows, and a task prepares a block's encodings once (Blocks::prepare: sin/cos computed,
// or nothing for table rows), then streams the rows of every leading index it owns past them, which stay in
// L2. So sin/cos are computed about once per (position, frequency) however the tiles are split, no table is
// bigger than a block, and a few positions with many leading indices (decoding: P = 1) still split over the
// threads. Rows gathered by id (fused embeddings) are prefetched one ahead.
template <typename scalar_t, typename MakeBlocks>
void add_to_rows(const RowInput<scalar_t>& in, scalar_t* out, int64_t rows, int64_t width, int64_t encoded,
                 int64_t num_positions, int64_t block, double scale, const MakeBlocks& make_blocks) {
  const int64_t leads = rows / num_positions;
  const int64_t num_blocks = (num_positions + block - 1) / block;
  const auto row_scale = static_cast<opmath_t<scalar_t>>(scale);
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(scalar_t));
  parallel_for(0, num_blocks * leads, rows_per_task(block * width), [&](int64_t begin, int64_t end) {
    auto blocks = make_blocks();
    int64_t prepared = -1;
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t b = tile / leads;
      const int64_t first = b * block;
      const int64_t count = std::min(block, num_positions - first);
      if (b != prepared) {
        blocks.prepare(first, count);
        prepared = b;
      }
      const int64_t n0 = (tile % leads) * num_positions + first;
      for (int64_t p = 0; p < count; ++p) {
        if (in.ids != nullptr && p + 1 < count) prefetch_row(input_row(in, n0 + p + 1, width), row_bytes);
        add_row(input_row(in, n0 + p, width), blocks.row(first + p), out + (n0 + p) * width, encoded, width,
                row_scale);
      }
    }
  });
}

// A task's block of encodings: sin/cos of `count` positions in maths precision, plus the interleaved
// layout's scratch row.
template <typename scalar_t>
class EncodingBlocks {
 public:
  using opmath = opmath_t<scalar_t>;

  EncodingBlocks(const SinusoidalProblem<scalar_t>& problem, int64_t block)
      : problem_(problem), encoded_(2 * problem.pairs), buffer_((block + 1) * encoded_) {}

  void prepare(int64_t first, int64_t count) {
    first_ = first;
    opmath* scratch = buffer_.data() + (buffer_.size() - encoded_);
    for (int64_t p = 0; p < count; ++p) {
      const int64_t n = first + p;
      const double position = problem_.positions != nullptr ? problem_.positions[n]
                                                            : static_cast<double>(problem_.first_position + n);
      encode_position(position, problem_.inv_freq, problem_.pairs, problem_.max_abs_freq,
                      problem_.layout, buffer_.data() + p * encoded_, scratch);
    }
  }

  const opmath* row(int64_t position) const { return buffer_.data() + (position - first_) * encoded_; }

 private:
  const SinusoidalProblem<scalar_t>& problem_;
  int64_t encoded_;
  std::vector<opmath> buffer_;
  int64_t first_ = 0;
};

// Table rows need no preparation: the block is the rows the positions read.
template <typename scalar_t>
struct TableBlocks {
  const LearnedProblem<scalar_t>& problem;

  void prepare(int64_t, int64_t) {}
  const scalar_t* row(int64_t position) const {
    const int64_t row = problem.table_rows != nullptr ? problem.table_rows[position] : problem.first_row + position;
    return problem.table + row * problem.width;
  }
};

template <typename scalar_t>
void sinusoidal_kernel(const SinusoidalProblem<scalar_t>& problem) {
  const int64_t encoded = 2 * problem.pairs;
  const int64_t block = std::min(problem.num_positions,
                                 rows_per_block(encoded * static_cast<int64_t>(sizeof(opmath_t<scalar_t>))));
  add_to_rows(problem.in, problem.out, problem.rows, problem.width, encoded, problem.num_positions, block,
              problem.scale, [&] { return EncodingBlocks<scalar_t>(problem, block); });
}

template <typename scalar_t>
void learned_kernel(const LearnedProblem<scalar_t>& problem) {
  const int64_t block = std::min(problem.num_positions,
                                 rows_per_block(problem.width * static_cast<int64_t>(sizeof(scalar_t))));
  add_to_rows(problem.in, problem.out, problem.rows, problem.width, problem.width, problem.num_positions, block,
              problem.scale, [&] { return TableBlocks<scalar_t>{problem}; });
}

void count_positions_kernel(const CountPositionsProblem& problem) {
  const int64_t seq_len = problem.seq_len;
  parallel_for(0, problem.rows, rows_per_task(seq_len), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t next = problem.first;
      for (int64_t s = b * seq_len; s < (b + 1) * seq_len; ++s) {
        const bool real = problem.real[s];
        problem.out[s] = real ? next : problem.pad;
        next += real;
      }
    }
  });
}

}  // namespace
POSENC_KERNELS_END  // the registrations below run when the library loads, on any CPU

POSENC_REGISTER_FLOATING_KERNELS(sinusoidal_stub, sinusoidal_kernel);
POSENC_REGISTER_FLOATING_KERNELS(learned_stub, learned_kernel);
POSENC_REGISTER_KERNEL(count_positions_stub, &count_positions_kernel);
}  // namespace POSENC_CPU_CAPABILITY
}  // namespace posenc::cpu
