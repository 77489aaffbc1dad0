#pragma once
// The index maths of the CUDA kernels, for nvcc and for a plain C++ compiler alike: the launch geometry (grid,
// block, vector width) chosen for given sizes, strides and alignment, and which elements each (block, thread,
// step) of a kernel reads, writes and sums, in what order. The kernels call these functions, so what
// tests/cpp/test_cuda_geometry.cpp enumerates on the host, without a GPU, is the device's own arithmetic: every
// output element written once, nothing read or written out of bounds, 16-byte accesses only at aligned
// addresses, the tails on the scalar path, and every sum in the CPU's order.
//
// No CUDA, c10 or ATen header: only portable/types.h's plain enums and structs. The host-only parts (launch
// plans) take the device's multiprocessor count as an argument.
#include "portable/types.h"

#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#define POSENC_GEOMETRY __host__ __device__ __forceinline__
#else
#define POSENC_GEOMETRY inline
#endif

namespace posenc::cuda::geometry {

constexpr int kThreads = 256;     // threads per block of every kernel here
constexpr int kVectorBytes = 16;  // one global load or store per thread: 128 bits

// Elements of T in one 16-byte access: 8 for fp16/bf16, 4 for float32, 2 for float64.
template <typename T>
constexpr int kMaxVec = kVectorBytes / static_cast<int>(sizeof(T));

constexpr int64_t kMaxGridX = 0x7FFFFFFF;  // gridDim.x; gridDim.y and .z up to kMaxGridY
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kBlocksPerMultiprocessor = 32;  // a grid-stride loop's grid: enough to fill the device
constexpr int64_t kTilesPerMultiprocessor = 8;    // fewer tiles (tokens, positions) than this: split them

struct Range {
  int64_t begin;
  int64_t end;
};

struct Grid {
  int64_t x = 1;
  int64_t y = 1;
  int64_t z = 1;
};

POSENC_GEOMETRY int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The length of the piece of [0, total) that starts at `first`, pieces being `size` long.
POSENC_GEOMETRY int64_t piece_length(int64_t total, int64_t first, int64_t size) {
  return total - first < size ? total - first : size;
}

inline bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }

// Blocks for a grid-stride loop over `work` items of `per_block` each: enough to fill the device several
// times over, no more (the loop covers the rest).
inline int64_t grid_size(int64_t work, int64_t per_block, int64_t multiprocessors) {
  const int64_t wanted = std::max<int64_t>(1, ceil_div(work, per_block));
  return std::min<int64_t>(wanted, multiprocessors * kBlocksPerMultiprocessor);
}

// ---------------------------------------------------------------------------------------------- grid-stride

// A grid-stride loop: thread t of block b (of `grid` blocks of `threads`) takes items b * threads + t, then every
// grid * threads further. Along gridDim.x (one item per thread of the grid) or gridDim.y (a block row's share).
POSENC_GEOMETRY int64_t stride_first(unsigned int block, unsigned int threads, unsigned int thread) {
  return block * int64_t{threads} + thread;
}

POSENC_GEOMETRY int64_t stride_step(unsigned int grid, unsigned int threads) { return int64_t{grid} * threads; }

// Item w of a loop over rows cut into `chunks` pieces of V elements: its row, and its first element.
struct RowPiece {
  int64_t row;
  int64_t first;
};

POSENC_GEOMETRY RowPiece row_piece(int64_t w, int64_t chunks, int V) {
  const int64_t row = w / chunks;
  return {row, (w - row * chunks) * V};
}

// Tile `tile` of a block-stride loop (tiles = rows * chunks; a block takes chunks of threads * V channels of a
// row): its row, and the first of the V channels of thread `thread` (possibly past the row's end: the thread
// then skips the tile).
POSENC_GEOMETRY RowPiece tile_piece(int64_t tile, int64_t chunks, unsigned int threads, unsigned int thread, int V) {
  const int64_t row = tile / chunks;
  return {row, ((tile - row * chunks) * threads + thread) * V};
}

// A grid-stride loop over `rows` rows of `length` elements, V at a time where vectorized (length then a whole
// number of vectors), else one.
struct RowsLaunch {
  int V;
  int64_t chunks;  // items per row
  int64_t blocks;
};

