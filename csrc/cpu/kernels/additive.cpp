// Kernels of the additive families, compiled once per CPU capability: sinusoidal encodings and learned table
// rows added to rows of an input (or written alone), and the position counters of the learned family.
#include "cpu/kernels/capability.h"
#include "cpu/kernels/additive.h"

POSENC_KERNELS_BEGIN
#include "cpu/kernels/row_tiles.h"
#include "portable/angle.h"

namespace posenc::cpu {
inline namespace POSENC_CPU_CAPABILITY {
namespace {

using namespace posenc::portable;

// The encoding of one position, pe[0, 2F), in maths precision; `scratch` holds 2F values. One axis: "half_per_axis"
// is "half".
template <typename opmath_t>
void encode_position(double position, const double* inv_freq, int64_t pairs, double max_abs_freq,
                     SinusoidalLayout layout, opmath_t* pe, opmath_t* scratch) {
  switch (layout) {
    case SinusoidalLayout::Half:
    case SinusoidalLayout::HalfPerAxis:
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

// The encodings of rows [first, first + count) into consecutive rows of `buffer`, `encoded` values each:
// encode(p, index, pe) for row first + p reading position `index`, -0.0 for a prefix token (which, added, leaves
// every value, -0.0 included, as it is).
template <typename opmath, typename Encode>
void encode_rows(const SequenceRows& sequence, int64_t first, int64_t count, int64_t encoded, opmath* buffer,
                 const Encode& encode) {
  for (int64_t p = 0; p < count; ++p) {
    opmath* pe = buffer + p * encoded;
    const int64_t index = sequence_position(sequence, first + p);
    if (index < 0) {
      std::fill(pe, pe + encoded, static_cast<opmath>(-0.0));
      continue;
    }
    encode(p, index, pe);
  }
}

// A task's block of encodings: sin/cos of `count` positions in maths precision, plus the interleaved
// layout's scratch row; or, where the op layer hands rows computed already, where each position's row is.
template <typename scalar_t>
class EncodingBlocks {
 public:
  using opmath = opmath_t<scalar_t>;

  EncodingBlocks(const SinusoidalProblem<scalar_t>& problem, int64_t block)
      : problem_(problem),
        encoded_(2 * problem.pairs),
        buffer_(problem.encodings != nullptr ? encoded_ : (block + 1) * encoded_, static_cast<opmath>(-0.0)),
        rows_(problem.encodings != nullptr ? block : 0) {}

  void prepare(int64_t first, int64_t count) {
    first_ = first;
    if (problem_.encodings != nullptr) {  // the kept rows; a prefix token's: buffer_, all -0.0
      for (int64_t p = 0; p < count; ++p) {
        const int64_t index = sequence_position(problem_.sequence, first + p);
        if (index < 0) {
          rows_[p] = buffer_.data();
          continue;
        }
        rows_[p] = problem_.encodings + static_cast<int64_t>(position(index)) * encoded_;  // a whole number
      }
      return;
    }
    opmath* scratch = buffer_.data() + (buffer_.size() - encoded_);
    encode_rows(problem_.sequence, first, count, encoded_, buffer_.data(), [&](int64_t, int64_t index, opmath* pe) {
      encode_position(position(index), problem_.inv_freq, problem_.pairs, problem_.max_abs_freq, problem_.layout, pe,
                      scratch);
    });
  }

  void add(int64_t count, const scalar_t* const* in, int64_t position, scalar_t* const* out, int64_t width,
           opmath scale, RowStores stores) const {
    const int64_t p = position - first_;
    const opmath* pe = problem_.encodings != nullptr ? rows_[p] : buffer_.data() + p * encoded_;
    add_rows(count, in, pe, out, encoded_, width, scale, stores);
  }

 private:
  // The position of the sequence's index-th encoded token: given, or first_position + index.
  double position(int64_t index) const {
    return problem_.positions != nullptr ? problem_.positions[index]
                                         : static_cast<double>(problem_.first_position + index);
  }

  const SinusoidalProblem<scalar_t>& problem_;
  int64_t encoded_;
  ScratchVector<opmath> buffer_;
  std::vector<const opmath*> rows_;
  int64_t first_ = 0;
};

// The encodings of multi-axis positions (image and video grids). Pair i's sin and cos depend on the position of
// its axis alone, and a grid has few distinct positions per axis (its rows, its columns), met again and again: so
// each axis keeps the sin and cos of its pairs at every position value met (AxisValues), and a token's rows add
// its axes' values segment by segment of the layout, straight from where they are kept (a layout of short segments,
// or a token past the cache's capacity, has its encoding copied together first). A grid's table then costs sin and
// cos of (rows + columns) positions rather than of rows x columns, and no token's encoding is written out; the bits
// are the same: the same angle on the same path (fast only when every axis of the token is within the fast range).
// Each thread keeps its axes' values from call to call (kept_axis_values), so a model's every forward at the same
// grid computes none.
template <typename opmath>
class AxisValues {
 public:
  AxisValues(std::vector<double> inv_freq, int64_t capacity)
      : inv_freq_(std::move(inv_freq)), width_(2 * static_cast<int64_t>(inv_freq_.size())) {
    int64_t slots = 16;
    while (slots < 2 * capacity) slots *= 2;
    slots_.assign(slots, -1);
    capacity_ = capacity;
  }

  // The entry holding [sin | cos] of the axis's pairs at `value` on the token's path, computed the first time it is
  // asked for; -1 once the cache is full.
  int64_t entry(double value, bool fast) {
    const Key key{bits(value), fast};
    if (last_ >= 0 && keys_[last_] == key) return last_;
    const uint64_t mask = slots_.size() - 1;
    for (uint64_t slot = mix(key) & mask;; slot = (slot + 1) & mask) {
      const int64_t found = slots_[slot];
      if (found >= 0 && keys_[found] == key) return last_ = found;
      if (found >= 0) continue;
      if (static_cast<int64_t>(keys_.size()) == capacity_) return -1;
      slots_[slot] = last_ = static_cast<int64_t>(keys_.size());
      keys_.push_back(key);
      values_.resize(values_.size() + width_);
      compute(value, fast, values_.data() + last_ * width_);
      return last_;
    }
  }

  const opmath* values(int64_t entry) const { return values_.data() + entry * width_; }

  // Whether this AxisValues is the one of an axis of these frequencies (bit for bit) and this capacity.
  bool keeps(const std::vector<double>& inv_freq, int64_t capacity) const {
    return capacity == capacity_ && inv_freq.size() == inv_freq_.size() &&
           std::memcmp(inv_freq.data(), inv_freq_.data(), inv_freq.size() * sizeof(double)) == 0;
  }
  bool full() const { return static_cast<int64_t>(keys_.size()) == capacity_; }

  // [sin | cos] at `value` computed into `out` (width values): a new entry's, or past capacity the caller's scratch.
  const opmath* compute(double value, bool fast, opmath* out) const {
    const auto n = static_cast<int64_t>(inv_freq_.size());
    sincos_row_on_path(value, inv_freq_.data(), n, fast, out, out + n);
    return out;
  }

 private:
  struct Key {
    uint64_t bits;
    bool fast;
    bool operator==(const Key& other) const { return bits == other.bits && fast == other.fast; }
  };
  static uint64_t bits(double value) {
    uint64_t out;
    std::memcpy(&out, &value, sizeof(out));
    return out;
  }
  static uint64_t mix(const Key& key) {  // splitmix64's finalizer
    uint64_t z = key.bits + (key.fast ? 0x9e3779b97f4a7c15ULL : 0);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  std::vector<double> inv_freq_;  // the axis's pairs, in pair order
  int64_t width_;
  int64_t capacity_ = 0;
  std::vector<int64_t> slots_;
  std::vector<Key> keys_;
  ScratchVector<opmath> values_;
  int64_t last_ = -1;
};

// The AxisValues of an axis of these frequencies, kept by the calling thread from call to call: the values of
// every position it has met, computed once per thread. A full one is replaced by an empty one (a call then computes
// its own grid's values again, not every token's); a thread keeps the last kKept axes it met, up to 1 MiB each, or
// none where POSENC_ENCODING_CACHE_MB is 0. A call's blocks hold theirs, so one dropped meanwhile lives until they
// end. PixArt's grid (bf16 [2, 4096, 1152], Zen 2, 2 threads, separate processes taking turns, three rounds):
// 1.54-1.71 -> 1.48-1.61 ms, the same bits.
template <typename opmath>
std::shared_ptr<AxisValues<opmath>> kept_axis_values(std::vector<double> inv_freq, int64_t capacity) {
  constexpr size_t kKept = 6;
  if (encoding_cache_bytes() == 0) return std::make_shared<AxisValues<opmath>>(std::move(inv_freq), capacity);
  thread_local std::vector<std::shared_ptr<AxisValues<opmath>>> kept;  // the most recently met last
  for (auto it = kept.begin(); it != kept.end(); ++it) {
    if (!(*it)->keeps(inv_freq, capacity)) continue;
    auto found = *it;
    kept.erase(it);
    if (found->full()) break;
    kept.push_back(found);
    return found;
  }
  if (kept.size() == kKept) kept.erase(kept.begin());
  kept.push_back(std::make_shared<AxisValues<opmath>>(std::move(inv_freq), capacity));
  return kept.back();
}

template <typename scalar_t>
class AxisEncodingBlocks {
 public:
  using opmath = opmath_t<scalar_t>;

  AxisEncodingBlocks(const SinusoidalProblem<scalar_t>& problem, int64_t block)
      : problem_(problem), encoded_(2 * problem.pairs), buffer_(block * encoded_) {
    const int64_t pairs = problem.pairs;
    // Each pair's rank among its axis's pairs, and each axis's frequencies in pair order.
    std::vector<std::vector<double>> freq(problem.n_axes);
    std::vector<int64_t> rank(pairs);
    for (int64_t i = 0; i < pairs; ++i) {
      rank[i] = static_cast<int64_t>(freq[problem.pair_axis[i]].size());
      freq[problem.pair_axis[i]].push_back(problem.inv_freq[i]);
    }
    // Where channel d comes from: (pair, cosine) by the layout, then (axis, offset in the axis's [sin | cos]);
    // consecutive channels that read consecutive values merge into one segment.
    std::vector<std::pair<int64_t, bool>> source(encoded_);
    for (int64_t first = 0, end = 0; first < pairs; first = end) {
      end = first + 1;
      while (end < pairs && problem.pair_axis[end] == problem.pair_axis[first]) ++end;
      for (int64_t i = first; i < end; ++i) {
        switch (problem.layout) {
          case SinusoidalLayout::Interleaved:
            source[2 * i] = {i, false};
            source[2 * i + 1] = {i, true};
            break;
          case SinusoidalLayout::Half:
            source[i] = {i, false};
            source[pairs + i] = {i, true};
            break;
          case SinusoidalLayout::HalfCosFirst:
            source[i] = {i, true};
            source[pairs + i] = {i, false};
            break;
          case SinusoidalLayout::HalfPerAxis:
            source[first + i] = {i, false};
            source[end + i] = {i, true};
            break;
        }
      }
    }
    for (int64_t d = 0; d < encoded_; ++d) {
      const auto [pair, cosine] = source[d];
      const int32_t axis = problem.pair_axis[pair];
      const int64_t offset = rank[pair] + (cosine ? static_cast<int64_t>(freq[axis].size()) : 0);
      if (!segments_.empty() && segments_.back().axis == axis &&
          segments_.back().offset + segments_.back().length == offset) {
        ++segments_.back().length;
      } else {
        segments_.push_back({d, axis, offset, 1});
      }
    }
    // Values kept per axis: up to 1 MiB of them in all, a grid's worth (a 512 x 512 grid of 1024 channels).
    const int64_t capacity = std::max<int64_t>(1, (int64_t{1} << 20) / (static_cast<int64_t>(sizeof(opmath)) * encoded_));
    for (auto& f : freq) {
      scratch_.emplace_back(2 * f.size());
      axes_.push_back(kept_axis_values<opmath>(std::move(f), capacity));
    }
    values_.resize(problem.n_axes);
    entries_.resize(block * problem.n_axes);
    // Adding a segment costs a loop of its own: worth it for runs of 16 channels or more on average (MAE's and
    // CogVideoX's layouts are one run per axis; an interleaved one is runs of 1).
    segmented_ = encoded_ >= 16 * static_cast<int64_t>(segments_.size());
  }

  void prepare(int64_t first, int64_t count) {
    first_ = first;
    const int64_t n_axes = problem_.n_axes;
    std::fill_n(entries_.begin(), count * n_axes, -1);  // a prefix token keeps -1: its row of buffer_ is -0.0
    encode_rows(problem_.sequence, first, count, encoded_, buffer_.data(), [&](int64_t p, int64_t index, opmath* pe) {
      int64_t* entries = entries_.data() + p * n_axes;
      const double* position = problem_.positions + index * n_axes;
      const bool fast = fast_angles(position, n_axes, problem_.max_abs_freq);  // sincos_row_axes' path
      // Every axis's entry made before any value is read: axes of equal frequencies share their AxisValues, whose
      // entries move as it grows.
      bool all_kept = true;
      for (int64_t a = 0; a < n_axes; ++a) {
        entries[a] = axes_[a]->entry(position[a], fast);
        all_kept = all_kept && entries[a] >= 0;
      }
      if (segmented_ && all_kept) return;
      for (int64_t a = 0; a < n_axes; ++a) {  // past capacity (-1): computed into the axis's scratch
        values_[a] = entries[a] >= 0 ? axes_[a]->values(entries[a])
                                     : axes_[a]->compute(position[a], fast, scratch_[a].data());
      }
      entries[0] = -1;  // the encoding is the row pe
      for (const auto& s : segments_) std::copy_n(values_[s.axis] + s.offset, s.length, pe + s.channel);
    });
  }

  void add(int64_t count, const scalar_t* const* in, int64_t position, scalar_t* const* out, int64_t width,
           opmath scale, RowStores stores) const {
    const int64_t p = position - first_;
    const int64_t* entries = entries_.data() + p * problem_.n_axes;
    const opmath* pe = buffer_.data() + p * encoded_;
    if (entries[0] < 0) {
      add_rows(count, in, pe, out, encoded_, width, scale, stores);
      return;
    }
#if defined(POSENC_STREAMS_ROW_LINES)
    constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>, kHalf = std::is_same_v<scalar_t, c10::Half>;
    if constexpr (kBf16 || kHalf) {
      if (in != nullptr && (kBf16 ? bf16_streamed(stores) : streamed(stores))) {
        const bool read_ahead = reads_ahead(stores);
        for (int64_t r = 0; r < count; ++r) add_lines(in[r], entries, out[r], width, scale, read_ahead);
        return;
      }
    }
#endif
    if (bf16_streamed(stores)) stores = RowStores::kBf16ByInstruction;
    // fp16 rows streamed a segment at a time would write the lines two segments share both ways (CogVideoX's grid:
    // 0.83x ordinary stores, in-process A/B): those not streamed by add_lines keep ordinary stores
    if (std::is_same_v<scalar_t, c10::Half>) stores = RowStores::kCached;
    const scalar_t* in_at[kRowsPerEncoding];
    scalar_t* out_at[kRowsPerEncoding];
    const auto add_at = [&](int64_t channel, const opmath* values, int64_t encoded, int64_t channels) {
      for (int64_t r = 0; r < count; ++r) {
        in_at[r] = in != nullptr ? in[r] + channel : nullptr;
        out_at[r] = out[r] + channel;
      }
      add_rows(count, in != nullptr ? in_at : nullptr, values, out_at, encoded, channels, scale, stores);
    };
    for (const auto& s : segments_) {
      add_at(s.channel, axes_[s.axis]->values(entries[s.axis]) + s.offset, s.length, s.length);
    }
    if (width > encoded_) add_at(encoded_, pe, 0, width - encoded_);  // channels without an encoding: x * scale
  }

 private:
  struct Segment {
    int64_t channel;
    int32_t axis;
    int64_t offset;
    int64_t length;
  };

#if defined(POSENC_STREAMS_ROW_LINES)
  // The encoding of channels [first, first + n) (n <= 32) into `line`, -0.0 past the encoded channels (which, added,
  // leaves every value as it is).
  const opmath* assemble(const int64_t* entries, int64_t first, int64_t n, opmath* line) const {
    std::fill_n(line, n, static_cast<opmath>(-0.0));
    for (const auto& s : segments_) {
      const int64_t a = std::max(first, s.channel), b = std::min(first + n, s.channel + s.length);
      if (a < b) {
        std::copy_n(axes_[s.axis]->values(entries[s.axis]) + s.offset + (a - s.channel), b - a, line + (a - first));
      }
    }
    return line;
  }

  // One bf16 or fp16 row of a kept token streamed past the caches as whole 64-byte lines, rounded in registers (bf16 by
  // AVX-512 BF16 or, in the baseline and AVX2 builds, by add_bf16_vectors; fp16 by F16C in the AVX2 and AVX-512
  // builds): the lines inside a segment straight from the axis's values, a line across segments (or past the encoded
  // channels) from its encoding assembled in `line`, the row's parts before its first whole line and after its last by
  // ordinary stores. CogVideoX's grid (segments of 240 and 360 channels) in-process A/B against ordinary stores, 1 and
  // 2 threads: bf16 1.17-1.18x (Zen 5); fp16 1.60-1.73x (an Emerald Rapids guest); bf16 streamed a segment at a time,
  // the lines two segments share written both ways, 0.79-0.92x; a row assembled first, 0.86-0.95x. The AVX2 build's
  // bf16, separate processes against its ordinary stores: 1.27-1.67x on 2 threads, 1.45-1.63x on one; the baseline's
  // 0.94-1.93x (median 1.5x).
  void add_lines(const scalar_t* x, const int64_t* entries, scalar_t* y, int64_t width, opmath scale,
                 bool read_ahead) const {
    constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
    alignas(64) opmath line[32];
    const auto add = [&](int64_t c, const opmath* pe, int64_t n, bool stream) {
      int64_t done = 0;
      if (stream) {
        if constexpr (kBf16) {
#if defined(POSENC_BF16_BY_AVX512BF16)
          done = add_bf16_by_instruction(x + c, pe, y + c, n, scale, true, read_ahead);
#else
          done = add_bf16_vectors<true>(x + c, pe, y + c, n, scale, read_ahead);
#endif
        } else {
#if defined(POSENC_HAS_F16C)
          done = add_half_by_instruction(x + c, pe, y + c, n, scale, true, read_ahead);
#endif
        }
      }
      if (done == n) return;
      const scalar_t* rest_in = x + c + done;
      scalar_t* rest_out = y + c + done;
      add_rows(1, &rest_in, pe + done, &rest_out, n - done, n - done, scale,
               kBf16 ? RowStores::kBf16ByInstruction : RowStores::kCached);
    };
    const auto address = reinterpret_cast<uintptr_t>(y);  // even: a bf16 tensor's
    const int64_t head = std::min<int64_t>(width, (64 - address % 64) % 64 / 2);  // under 32 channels
    if (head > 0) add(0, assemble(entries, 0, head, line), head, false);
    int64_t c = head;
    size_t next = 0;  // the segment holding channel c, found by walking forward
    while (c + 32 <= width) {
      while (next < segments_.size() && segments_[next].channel + segments_[next].length <= c) ++next;
      const int64_t lines = next < segments_.size() && segments_[next].channel <= c
                                ? (segments_[next].channel + segments_[next].length - c) / 32
                                : 0;
      if (lines > 0) {
        const auto& s = segments_[next];
        add(c, axes_[s.axis]->values(entries[s.axis]) + s.offset + (c - s.channel), 32 * lines, true);
        c += 32 * lines;
      } else {
        add(c, assemble(entries, c, 32, line), 32, true);
        c += 32;
      }
    }
    if (c < width) add(c, assemble(entries, c, width - c, line), width - c, false);
  }
#endif

  const SinusoidalProblem<scalar_t>& problem_;
  int64_t encoded_;
  ScratchVector<opmath> buffer_;
  // Per position of the block, each axis's AxisValues entry; -1 first where the encoding is the row of buffer_.
  std::vector<int64_t> entries_;
  std::vector<Segment> segments_;
  bool segmented_ = false;  // segments long enough to add from where the values are kept
  std::vector<std::shared_ptr<AxisValues<opmath>>> axes_;
  std::vector<ScratchVector<opmath>> scratch_;
  std::vector<const opmath*> values_;
  int64_t first_ = 0;
};

// Table rows need no preparation: the block is the rows the positions read.
template <typename scalar_t>
struct TableBlocks {
  const LearnedProblem<scalar_t>& problem;

  void prepare(int64_t, int64_t) {}
  void add(int64_t count, const scalar_t* const* in, int64_t position, scalar_t* const* out, int64_t width,
           opmath_t<scalar_t> scale, RowStores stores) const {
    const int64_t row = problem.table_rows != nullptr ? problem.table_rows[position] : problem.first_row + position;
    add_rows(count, in, problem.table + row * problem.width, out, width, width, scale, stores);
  }
};

template <typename scalar_t>
void sinusoidal_kernel(const SinusoidalProblem<scalar_t>& problem) {
  const int64_t encoded = 2 * problem.pairs;
  const int64_t block = std::min(problem.num_positions,
                                 rows_per_block(encoded * static_cast<int64_t>(sizeof(opmath_t<scalar_t>))));
  if (problem.pair_axis != nullptr) {
    add_to_rows(problem.in, problem.out, problem.rows, problem.width, problem.num_positions, block,
                problem.scale, [&] { return AxisEncodingBlocks<scalar_t>(problem, block); });
    return;
  }
  add_to_rows(problem.in, problem.out, problem.rows, problem.width, problem.num_positions, block,
              problem.scale, [&] { return EncodingBlocks<scalar_t>(problem, block); });
}

template <typename scalar_t>
void learned_kernel(const LearnedProblem<scalar_t>& problem) {
  const int64_t block = std::min(problem.num_positions,
                                 rows_per_block(problem.width * static_cast<int64_t>(sizeof(scalar_t))));
  add_to_rows(problem.in, problem.out, problem.rows, problem.width, problem.num_positions, block,
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
