#pragma once
// The tile loop of the kernels that add a per-position row to the rows of an input (cpu/kernels/additive.cpp:
// sinusoidal encodings and table rows; cpu/kernels/resample.cpp: resampled table rows). Included by those
// files after POSENC_KERNELS_BEGIN, so it is compiled once per CPU capability with them.
#include "portable/rows.h"
#include "portable/tiling.h"

namespace posenc::cpu {
inline namespace POSENC_CPU_CAPABILITY {

template <typename scalar_t>
const scalar_t* input_row(const RowInput<scalar_t>& in, int64_t n, int64_t width) {
  if (in.data == nullptr) return nullptr;
  return in.data + (in.ids == nullptr ? n : in.ids[n]) * width;
}

// out[n] = in(n) * scale + pe(n mod P) for rows n = l * P + p, P positions shared by L = rows / P leading
// indices. The work is cut into tiles (block of positions, group of up to kRowsPerEncoding leading indices),
// block-major: a task prepares a block's encodings once (Blocks::prepare: sin/cos computed, or nothing for table
// rows), then streams the rows of every leading index it owns past them, which stay in L2, each encoding row
// read once for the rows of its group. So sin/cos are computed about once per (position, frequency) however the
// tiles are split, no table is bigger than a block, and a few positions with many leading indices (decoding:
// P = 1) still split over the threads. Rows gathered by id (fused embeddings) are prefetched one position ahead.
template <typename scalar_t, typename MakeBlocks>
void add_to_rows(const RowInput<scalar_t>& in, scalar_t* out, int64_t rows, int64_t width, int64_t num_positions,
                 int64_t block, double scale, const MakeBlocks& make_blocks) {
  const int64_t leads = rows / num_positions;
  const int64_t group = std::min(leads, portable::kRowsPerEncoding);
  const int64_t groups = (leads + group - 1) / group;
  const int64_t num_blocks = (num_positions + block - 1) / block;
  const auto row_scale = static_cast<opmath_t<scalar_t>>(scale);
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(scalar_t));
  // Outputs larger than the last-level cache go past it (streaming.h): in-process A/B, float32 [8, 2048, 1024]
  // add_sinusoidal 5.98 -> 5.12 ms, add_learned 6.03 -> 5.04, embed_learned 6.65 -> 5.49. bfloat16 was no faster
  // through a float chunk in L1, but rounded by AVX-512 BF16 and stored as whole lines from registers it is:
  // in-process A/B, [8, 2048, 1024]: add_sinusoidal 1.10-1.15x, add_learned 1.02-1.21x, fused embeddings 1.03-1.14x.
  const int64_t bytes_written = in.data != out ? rows * row_bytes : 0;
  const bool rows_follow = in.ids == nullptr;  // the bytes past an input row are the next row read
  auto stores = portable::RowStores::kCached;
  if (streams_output<scalar_t>(bytes_written)) {
    stores = portable::RowStores::kStreamed;
#if defined(POSENC_HAS_F16C)
  } else if (std::is_same_v<scalar_t, c10::Half> && past_caches(bytes_written)) {
    // fp16 rows formed in registers by F16C (add_half_by_instruction: the AVX2 and AVX-512 builds), streamed as
    // whole lines
    stores = rows_follow ? portable::RowStores::kStreamedReadAhead : portable::RowStores::kStreamed;
#endif
  } else if (std::is_same_v<scalar_t, c10::BFloat16> && (POSENC_CPU_CAPABILITY_INDEX < 2 || has_avx512_bf16())) {
    // rounded in registers, by instruction (2-9% faster on the bf16 rows of scripts/bench.py, three runs of each
    // build in turn) or, in the baseline and AVX2 builds on any CPU, by rows.h's add_bf16_vectors, and so streamed
    // as whole lines past the caches where the output is that large: AVX2, in-process A/B, 2 threads,
    // [8, 2048, 1024]: add_sinusoidal 1.03-1.07x, add_learned 1.11-1.15x, embed_learned 1.04-1.08x, DINOv2-L's
    // resampled rows 1.11-1.16x; one thread 1.17-1.34x; the baseline 1.04-1.07x.
    if (!past_caches(bytes_written)) {
      stores = portable::RowStores::kBf16ByInstruction;
    } else {
      stores = rows_follow ? portable::RowStores::kBf16StreamedReadAhead : portable::RowStores::kBf16Streamed;
    }
  }
  const int64_t grain = portable::rows_per_task(block * group * width);
  parallel_for(0, num_blocks * groups, grain, [&](int64_t begin, int64_t end) {
    auto blocks = make_blocks();
    int64_t prepared = -1;
    const scalar_t* in_rows[portable::kRowsPerEncoding];
    scalar_t* out_rows[portable::kRowsPerEncoding];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t b = tile / groups;
      const int64_t first = b * block;
      const int64_t count = std::min(block, num_positions - first);
      if (b != prepared) {
        blocks.prepare(first, count);
        prepared = b;
      }
      const int64_t lead = (tile % groups) * group;
      const int64_t rows_here = std::min(group, leads - lead);
      for (int64_t p = 0; p < count; ++p) {
        for (int64_t r = 0; r < rows_here; ++r) {
          const int64_t n = (lead + r) * num_positions + first + p;
          if (in.ids != nullptr && p + 1 < count) portable::prefetch_row(input_row(in, n + 1, width), row_bytes);
          in_rows[r] = input_row(in, n, width);
          out_rows[r] = out + n * width;
        }
        blocks.add(rows_here, in.data != nullptr ? in_rows : nullptr, first + p, out_rows, width, row_scale, stores);
      }
    }
    portable::store_fence();
  });
}

}  // namespace POSENC_CPU_CAPABILITY
}  // namespace posenc::cpu