inline RowsLaunch rows_launch(int64_t rows, int64_t length, bool vectorized, int max_vec, int64_t multiprocessors) {
  const int V = vectorized ? max_vec : 1;
  const int64_t chunks = length / V;
  return {V, chunks, grid_size(rows * chunks, kThreads, multiprocessors)};
}

// ---------------------------------------------------------------------------------------------- additive

// additive_kernel (sinusoidal and learned families): tiles of (position, kThreads * V channels) over gridDim.x, the
// leading indices sharing a position split over gridDim.y when tiles are few. V = 16 bytes where the rows are whole
// vectors and every pointer is aligned (`vectorized`), else 1.
inline bool additive_vectorizable(int64_t width, const void* in, const void* out, bool encoding_aligned, int V) {
  return width % V == 0 && aligned(in) && aligned(out) && encoding_aligned;
}

struct AdditiveLaunch {
  int V;
  int64_t chunks;           // channel tiles per position
  int64_t leads_per_block;  // leading indices of a block along gridDim.y
  Grid grid;
};

inline AdditiveLaunch additive_launch(int64_t width, int64_t leads, int64_t num_positions, bool vectorized,
                                      int max_vec, int64_t multiprocessors) {
  AdditiveLaunch l{};
  l.V = vectorized ? max_vec : 1;
  l.chunks = ceil_div(width, int64_t{kThreads} * l.V);
  const int64_t tiles = num_positions * l.chunks;
  const int64_t wanted = ceil_div(multiprocessors * kTilesPerMultiprocessor, tiles);
  const int64_t splits = std::clamp<int64_t>(std::min(wanted, leads), 1, kMaxGridY);
  l.leads_per_block = std::max<int64_t>(1, ceil_div(leads, splits));
  l.grid = {std::min<int64_t>(tiles, kMaxGridX), ceil_div(leads, l.leads_per_block), 1};
  return l;
}

// Row n = l * P + p of the output: leading index l, position p.
POSENC_GEOMETRY int64_t additive_row(int64_t l, int64_t p, int64_t num_positions) { return l * num_positions + p; }

// The leading indices of block row `block_y`.
POSENC_GEOMETRY Range lead_range(unsigned int block_y, int64_t leads_per_block, int64_t leads) {
  const int64_t begin = block_y * leads_per_block;
  return {begin, begin + leads_per_block < leads ? begin + leads_per_block : leads};
}

// ---------------------------------------------------------------------------------------------- embedding_backward

// embedding_backward_kernel: tiles of (table row, kThreads * V channels), a block-stride loop over gridDim.x; V = 16
// bytes where the rows of the gradient and of the table are whole vectors and both are aligned, else 1.
inline bool embedding_vectorizable(int64_t width, const void* grad, const void* out, int V) {
  return width % V == 0 && aligned(grad) && aligned(out);
}

inline RowsLaunch embedding_launch(int64_t num_rows, int64_t width, bool vectorized, int max_vec,
                                   int64_t multiprocessors) {
  const int V = vectorized ? max_vec : 1;
  const int64_t chunks = ceil_div(width, int64_t{kThreads} * V);
  return {V, chunks, grid_size(num_rows * chunks, 1, multiprocessors)};
}

// The gradient rows of table row r, order[first .. last) (group_start: the stable sort's searchsorted), in the
// order they are added; none for the skipped (padding) row.
POSENC_GEOMETRY Range embedding_group(int64_t r, int64_t skip, const int64_t* group_start) {
  return {r == skip ? 0 : group_start[r], r == skip ? 0 : group_start[r + 1]};
}

// ---------------------------------------------------------------------------------------------- ALiBi

// V elements of every row of `rows` (from `data`) start 16-byte aligned: unit key stride, whole vectors.
inline bool alibi_vectorizable(const void* data, const AlibiRows& rows, int V) {
  return rows.stride_j == 1 && rows.k_len % V == 0 && rows.stride_b % V == 0 && rows.stride_h % V == 0 &&
         rows.stride_i % V == 0 && aligned(data);
}

// alibi_row_sums_kernel, unit key stride: kRowsPerBlock rows per block, kLanes threads per row (its lanes, the
// CPU's interleaved partial sums), a block-stride loop over groups of rows.
constexpr int kAlibiLanes = 16;
constexpr int kAlibiRowsPerBlock = kThreads / kAlibiLanes;

struct LaneOf {
  int lane;  // keys lane, lane + kLanes, ... of its row below the last whole group of kLanes
  int slot;  // its row within the block's group of rows
};

POSENC_GEOMETRY LaneOf alibi_lane(unsigned int thread) {
  return {static_cast<int>(thread % kAlibiLanes), static_cast<int>(thread / kAlibiLanes)};
}

// The keys summed by the lanes: [0, whole); lane 0 adds the tail [whole, k_len) after the lanes.
POSENC_GEOMETRY int64_t alibi_whole(int64_t k_len) { return k_len - k_len % kAlibiLanes; }

// Grid of the row sums: unit stride, kLanes threads per row; else a thread per row.
inline int64_t alibi_row_sums_blocks(int64_t num_rows, bool unit, int64_t multiprocessors) {
  return grid_size(unit ? num_rows * kAlibiLanes : num_rows, kThreads, multiprocessors);
}

// Slope entry e = (b_slope, h) adds the rows (b, h, i) of b in `batches`, every i, in increasing row order.
struct SlopeRows {
  int64_t b_slope;
  int64_t head;
  Range batches;
};

POSENC_GEOMETRY SlopeRows alibi_slope_rows(int64_t e, int64_t heads, int64_t batch, bool per_batch) {
  const int64_t b_slope = e / heads;
  const int64_t first = per_batch ? b_slope : 0;  // (a conditional between two Range{} crashes nvcc 13.0's front end)
  return {b_slope, e - b_slope * heads, {first, per_batch ? b_slope + 1 : batch}};
}

// ---------------------------------------------------------------------------------------------- T5

// bias_rows_kernel writes the contiguous [H, Q, K] output's rows in V-element vectors where they are whole vectors
// and aligned (a grid-stride loop over (row, vector): rows_launch), else element by element.
inline bool bias_rows_vectorizable(int64_t k_len, const void* out, int V) { return k_len % V == 0 && aligned(out); }

// Diagonal r of a [q_len, k_len] head (r = j - i + q_len - 1) meets rows [begin, end); its element of row i is key
// r - (q_len - 1 - i).
POSENC_GEOMETRY Range diagonal_rows(int64_t r, int64_t q_len, int64_t k_len) {
  return {q_len - 1 - r > 0 ? q_len - 1 - r : 0, q_len - 1 - r + k_len < q_len ? q_len - 1 - r + k_len : q_len};
}

POSENC_GEOMETRY int64_t diagonal_key(int64_t r, int64_t i, int64_t q_len) { return r - (q_len - 1 - i); }

// Row i of a head starts at diagonal q_len - 1 - i of its diagonal values.
POSENC_GEOMETRY int64_t row_first_diagonal(int64_t i, int64_t q_len) { return q_len - 1 - i; }

// Item e of a [count_0, count_1] loop: (e / count_1, e mod count_1).
struct Pair {
  int64_t outer;
  int64_t inner;
};

POSENC_GEOMETRY Pair split(int64_t e, int64_t inner) {
  const int64_t outer = e / inner;
  return {outer, e - outer * inner};
}

// ---------------------------------------------------------------------------------------------- rotary

// Pairs whose coefficients a block holds at once (a multiple of every vector width): 4 KiB of float32.
constexpr int64_t kChunkPairs = 256;

// The channels of pairs [pair, pair + V) of a head: V channels from `first` and V from `second` (V = 1: one each).
// neox pairs (i, i + pairs); gptj (2i, 2i + 1): for V > 1 the 2V channels from 2 * pair, as two vectors.
struct PairChannels {
  int64_t first;
  int64_t second;
};

POSENC_GEOMETRY PairChannels pair_channels(RopeLayout layout, int64_t pair, int64_t pairs, int V) {
  if (layout == RopeLayout::Neox) return {pair, pair + pairs};
  return {2 * pair, 2 * pair + V};
}

// Channel d < 2 * pairs of a rotated head: whether it is its pair's first, the pair, and its partner channel.
struct ChannelPair {
  bool first;
  int64_t pair;
  int64_t partner;
};

POSENC_GEOMETRY ChannelPair channel_pair(RopeLayout layout, int64_t d, int64_t pairs) {
  if (layout == RopeLayout::Neox) {
    const bool first = d < pairs;
    return {first, first ? d : d - pairs, first ? d + pairs : d - pairs};
  }
  return {(d & 1) == 0, d >> 1, d ^ 1};
}

// A view rotated with V-pair vectors: every row contiguous and 16-byte aligned, the rotated and the copied
// channels whole vectors (the caller checks pairs % V once for all views).
inline bool rotary_vectorizable(int64_t head_dim, const void* in, const int64_t* in_stride, const void* out,
                                const int64_t* out_stride, int V) {
  if (head_dim % V != 0 || in_stride[3] != 1 || out_stride[3] != 1 || !aligned(in) || !aligned(out)) return false;
  for (int d = 0; d < 3; ++d) {
    if (in_stride[d] % V != 0 || out_stride[d] % V != 0) return false;
  }
  return true;
}

// A token's units of work of a view in its largest chunk of pairs (or its copied channels).
inline int64_t rotary_token_units(int64_t heads, int64_t head_dim, int64_t pairs, int V) {
  return heads * std::max(std::min(pairs, kChunkPairs), head_dim - 2 * pairs) / V;
}

// rope_qk_cache_'s copied view (v): every channel of each of its heads.
inline int64_t rotary_copy_token_units(int64_t heads, int64_t head_dim, int V) { return heads * head_dim / V; }

// A block per token over gridDim.x; a token's units split over gridDim.y when tokens are few (decoding).
inline Grid rotary_grid(int64_t tokens, int64_t units, int64_t multiprocessors) {
  const int64_t wanted = ceil_div(multiprocessors * kTilesPerMultiprocessor, tokens);
  const int64_t split = std::clamp<int64_t>(std::min(wanted, ceil_div(units, kThreads)), 1, kMaxGridY);
  return {std::min<int64_t>(tokens, kMaxGridX), split, 1};
}

// Unit u of a chunk's rotation: V pairs of head `head` of the first view (u < units0) or of the second, from pair
// `pair` of the chunk (per_head units a head).
struct RotaryUnit {
  bool second;
  int64_t head;
  int64_t pair;
};

POSENC_GEOMETRY RotaryUnit rotary_unit(int64_t u, int64_t units0, int64_t per_head, int V) {
  const bool second = u >= units0;
  const int64_t w = second ? u - units0 : u;
  const int64_t h = w / per_head;
  return {second, h, (w - h * per_head) * V};
}

// Copied units of a head: its channels from `first_channel` on, V at a time.
POSENC_GEOMETRY int64_t copied_units(int64_t head_dim, int64_t first_channel, int V) {
  return (head_dim - first_channel) / V;
}

// Unit u of a token's copies: V channels of head `head` of view `which` (0, 1: the rotated views' channels past
// 2 * pairs; 2: the cache's copied view, every channel), from `channel`. units0 <= units1: the views' first units.
struct CopyUnit {
  int which;
  int64_t head;
  int64_t channel;
};

POSENC_GEOMETRY CopyUnit rotary_copy_unit(int64_t u, int64_t units0, int64_t units1, int64_t rest0, int64_t rest1,
                                          int64_t rest2, int64_t pairs, int V) {
  const int which = u < units0 ? 0 : u < units1 ? 1 : 2;
  const int64_t w = u - (which == 0 ? 0 : which == 1 ? units0 : units1);
  const int64_t per_head = which == 0 ? rest0 : which == 1 ? rest1 : rest2;
  const int64_t h = w / per_head;
  return {which, h, (which == 2 ? 0 : 2 * pairs) + (w - h * per_head) * V};
}

// ---------------------------------------------------------------------------------------------- qk_norm_rope

// Groups whose scalars (1 / rms, the backward's mean dot) a block holds at once; more groups per token are taken
// in batches of this many, in group order.
constexpr int64_t kGroupBatch = 64;

// A block's cos/sin row in dynamic shared memory up to this many bytes, well inside the 48 KiB a launch may take
// without opting in; past it in a global scratch row per block.
constexpr int64_t kMaxSharedCoeffBytes = 32 * 1024;

// The threads summing a group's squares: teams of kLanes (portable::kSumLanes) threads, thread `lane` of a team
// adding channels lane, lane + kLanes, ... of the team's group.
constexpr int kNormLanes = 16;

struct TeamOf {
  int lane;
  int64_t team;
  int64_t teams;
};

POSENC_GEOMETRY TeamOf norm_team(unsigned int thread, unsigned int threads) {
  return {static_cast<int>(thread) % kNormLanes, thread / kNormLanes, threads / kNormLanes};
}

// Block `block` of `blocks`' share of `count` items, in ceil(count / blocks) pieces (a token's groups over
// gridDim.y).
POSENC_GEOMETRY Range block_share(int64_t count, unsigned int blocks, unsigned int block) {
  const int64_t per_block = (count + blocks - 1) / blocks;
  const int64_t begin = block * per_block;
  return {begin, count - begin < per_block ? count : begin + per_block};
}

// Chunk c of `tokens` tokens, `chunk` a chunk: its tokens.
POSENC_GEOMETRY Range chunk_tokens(int64_t c, int64_t chunk, int64_t tokens) {
  const int64_t first = c * chunk;
  return {first, tokens - first < chunk ? tokens : first + chunk};
}

// Forward unit u of a batch of groups: a pair (k < pairs) or a channel past rotary_dim (2 * pairs + k - pairs) of
// the batch's head hb, whose group is gi.
struct NormUnit {
  int64_t head;  // within the batch's heads
  int64_t k;
  int64_t group;  // within the batch
};

POSENC_GEOMETRY NormUnit norm_unit(int64_t u, int64_t per_head, int64_t heads_per_group) {
  const int64_t hb = u / per_head;
  return {hb, u - hb * per_head, heads_per_group == 1 ? hb : hb / heads_per_group};
}

// Channel j of a group of heads: (head within the group, channel of the head).
POSENC_GEOMETRY Pair group_channel(int64_t j, int64_t head_dim) { return split(j, head_dim); }

// Channel c of a group as (head, channel of the head), stepped through the group without a division per step.
struct GroupChannel {
  int64_t head;
  int64_t d;

  POSENC_GEOMETRY GroupChannel(int64_t first_head, int64_t c, int64_t head_dim)
      : head(first_head + c / head_dim), d(c % head_dim) {}

  POSENC_GEOMETRY void advance(int64_t step, int64_t head_dim) {
    d += step;
    while (d >= head_dim) {
      d -= head_dim;
      ++head;
    }
  }
};

// norm_rope_kernel's grid: blocks of `chunk` tokens over gridDim.x (the forward: a token; the backward: the CPU's
// tokens_per_chunk, never split), a token's groups split over gridDim.y (forward only, when tokens are few), a
// view per blockIdx.z; the cos/sin row in shared memory up to kMaxSharedCoeffBytes, else a global row per block
// (then at most multiprocessors * kTilesPerMultiprocessor blocks).
struct NormRopeLaunch {
  int64_t chunk;
  int64_t chunks;
  Grid grid;
  bool in_shared;
  int64_t coeff_bytes;
};

inline NormRopeLaunch norm_rope_launch(int64_t tokens, int64_t chunk, int64_t max_groups, int64_t views,
                                       int64_t pairs, int64_t opmath_bytes, bool backward, int64_t multiprocessors) {
  NormRopeLaunch l{};
  l.chunk = chunk;
  l.chunks = ceil_div(tokens, chunk);
  int64_t blocks = std::min<int64_t>(l.chunks, kMaxGridX);
  int64_t split = 1;
  if (!backward) {
    split = std::clamp<int64_t>(std::min(ceil_div(multiprocessors * kTilesPerMultiprocessor, tokens), max_groups), 1,
                                kMaxGridY);
  }
  l.coeff_bytes = 2 * pairs * opmath_bytes;
  l.in_shared = l.coeff_bytes <= kMaxSharedCoeffBytes;
  if (!l.in_shared) {
    blocks = std::min<int64_t>(blocks, multiprocessors * kTilesPerMultiprocessor);
    split = 1;
  }
  l.grid = {blocks, split, views};
  return l;
}

}  // namespace posenc::cuda::geometry
