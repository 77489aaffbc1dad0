// The CUDA kernels' index maths (csrc/cuda/geometry.h, the functions the kernels call), compiled for the host and
// enumerated without a GPU: every (block, thread, step) of each kernel's launch for the shapes of
// tests/python/test_cuda.py and the registry samples, plus edge shapes (empty, one element, a vector tail, an
// unaligned base, many rows on a device of one multiprocessor, so that the grid-stride loops wrap). Each launch
// must write every element of its output exactly once and nothing else, read and write only inside its tensors,
// issue 16-byte accesses only at aligned addresses, and in place read each element only in the thread that writes
// it. The kernels that sum (embedding_backward, alibi_backward, t5_bias_backward, qk_norm_rope's sums of squares
// and weight gradients) must sum in the CPU's order: replayed on the host in the GPU's order, their sums are the
// CPU kernels' bits (and a different order is not), and qk_norm_rope's weight-gradient chunks take each token and
// head in the CPU's order.
#include "cuda/geometry.h"
#include "portable/alibi.h"
#include "portable/convert.h"
#include "portable/rmsnorm.h"
#include "portable/rotary.h"
#include "portable/t5.h"

#include <posenc/posenc.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace geo = posenc::cuda::geometry;
using posenc::AlibiRows;
using posenc::RopeLayout;

constexpr int64_t kH200 = 132;  // multiprocessors of an H200 (and an H100 SXM)
constexpr int64_t kOneSM = 1;   // a device of one multiprocessor: 32 blocks, the grid-stride loops wrap
constexpr unsigned int kThreads = geo::kThreads;

int max_vec(int64_t element_bytes) { return static_cast<int>(geo::kVectorBytes / element_bytes); }

// ---------------------------------------------------------------------------------------------- simulated memory

// One tensor's storage in simulated device memory, from the tensor's first element: `misalign` elements past a
// 256-byte aligned address (what the caching allocator returns). Records who reads and writes each element.
class Memory {
 public:
  Memory(std::string name, int64_t elements, int64_t element_bytes, int64_t misalign = 0)
      : name_(std::move(name)), bytes_(element_bytes),
        base_(uintptr_t{1} << 20 | static_cast<uintptr_t>(misalign * element_bytes)), writes_(elements, 0),
        writer_(elements, -1), reader_(elements, -1), shared_read_(elements, false) {}

  const void* data() const { return reinterpret_cast<const void*>(base_); }
  int64_t size() const { return static_cast<int64_t>(writes_.size()); }
  int64_t vectors() const { return vectors_; }
  int64_t scalars() const { return scalars_; }
  int64_t failures() const { return failures_; }

  // V elements from `offset` (V > 1: one 16-byte access) by thread `thread`. track: the read counts for the
  // in-place rule (a read before a barrier that separates it from every write does not).
  void read(int64_t offset, int V, int64_t thread, bool track = true) {
    if (!check(offset, V, "read")) return;
    for (int64_t k = 0; k < V && track; ++k) {
      auto& r = reader_[offset + k];
      if (r >= 0 && r != thread) shared_read_[offset + k] = true;
      r = thread;
    }
  }

  void write(int64_t offset, int V, int64_t thread) {
    if (!check(offset, V, "write")) return;
    for (int64_t k = 0; k < V; ++k) {
      ++writes_[offset + k];
      writer_[offset + k] = thread;
    }
  }

  // Every element of `elements` written exactly once, no other element written.
  void expect_written_once(const std::vector<int64_t>& elements) {
    std::vector<bool> expected(writes_.size(), false);
    for (const int64_t e : elements) expected.at(e) = true;
    for (int64_t e = 0; e < size(); ++e) {
      if (writes_[e] != (expected[e] ? 1 : 0)) {
        fail("element " + std::to_string(e) + " written " + std::to_string(writes_[e]) + " times, expected " +
             (expected[e] ? "once" : "never"));
      }
    }
  }

  // In place: each written element read by its writer alone.
  void expect_read_by_writer() {
    for (int64_t e = 0; e < size(); ++e) {
      if (writes_[e] > 0 && (shared_read_[e] || (reader_[e] >= 0 && reader_[e] != writer_[e]))) {
        fail("element " + std::to_string(e) + " written by thread " + std::to_string(writer_[e]) +
             " is read by another thread");
      }
    }
  }

  void fail(const std::string& what) {
    if (failures_++ < 5) ADD_FAILURE() << name_ << ": " << what;
  }

 private:
  bool check(int64_t offset, int V, const char* what) {
    if (offset < 0 || offset + V > size()) {
      fail(std::string(what) + " of elements [" + std::to_string(offset) + ", " + std::to_string(offset + V) +
           ") outside [0, " + std::to_string(size()) + ")");
      return false;
    }
    if (V == 1) {
      ++scalars_;
      return true;
    }
    ++vectors_;
    const uintptr_t address = base_ + static_cast<uintptr_t>(offset * bytes_);
    if (V * bytes_ != geo::kVectorBytes || address % geo::kVectorBytes != 0) {
      fail(std::string(what) + " of " + std::to_string(V) + " elements at byte address " + std::to_string(address) +
           ": not one aligned 16-byte access");
      return false;
    }
    return true;
  }

  std::string name_;
  int64_t bytes_;
  uintptr_t base_;
  std::vector<int32_t> writes_;
  std::vector<int64_t> writer_;
  std::vector<int64_t> reader_;
  std::vector<bool> shared_read_;
  int64_t vectors_ = 0;
  int64_t scalars_ = 0;
  int64_t failures_ = 0;
};

// The storage offsets of a strided view's elements, and the storage it needs.
std::vector<int64_t> view_elements(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  std::vector<int64_t> out{0};
  for (size_t d = 0; d < sizes.size(); ++d) {
    std::vector<int64_t> next;
    next.reserve(out.size() * sizes[d]);
    for (const int64_t base : out) {
      for (int64_t i = 0; i < sizes[d]; ++i) next.push_back(base + i * strides[d]);
    }
    out = std::move(next);
  }
  return out;
}

int64_t extent(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  int64_t last = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return 0;
    last += (sizes[d] - 1) * strides[d];
  }
  return last + 1;
}

std::vector<int64_t> contiguous(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
  return strides;
}

// A launch's grid must be launchable: every dimension in [1, its limit].
void expect_launchable(const geo::Grid& g, const std::string& what) {
  EXPECT_TRUE(g.x >= 1 && g.x <= geo::kMaxGridX && g.y >= 1 && g.y <= geo::kMaxGridY && g.z >= 1 &&
              g.z <= geo::kMaxGridY)
      << what << ": grid " << g.x << " x " << g.y << " x " << g.z;
}

int64_t thread_id(int64_t block, unsigned int thread) { return block * kThreads + thread; }

// Random values whose magnitudes span 2^-20 .. 2^20: sums of them in different orders round differently.
at::Tensor spread_values(at::IntArrayRef sizes, at::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  const auto mantissa = torch::randn(sizes, at::kDouble);
  const auto exponent = torch::randint(-20, 21, sizes, at::kDouble);
  return (mantissa * torch::pow(2.0, exponent)).to(dtype);
}

std::string shape_name(const std::string& name, int64_t element_bytes, int64_t sms) {
  return name + " (" + std::to_string(element_bytes) + "-byte elements, " + std::to_string(sms) + " SMs)";
}

// ---------------------------------------------------------------------------------------------- ALiBi forward

struct AlibiCase {
  std::string name;
  std::vector<int64_t> sizes;  // [B, H, Q, K]
  std::vector<int64_t> out_strides;  // empty: contiguous (a fresh output)
  bool has_in = false;
  bool in_place = false;  // add_alibi_: in = out
  std::vector<int64_t> in_strides;  // empty: contiguous
  int64_t misalign = 0;   // elements past alignment of the view's first element (out, and in)
  std::optional<bool> vectors;  // whether the V-element path must be taken
};

AlibiRows rows_of(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  return {sizes[1], sizes[2], sizes[3], strides[0], strides[1], strides[2], strides[3]};
}

void check_alibi(const AlibiCase& c, int64_t element_bytes, int64_t sms) {
  SCOPED_TRACE(shape_name("alibi " + c.name, element_bytes, sms));
  const int V = max_vec(element_bytes);
  const auto out_strides = c.out_strides.empty() ? contiguous(c.sizes) : c.out_strides;
  const auto in_strides = c.in_place ? out_strides : c.in_strides.empty() ? contiguous(c.sizes) : c.in_strides;
  Memory out("out", extent(c.sizes, out_strides), element_bytes, c.misalign);
  Memory in_memory("in", extent(c.sizes, in_strides), element_bytes, c.misalign);
  Memory& in = c.in_place ? out : in_memory;
  const bool has_in = c.has_in || c.in_place;
  const auto out_rows = rows_of(c.sizes, out_strides);
  const auto in_rows = rows_of(c.sizes, in_strides);
  const int64_t num_rows = c.sizes[0] * c.sizes[1] * c.sizes[2];
  const bool vectorized = geo::alibi_vectorizable(out.data(), out_rows, V) &&
                          (!has_in || geo::alibi_vectorizable(in.data(), in_rows, V));
  const auto plan = geo::rows_launch(num_rows, out_rows.k_len, vectorized, V, sms);
  if (c.vectors) {
    EXPECT_EQ(plan.V, *c.vectors ? V : 1);
  }
  expect_launchable({plan.blocks}, "alibi_kernel");
  const int64_t work = num_rows * plan.chunks;
  for (int64_t block = 0; block < plan.blocks; ++block) {
    for (unsigned int t = 0; t < kThreads; ++t) {
      for (int64_t w = geo::stride_first(block, kThreads, t); w < work; w += geo::stride_step(plan.blocks, kThreads)) {
        const auto [n, j0] = geo::row_piece(w, plan.chunks, plan.V);
        const int64_t dst = posenc::portable::alibi_row_offset(out_rows, n);
        const int64_t src = posenc::portable::alibi_row_offset(in_rows, n);
        if (plan.V == 1) {
          if (has_in) in.read(src + j0 * in_rows.stride_j, 1, thread_id(block, t));
          out.write(dst + j0 * out_rows.stride_j, 1, thread_id(block, t));
        } else {
          if (has_in) in.read(src + j0, plan.V, thread_id(block, t));
          out.write(dst + j0, plan.V, thread_id(block, t));
        }
      }
    }
  }
  out.expect_written_once(view_elements(c.sizes, out_strides));
  if (c.in_place) out.expect_read_by_writer();
  EXPECT_EQ(out.failures() + in.failures(), 0);
}

TEST(CudaGeometry, AlibiBiasEveryElementOnceAlignedInBounds) {
  const std::vector<AlibiCase> cases = {
      // test_cuda.py: alibi_bias [1, 4, 5, 9] and [3, 8, 4, 4]; add_alibi [2, 4, 6, K], K whole vectors and not, a key
      // stride (transposed view), in place through a view [:, 1:]
      {"alibi_bias [1,4,5,9]", {1, 4, 5, 9}},
      {"alibi_bias [3,8,4,4]", {3, 8, 4, 4}},
      {"add_alibi [2,4,6,40]", {2, 4, 6, 40}, {}, true, false, {}, 0, true},
      {"add_alibi [2,4,6,37]", {2, 4, 6, 37}, {}, true, false, {}, 0, false},
      {"add_alibi key stride K=40", {2, 4, 6, 40}, {}, true, false, {4 * 6 * 40, 6 * 40, 1, 6}, 0, false},
      {"add_alibi key stride K=37", {2, 4, 6, 37}, {}, true, false, {4 * 6 * 37, 6 * 37, 1, 6}},
      {"add_alibi_ view [:, 1:] K=40", {2, 3, 6, 40}, {4 * 6 * 40, 6 * 40, 40, 1}, false, true},
      {"add_alibi_ view [:, 1:] K=37", {2, 3, 6, 37}, {4 * 6 * 37, 6 * 37, 37, 1}, false, true},
      // registry samples, small and large
      {"sample alibi_bias [1,4,16,67]", {1, 4, 16, 67}},
      {"sample alibi_bias large [1,12,128,512]", {1, 12, 128, 512}, {}, false, false, {}, 0, true},
      {"sample add_alibi [2,4,16,67]", {2, 4, 16, 67}, {}, true},
      {"sample add_alibi_ transposed [2,4,16,67]", {2, 4, 16, 67}, {4 * 67 * 16, 67 * 16, 1, 16}, false, true},
      {"sample add_alibi_ large [2,16,128,256]", {2, 16, 128, 256}, {}, false, true, {}, 0, true},
      // edges: empty, one element, a vector tail, unaligned bases, many rows (the loop wraps on one SM)
      {"empty [2,4,0,8]", {2, 4, 0, 8}, {}, true},
      {"one element", {1, 1, 1, 1}, {}, true, false, {}, 0, false},
      {"tail K = 8k + 5", {1, 2, 3, 8 * 3 + 5}, {}, true, false, {}, 0, false},
      {"unaligned out", {2, 2, 4, 32}, {}, false, false, {}, 1, false},
      {"unaligned in place", {2, 2, 4, 32}, {}, false, true, {}, 1, false},
      {"many rows", {4, 16, 256, 64}, {}, true, false, {}, 0, true},
  };
  for (const auto& c : cases) {
    for (const int64_t bytes : {2, 4, 8}) {
      for (const int64_t sms : {kH200, kOneSM}) check_alibi(c, bytes, sms);
    }
  }
}

// ---------------------------------------------------------------------------------------------- ALiBi backward

// alibi_backward replayed in the GPU's order: each row's 16 lanes (unit key stride) or one thread per row, then each
// slope's rows. `reorder`: each row summed key by key instead, a different order (the control).
at::Tensor alibi_backward_gpu_order(const at::Tensor& grad, const at::Tensor& slopes, bool symmetric,
                                    int64_t head_offset, int64_t sms, bool reorder = false) {
  const std::vector<int64_t> sizes(grad.sizes().begin(), grad.sizes().end());
  const std::vector<int64_t> strides(grad.strides().begin(), grad.strides().end());
  const auto rows = rows_of(sizes, strides);
  const int64_t num_rows = sizes[0] * sizes[1] * sizes[2];
  const auto g = grad.to(at::kFloat);  // (float32 data: the values, read through the same strides)
  const float* data = g.const_data_ptr<float>();
  Memory memory("grad", extent(sizes, strides), 4);
  std::vector<double> row_sums(num_rows);
  std::vector<int> written(num_rows, 0);
  const auto weight = [&](double distance0, int64_t j) {
    const double d = distance0 - static_cast<double>(j);
    return symmetric ? std::fabs(d) : d;
  };
  const auto value = [&](int64_t offset, int64_t thread) {
    memory.read(offset, 1, thread, false);
    return static_cast<double>(data[offset]);
  };
  const int64_t k_len = rows.k_len;
  const bool unit = rows.stride_j == 1;
  const int64_t blocks = geo::alibi_row_sums_blocks(num_rows, unit, sms);
  if (unit && !reorder) {
    const int64_t whole = geo::alibi_whole(k_len);
    for (int64_t block = 0; block < blocks; ++block) {
      for (int64_t first = geo::stride_first(block, geo::kAlibiRowsPerBlock, 0); first < num_rows;
           first += geo::stride_step(blocks, geo::kAlibiRowsPerBlock)) {
        double lanes[kThreads];
        for (unsigned int t = 0; t < kThreads; ++t) {  // each lane's keys, before the barrier
          const auto [lane, slot] = geo::alibi_lane(t);
          const int64_t n = first + slot;
          double sum = 0.0;
          if (n < num_rows) {
            const int64_t row = posenc::portable::alibi_row_offset(rows, n);
            const auto distance0 = static_cast<double>(posenc::portable::alibi_distance0(rows, n));
            for (int64_t j = lane; j < whole; j += geo::kAlibiLanes) {
              sum += value(row + j, thread_id(block, t)) * weight(distance0, j);
            }
          }
          lanes[t] = sum;
        }
        for (unsigned int t = 0; t < kThreads; ++t) {  // lane 0: the lanes in order, then the tail
          const auto [lane, slot] = geo::alibi_lane(t);
          const int64_t n = first + slot;
          if (lane != 0 || n >= num_rows) continue;
          const int64_t row = posenc::portable::alibi_row_offset(rows, n);
          const auto distance0 = static_cast<double>(posenc::portable::alibi_distance0(rows, n));
          double tail = 0.0;
          for (int64_t j = whole; j < k_len; ++j) tail += value(row + j, thread_id(block, t)) * weight(distance0, j);
          double total = 0.0;
          for (int l = 0; l < geo::kAlibiLanes; ++l) total += lanes[t + l];
          row_sums[n] = -(total + tail);
          ++written[n];
        }
      }
    }
  } else {
    for (int64_t block = 0; block < blocks; ++block) {
      for (unsigned int t = 0; t < kThreads; ++t) {
        for (int64_t n = geo::stride_first(block, kThreads, t); n < num_rows; n += geo::stride_step(blocks, kThreads)) {
          const int64_t row = posenc::portable::alibi_row_offset(rows, n);
          const auto distance0 = static_cast<double>(posenc::portable::alibi_distance0(rows, n));
          double tail = 0.0;
          for (int64_t j = 0; j < k_len; ++j) {
            tail += value(row + j * rows.stride_j, thread_id(block, t)) * weight(distance0, j);
          }
          row_sums[n] = -(0.0 + tail);
          ++written[n];
        }
      }
    }
  }
  for (int64_t n = 0; n < num_rows; ++n) {
    EXPECT_EQ(written[n], 1) << "row sum " << n;
  }
  // Each slope's rows in row order (alibi_slope_sums_kernel).
  const bool per_batch = slopes.dim() == 2;
  const int64_t total_heads = slopes.size(-1);
  auto out = at::zeros(slopes.sizes(), at::kDouble);
  double* acc = out.mutable_data_ptr<double>();
  const int64_t entries = (per_batch ? sizes[0] : 1) * rows.heads;
  const int64_t slope_blocks = geo::grid_size(entries, kThreads, sms);
  std::vector<int> slope_written(out.numel(), 0);
  for (int64_t block = 0; block < slope_blocks; ++block) {
    for (unsigned int t = 0; t < kThreads; ++t) {
      for (int64_t e = geo::stride_first(block, kThreads, t); e < entries;
           e += geo::stride_step(slope_blocks, kThreads)) {
        const auto [b_slope, h, batches] = geo::alibi_slope_rows(e, rows.heads, sizes[0], per_batch);
        double sum = 0.0;
        for (int64_t b = batches.begin; b < batches.end; ++b) {
          for (int64_t i = 0; i < rows.q_len; ++i) sum += row_sums.at((b * rows.heads + h) * rows.q_len + i);
        }
        acc[b_slope * total_heads + head_offset + h] = sum;
        ++slope_written.at(b_slope * total_heads + head_offset + h);
      }
    }
  }
  for (int64_t h = 0; h < total_heads; ++h) {
    for (int64_t b = 0; b < (per_batch ? sizes[0] : 1); ++b) {
      const bool covered = h >= head_offset && h < head_offset + rows.heads;
      EXPECT_EQ(slope_written[b * total_heads + h], covered ? 1 : 0) << "slope " << b << ", " << h;
    }
  }
  EXPECT_EQ(memory.failures(), 0);
  return out;
}

TEST(CudaGeometry, AlibiBackwardSumsInTheCpuOrder) {
  struct Case {
    std::string name;
    at::Tensor grad;
    at::Tensor slopes;
    bool symmetric;
    int64_t head_offset;
  };
  const auto grad_40 = spread_values({2, 4, 6, 40}, at::kFloat, 1);
  const auto grad_37 = spread_values({2, 4, 6, 37}, at::kFloat, 2);
  const auto slopes_8 = torch::rand({8}, at::kDouble);
  const auto per_batch = torch::rand({2, 4}, at::kDouble);
  const std::vector<Case> cases = {
      {"test_cuda K=40", grad_40, slopes_8, false, 4},
      {"test_cuda K=37 symmetric", grad_37, slopes_8, true, 4},
      {"test_cuda per-batch slopes", grad_37, per_batch, false, 0},
      {"test_cuda key stride", grad_40.transpose(2, 3).contiguous().transpose(2, 3), slopes_8, true, 0},
      {"sample [2,4,16,67]", spread_values({2, 4, 16, 67}, at::kFloat, 3), torch::rand({8}, at::kDouble), false, 3},
      {"one element", spread_values({1, 1, 1, 1}, at::kFloat, 4), torch::rand({1}, at::kDouble), false, 0},
      {"many rows", spread_values({2, 8, 300, 48}, at::kFloat, 5), torch::rand({8}, at::kDouble), true, 0},
  };
  for (const auto& c : cases) {
    for (const int64_t sms : {kH200, kOneSM}) {
      SCOPED_TRACE(shape_name("alibi_backward " + c.name, 4, sms));
      const char* mode = c.symmetric ? "symmetric" : "causal";
      const auto cpu = posenc::alibi_backward(c.grad, c.slopes, mode, c.head_offset);
      const auto gpu = alibi_backward_gpu_order(c.grad, c.slopes, c.symmetric, c.head_offset, sms);
      EXPECT_TRUE(torch::equal(gpu, cpu)) << "GPU order " << gpu << " CPU " << cpu;
      if (c.grad.size(3) >= 32 && c.grad.stride(3) == 1) {  // the lanes matter: summed key by key, other bits
        const auto reordered = alibi_backward_gpu_order(c.grad, c.slopes, c.symmetric, c.head_offset, sms, true);
        EXPECT_FALSE(torch::equal(reordered, cpu)) << "the data cannot tell the orders apart";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- T5

void check_t5_rows(const std::string& name, int64_t heads, int64_t q_len, int64_t k_len, int64_t misalign,
                   int64_t element_bytes, int64_t sms, std::optional<bool> vectors) {
  SCOPED_TRACE(shape_name("t5_bias " + name, element_bytes, sms));
  const int V = max_vec(element_bytes);
  const int64_t diagonals = q_len + k_len - 1;
  Memory out("out", heads * q_len * k_len, element_bytes, misalign);
  Memory diag("diagonal values", heads * diagonals, element_bytes);
  const bool vectorized = geo::bias_rows_vectorizable(k_len, out.data(), V);
  const auto plan = geo::rows_launch(heads * q_len, k_len, vectorized, V, sms);
  if (vectors) {
    EXPECT_EQ(plan.V, *vectors ? V : 1);
  }
  const int64_t work = heads * q_len * plan.chunks;
  for (int64_t block = 0; block < plan.blocks; ++block) {
    for (unsigned int t = 0; t < kThreads; ++t) {
      for (int64_t w = geo::stride_first(block, kThreads, t); w < work; w += geo::stride_step(plan.blocks, kThreads)) {
        const auto [n, j0] = geo::row_piece(w, plan.chunks, plan.V);
        const auto [h, i] = geo::split(n, q_len);
        const int64_t src = h * diagonals + geo::row_first_diagonal(i, q_len) + j0;
        for (int k = 0; k < plan.V; ++k) {
          // out[h, i, j] is diagonal j - i + q_len - 1 of head h
          if (src + k != h * diagonals + (j0 + k) - i + q_len - 1) out.fail("reads the wrong diagonal");
          diag.read(src + k, 1, thread_id(block, t), false);
        }
        out.write(n * k_len + j0, plan.V, thread_id(block, t));
      }
    }
  }
  out.expect_written_once(view_elements({heads * q_len * k_len}, {1}));
  EXPECT_EQ(out.failures() + diag.failures(), 0);
}

TEST(CudaGeometry, T5BiasRowsEveryElementOnceAlignedInBounds) {
  struct Case {
    std::string name;
    int64_t heads, q_len, k_len, misalign;
    std::optional<bool> vectors;
  };
  const std::vector<Case> cases = {
      {"test_cuda [3,7,12]", 3, 7, 12, 0, std::nullopt},  // 12: whole float32/float64 vectors, a tail for fp16
      {"test_cuda [3,16,16]", 3, 16, 16, 0, true},
      {"sample [4,16,70]", 4, 16, 70, 0, std::nullopt},  // 70: whole float64 vectors only
      {"sample large [16,128,512]", 16, 128, 512, 0, true},
      {"one element", 1, 1, 1, 0, false},
      {"tail K = 8k + 3", 2, 5, 19, 0, false},
      {"unaligned", 2, 4, 32, 1, false},
      {"many rows", 8, 512, 64, 0, true},
  };
  for (const auto& c : cases) {
    for (const int64_t bytes : {2, 4, 8}) {
      for (const int64_t sms : {kH200, kOneSM}) {
        check_t5_rows(c.name, c.heads, c.q_len, c.k_len, c.misalign, bytes, sms, c.vectors);
      }
    }
  }
}

// t5_bias_backward replayed in the GPU's order: each diagonal over its rows, then each bucket over its diagonals.
at::Tensor t5_backward_gpu_order(const at::Tensor& grad, bool bidirectional, int64_t num_buckets,
                                 int64_t max_distance, int64_t q_offset, int64_t sms, bool reorder = false) {
  const int64_t heads = grad.size(1);
  const int64_t q_len = grad.size(2);
  const int64_t k_len = grad.size(3);
  const int64_t diagonals = q_len + k_len - 1;
  const auto g = grad.contiguous();
  const double* data = g.const_data_ptr<double>();
  const auto t5 = posenc::portable::make_t5_buckets(bidirectional, num_buckets, max_distance);
  const auto thresholds = posenc::portable::t5_log_thresholds(t5);
  std::vector<int64_t> buckets(diagonals);
  for (int64_t r = 0; r < diagonals; ++r) {
    buckets[r] = posenc::portable::t5_bucket_tabulated(t5, thresholds.data(), static_cast<int64_t>(thresholds.size()),
                                                       -(q_len - 1) - q_offset + r);
  }
  Memory memory("grad", heads * q_len * k_len, 8);
  std::vector<int> reads(heads * q_len * k_len, 0);
  std::vector<double> sums(heads * diagonals);
  const int64_t total = heads * diagonals;
  const int64_t blocks = geo::grid_size(total, kThreads, sms);
  for (int64_t block = 0; block < blocks; ++block) {
    for (unsigned int t = 0; t < kThreads; ++t) {
      for (int64_t e = geo::stride_first(block, kThreads, t); e < total; e += geo::stride_step(blocks, kThreads)) {
        const auto [h, r] = geo::split(e, diagonals);
        const auto rows = geo::diagonal_rows(r, q_len, k_len);
        double sum = 0.0;
        for (int64_t n = 0; n < rows.end - rows.begin; ++n) {
          const int64_t i = reorder ? rows.end - 1 - n : rows.begin + n;
          const int64_t j = geo::diagonal_key(r, i, q_len);
          if (j < 0 || j >= k_len || j - i + q_len - 1 != r) memory.fail("a key off diagonal " + std::to_string(r));
          const int64_t offset = h * q_len * k_len + i * k_len + j;
          memory.read(offset, 1, thread_id(block, t), false);
          ++reads.at(offset);
          sum += data[offset];
        }
        sums[e] = sum;
      }
    }
  }
  for (size_t e = 0; e < reads.size(); ++e) {
    EXPECT_EQ(reads[e], 1) << "gradient element " << e << " summed";
  }
  auto acc = at::zeros({heads, num_buckets}, at::kDouble);
  double* out = acc.mutable_data_ptr<double>();
  const int64_t bucket_total = heads * num_buckets;
  const int64_t bucket_blocks = geo::grid_size(bucket_total, kThreads, sms);
  for (int64_t block = 0; block < bucket_blocks; ++block) {
    for (unsigned int t = 0; t < kThreads; ++t) {
      for (int64_t e = geo::stride_first(block, kThreads, t); e < bucket_total;
           e += geo::stride_step(bucket_blocks, kThreads)) {
        const auto [h, b] = geo::split(e, num_buckets);
        double sum = 0.0;
        for (int64_t r = 0; r < diagonals; ++r) {
          if (buckets[r] == b) sum += sums[h * diagonals + r];
        }
        out[e] = sum;
      }
    }
  }
  EXPECT_EQ(memory.failures(), 0);
  return acc.t().contiguous();
}

TEST(CudaGeometry, T5BiasBackwardSumsInTheCpuOrder) {
  struct Case {
    std::string name;
    std::vector<int64_t> sizes;
    bool bidirectional;
    int64_t num_buckets, max_distance, q_offset;
  };
  const std::vector<Case> cases = {
      {"test_cuda [1,3,7,12]", {1, 3, 7, 12}, true, 32, 128, -4},
      {"test_cuda unidirectional", {1, 3, 7, 12}, false, 5, 7, -4},
      {"sample [1,4,16,70]", {1, 4, 16, 70}, true, 32, 128, 7},
      {"one element", {1, 1, 1, 1}, true, 32, 128, 0},
      {"tall: few buckets, long diagonals", {1, 2, 200, 30}, false, 8, 20, 0},
      {"many diagonals", {1, 4, 64, 700}, true, 64, 1000, 3},
  };
  for (const auto& c : cases) {
    for (const int64_t sms : {kH200, kOneSM}) {
      SCOPED_TRACE(shape_name("t5_bias_backward " + c.name, 8, sms));
      const auto grad = spread_values(c.sizes, at::kDouble, 11);
      const auto cpu = posenc::t5_bias_backward(grad, c.bidirectional, c.num_buckets, c.max_distance, c.q_offset);
      const auto gpu = t5_backward_gpu_order(grad, c.bidirectional, c.num_buckets, c.max_distance, c.q_offset, sms);
      EXPECT_TRUE(torch::equal(gpu, cpu));
      if (c.sizes[2] >= 16) {  // diagonals of 3 rows or more: their rows in reverse give other bits
        const auto reordered =
            t5_backward_gpu_order(grad, c.bidirectional, c.num_buckets, c.max_distance, c.q_offset, sms, true);
        EXPECT_FALSE(torch::equal(reordered, cpu)) << "the data cannot tell the orders apart";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- embedding_backward

// embedding_backward replayed in the GPU's order: the stable sort's groups (as CudaEmbedding::sum_rows forms them,
// with ATen's sort and searchsorted), a thread per V channels of a table row adding its group's rows in order.
template <typename scalar_t>
at::Tensor embedding_backward_gpu_order(const at::Tensor& grad, const at::Tensor& indices, int64_t num_rows,
                                        double scale, int64_t skip, int64_t sms, bool reorder = false) {
  using opmath = posenc::opmath_t<scalar_t>;
  const auto rows = grad.contiguous();
  const int64_t width = rows.size(-1);
  const int64_t num_grad_rows = rows.numel() / width;
  const auto ids = indices.to(at::kLong).contiguous().view({-1});
  const auto row_ids =
      ids.numel() == num_grad_rows ? ids : ids.repeat({num_grad_rows / std::max<int64_t>(ids.numel(), 1)});
  const auto sorted = at::sort(row_ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto order = std::get<1>(sorted).contiguous();
  const auto group_start = at::searchsorted(std::get<0>(sorted), at::arange(num_rows + 1, row_ids.options()));
  const int64_t* order_data = order.const_data_ptr<int64_t>();
  const int64_t* start = group_start.const_data_ptr<int64_t>();
  const int V = max_vec(sizeof(scalar_t));
  const int64_t bytes = sizeof(scalar_t);
  Memory grad_memory("grad", rows.numel(), bytes, rows.storage_offset());
  Memory out_memory("out", num_rows * width, bytes);
  const bool vectorized = geo::embedding_vectorizable(width, grad_memory.data(), out_memory.data(), V);
  const auto plan = geo::embedding_launch(num_rows, width, vectorized, V, sms);
  auto out = at::empty({num_rows, width}, rows.options());
  const scalar_t* g = rows.const_data_ptr<scalar_t>();
  scalar_t* y = out.mutable_data_ptr<scalar_t>();
  const auto row_scale = static_cast<opmath>(scale);
  const int64_t tiles = num_rows * plan.chunks;
  for (int64_t block = 0; block < plan.blocks; ++block) {
    for (int64_t tile = block; tile < tiles; tile += plan.blocks) {
      for (unsigned int t = 0; t < kThreads; ++t) {
        const auto [r, d0] = geo::tile_piece(tile, plan.chunks, kThreads, t, plan.V);
        if (d0 >= width) continue;
        const auto [first, last] = geo::embedding_group(r, skip, start);
        std::vector<opmath> acc(plan.V, opmath(0));
        for (int64_t n = 0; n < last - first; ++n) {
          const int64_t row = order_data[reorder ? last - 1 - n : first + n];
          grad_memory.read(row * width + d0, plan.V, thread_id(block, t), false);
          for (int k = 0; k < plan.V; ++k) acc[k] += posenc::portable::to_opmath(g[row * width + d0 + k]);
        }
        out_memory.write(r * width + d0, plan.V, thread_id(block, t));
        for (int k = 0; k < plan.V; ++k) {
          const opmath sum = first == last ? opmath(0) : acc[k] * row_scale;
          y[r * width + d0 + k] = posenc::portable::from_opmath<scalar_t>(sum);
        }
      }
    }
  }
  out_memory.expect_written_once(view_elements({num_rows * width}, {1}));
  EXPECT_EQ(grad_memory.failures() + out_memory.failures(), 0);
  return out;
}

TEST(CudaGeometry, EmbeddingBackwardEveryRowOnceSummedInTheCpuOrder) {
  struct Case {
    std::string name;
    at::Tensor grad;
    at::Tensor indices;
    int64_t num_rows;
    double scale;
    std::optional<int64_t> padding_idx;
  };
  std::vector<Case> cases;
  for (const int64_t width : {64, 33}) {  // test_cuda.py: whole vectors, and not; a frequent row (7)
    torch::manual_seed(width);
    auto ids = torch::randint(0, 20, {4, 50}, at::kLong);
    ids.index_put_({torch::indexing::Slice(), torch::indexing::Slice(torch::indexing::None, torch::indexing::None, 3)},
                   7);
    const auto grad = spread_values({4, 50, width}, at::kFloat, 20 + width);
    for (const auto& indices : {ids, ids[0]}) {  // per row, and shared by the batch
      for (const auto padding : {std::optional<int64_t>(), std::optional<int64_t>(7)}) {
        cases.push_back({"test_cuda width " + std::to_string(width), grad, indices, 25, 1.5, padding});
      }
    }
    cases.push_back({"test_cuda transposed", grad.transpose(0, 1), ids.t().to(at::kInt), 25, 1.0, std::nullopt});
  }
  torch::manual_seed(3);
  cases.push_back({"sample [3,8,130]", spread_values({3, 8, 130}, at::kFloat, 30), torch::randint(0, 50, {8}), 50,
                   1.5, std::nullopt});
  cases.push_back({"sample large [4,1024,256]", spread_values({4, 1024, 256}, at::kFloat, 31),
                   torch::randint(0, 3000, {4, 1024}), 3000, 0.5, 7});
  cases.push_back({"no gradient rows", spread_values({0, 16}, at::kFloat, 32), torch::zeros({0}, at::kLong), 5, 1.0,
                   std::nullopt});
  cases.push_back({"one element", spread_values({1, 1}, at::kFloat, 33), torch::zeros({1}, at::kLong), 1, 2.0,
                   std::nullopt});
  const auto base = spread_values({1 + 6 * 32}, at::kFloat, 34);  // unaligned rows: a view one element on
  cases.push_back({"unaligned grad", base.slice(0, 1).view({6, 32}), torch::tensor({0, 1, 1, 2, 1, 0}), 3, 1.0,
                   std::nullopt});
  for (const auto& c : cases) {
    for (const int64_t sms : {kH200, kOneSM}) {
      for (const auto dtype : {at::kFloat, at::kBFloat16}) {
        SCOPED_TRACE(shape_name("embedding_backward " + c.name, at::elementSize(dtype), sms));
        const auto grad = c.grad.to(dtype);
        const auto cpu = posenc::embedding_backward(grad, c.indices, c.num_rows, c.scale, c.padding_idx);
        const int64_t skip = c.padding_idx.value_or(-1);
        const auto gpu = dtype == at::kFloat
                             ? embedding_backward_gpu_order<float>(grad, c.indices, c.num_rows, c.scale, skip, sms)
                             : embedding_backward_gpu_order<c10::BFloat16>(grad, c.indices, c.num_rows, c.scale,
                                                                           skip, sms);
        EXPECT_TRUE(torch::equal(gpu, cpu));
        if (dtype == at::kFloat && c.name.rfind("test_cuda", 0) == 0) {  // row 7's long sum, reversed: other bits
          const auto reordered = embedding_backward_gpu_order<float>(grad, c.indices, c.num_rows, c.scale, skip, sms,
                                                                     true);
          EXPECT_FALSE(torch::equal(reordered, cpu)) << "the data cannot tell the orders apart";
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- additive

struct AdditiveCase {
  std::string name;
  int64_t leads;          // leading indices sharing a position
  int64_t positions;      // P
  int64_t width;
  enum Input { kRows, kTable, kNone } input;  // x rows, token-table rows by id, or the encoding alone
  int64_t in_misalign = 0;
  bool table_encoding = false;  // the learned family: pe from a table of num_table rows
  int64_t table_misalign = 0;
  std::optional<bool> vectors;
};

void check_additive(const AdditiveCase& c, int64_t element_bytes, int64_t sms) {
  SCOPED_TRACE(shape_name("additive " + c.name, element_bytes, sms));
  const int V = max_vec(element_bytes);
  const int64_t rows = c.leads * c.positions;
  constexpr int64_t kVocab = 37;
  Memory out("out", rows * c.width, element_bytes);
  Memory in("in", (c.input == AdditiveCase::kTable ? kVocab : rows) * c.width, element_bytes, c.in_misalign);
  Memory table("position table", (c.positions + 3) * c.width, element_bytes, c.table_misalign);
  const bool encoding_aligned = c.table_encoding ? geo::aligned(table.data()) : true;
  const bool vectorized = geo::additive_vectorizable(c.width, c.input == AdditiveCase::kNone ? nullptr : in.data(),
                                                     out.data(), encoding_aligned, V);
  const auto plan = geo::additive_launch(c.width, c.leads, c.positions, vectorized, V, sms);
  if (c.vectors) {
    EXPECT_EQ(plan.V, *c.vectors ? V : 1);
  }
  if (rows == 0) {  // launch_additive launches nothing (the op layers return before)
    EXPECT_TRUE(plan.grid.x == 0 || plan.grid.y == 0);
    return;
  }
  expect_launchable(plan.grid, "additive_kernel");
  const int64_t tiles = c.positions * plan.chunks;
  for (int64_t by = 0; by < plan.grid.y; ++by) {
    const auto [lead_begin, lead_end] = geo::lead_range(by, plan.leads_per_block, c.leads);
    for (int64_t bx = 0; bx < plan.grid.x; ++bx) {
      const int64_t block = by * plan.grid.x + bx;
      for (int64_t tile = bx; tile < tiles; tile += plan.grid.x) {
        for (unsigned int t = 0; t < kThreads; ++t) {
          const auto [p, d0] = geo::tile_piece(tile, plan.chunks, kThreads, t, plan.V);
          if (d0 >= c.width) continue;
          if (c.table_encoding) table.read((p + 3) * c.width + d0, plan.V, thread_id(block, t), false);
          for (int64_t l = lead_begin; l < lead_end; ++l) {
            const int64_t n = geo::additive_row(l, p, c.positions);
            if (c.input == AdditiveCase::kRows) in.read(n * c.width + d0, plan.V, thread_id(block, t));
            if (c.input == AdditiveCase::kTable) {
              in.read((n % kVocab) * c.width + d0, plan.V, thread_id(block, t), false);
            }
            out.write(n * c.width + d0, plan.V, thread_id(block, t));
          }
        }
      }
    }
  }
  out.expect_written_once(view_elements({rows * c.width}, {1}));
  EXPECT_EQ(out.failures() + in.failures() + table.failures(), 0);
}

TEST(CudaGeometry, AdditiveEveryElementOnceAlignedInBounds) {
  using C = AdditiveCase;
  const std::vector<AdditiveCase> cases = {
      // test_cuda.py: sinusoidal [3,7] and [9] positions (64 channels); add_sinusoidal x [2,5,W], W = 64 and 65,
      // positions shared [5] or per row [2,5]; embed_sinusoidal tokens [2,5] of a [30,W] table; learned [4,5] rows
      // of a [40,W] table, W = 64 and 63; add_learned x [3,6,W]; an unaligned x (x[..., :W-1] made contiguous: fresh)
      {"sinusoidal [3,7]", 1, 21, 64, C::kNone, 0, false, 0, true},
      {"sinusoidal [9]", 1, 9, 64, C::kNone},
      {"add_sinusoidal shared W=64", 2, 5, 64, C::kRows, 0, false, 0, true},
      {"add_sinusoidal shared W=65", 2, 5, 65, C::kRows, 0, false, 0, false},
      {"add_sinusoidal per row W=64", 1, 10, 64, C::kRows},
      {"add_sinusoidal per row W=65", 1, 10, 65, C::kRows},
      {"embed_sinusoidal W=64", 1, 10, 64, C::kTable},
      {"embed_sinusoidal W=65", 2, 5, 65, C::kTable},
      {"learned W=64", 1, 20, 64, C::kNone, 0, true},
      {"learned W=63", 1, 20, 63, C::kNone, 0, true, 0, false},
      {"add_learned shared W=64", 3, 6, 64, C::kRows, 0, true},
      {"add_learned per row W=63", 1, 18, 63, C::kRows, 0, true},
      {"embed_learned W=64", 3, 6, 64, C::kTable, 0, true},
      // registry samples
      {"sample add_sinusoidal [3,8,131]", 1, 24, 131, C::kRows},
      {"sample add_sinusoidal large [4,1024,256]", 1, 4096, 256, C::kRows, 0, false, 0, true},
      {"sample embed_sinusoidal [3,8] x 130", 3, 8, 130, C::kTable},
      {"sample learned [3,8] x 130", 1, 24, 130, C::kNone, 0, true},
      {"sample add_learned large [4,1024,256]", 4, 1024, 256, C::kRows, 0, true, 0, true},
      // edges
      {"one element", 1, 1, 1, C::kRows, 0, false, 0, false},
      {"empty", 0, 5, 64, C::kRows},
      {"unaligned x", 2, 5, 64, C::kRows, 1, false, 0, false},
      {"unaligned table", 2, 5, 64, C::kRows, 0, true, 1, false},
      {"decoding: 1 position, 64 leading indices split over gridDim.y", 64, 1, 4096, C::kRows, 0, false, 0, true},
      {"wide rows: several channel tiles", 3, 4, 5000, C::kRows, 0, false, 0, true},
      {"many positions", 2, 3000, 64, C::kRows, 0, true, 0, true},
  };
  for (const auto& c : cases) {
    for (const int64_t bytes : {2, 4, 8}) {
      for (const int64_t sms : {kH200, kOneSM}) check_additive(c, bytes, sms);
    }
  }
}

// ---------------------------------------------------------------------------------------------- rotary

// A view of the rotary kernel: [batch, seq, heads, head_dim] through its strides, input and output memory.
struct RopeView {
  int64_t heads;
  int64_t head_dim;
  std::array<int64_t, 4> in_stride;
  std::array<int64_t, 4> out_stride;
  Memory* in;
  Memory* out;
  const int64_t* slots = nullptr;  // rope_qk_cache_: token (b, s) stored at out row slots[b * seq + s]
  int64_t out_seq = 0;
};

int64_t output_token(const RopeView& v, int64_t seq, int64_t b, int64_t s) {
  posenc::RotaryView<float> view{};
  view.slots = v.slots;
  view.slot_batch_stride = seq;
  view.out_seq = v.out_seq;
  return posenc::portable::output_index(view, b, s);  // the kernel's own (portable/rotary.h)
}

// One launch of rotary_kernel: V, the grid, then every (block, thread, step) of it.
void run_rotary(std::vector<RopeView>& views, RopeView* copy, int64_t batch, int64_t seq, int64_t pairs,
                RopeLayout layout, bool scaled, int max_vector, int64_t sms, std::optional<bool> vectors) {
  const bool cache = copy != nullptr || (views.size() > 1 && views[1].slots != nullptr);
  bool vectorized = pairs % max_vector == 0;  // vector_width (rope.cu)
  auto all = views;
  if (copy != nullptr) all.push_back(*copy);
  for (const auto& v : all) {
    vectorized = vectorized && geo::rotary_vectorizable(v.head_dim, v.in->data(), v.in_stride.data(), v.out->data(),
                                                        v.out_stride.data(), max_vector);
  }
  const int V = vectorized ? max_vector : 1;
  if (vectors) {
    EXPECT_EQ(V, *vectors ? max_vector : 1);
  }
  const int64_t tokens = batch * seq;
  if (tokens == 0) return;  // launch_rotary launches nothing
  int64_t units_per_token = copy != nullptr ? geo::rotary_copy_token_units(copy->heads, copy->head_dim, V) : 0;
  for (const auto& v : views) units_per_token += geo::rotary_token_units(v.heads, v.head_dim, pairs, V);
  const auto grid = geo::rotary_grid(tokens, units_per_token, sms);
  expect_launchable(grid, "rotary_kernel");
  const RopeView& v0 = views[0];
  const RopeView& v1 = views.size() > 1 ? views[1] : views[0];
  const int num_views = static_cast<int>(views.size());
  const RopeView& copied = copy != nullptr ? *copy : views[0];
  const int64_t chunk_pairs = scaled ? geo::kChunkPairs / 2 : geo::kChunkPairs;
  const auto access = [&](const RopeView& v, int64_t b, int64_t s, int64_t out_s, int64_t h, int64_t channel,
                          int64_t thread) {
    const int64_t in = b * v.in_stride[0] + s * v.in_stride[1] + h * v.in_stride[2];
    const int64_t out = b * v.out_stride[0] + out_s * v.out_stride[1] + h * v.out_stride[2];
    if (V == 1) {
      v.in->read(in + channel * v.in_stride[3], 1, thread);
      v.out->write(out + channel * v.out_stride[3], 1, thread);
    } else {
      v.in->read(in + channel, V, thread);
      v.out->write(out + channel, V, thread);
    }
  };
  for (int64_t by = 0; by < grid.y; ++by) {
    for (int64_t bx = 0; bx < grid.x; ++bx) {
      const int64_t block = by * grid.x + bx;
      for (int64_t token = bx; token < tokens; token += grid.x) {
        const auto [b, s] = geo::split(token, seq);
        const int64_t s1 = cache ? output_token(v1, seq, b, s) : s;
        for (int64_t first_pair = 0; first_pair < pairs; first_pair += chunk_pairs) {
          const int64_t n = geo::piece_length(pairs, first_pair, chunk_pairs);
          const int64_t per_head = n / V;
          const int64_t units0 = v0.heads * per_head;
          const int64_t units = units0 + (num_views > 1 ? v1.heads * per_head : 0);
          for (unsigned int t = 0; t < kThreads; ++t) {
            for (int64_t u = geo::stride_first(by, kThreads, t); u < units; u += geo::stride_step(grid.y, kThreads)) {
              const auto [second, h, local] = geo::rotary_unit(u, units0, per_head, V);
              const int64_t row = local + (scaled && !second ? chunk_pairs : 0);
              if (local + V > n || row + V > geo::kChunkPairs) {
                ADD_FAILURE() << "coefficients " << row << " of a chunk of " << n << " pairs";
              }
              const auto& v = second ? v1 : v0;
              const int64_t out_s = second ? s1 : s;
              if (cache && out_s < 0) continue;
              const auto [lo, hi] = geo::pair_channels(layout, first_pair + local, pairs, V);
              access(v, b, s, out_s, h, lo, thread_id(block, t));
              access(v, b, s, out_s, h, hi, thread_id(block, t));
            }
          }
        }
        if (!cache && v0.in == v0.out) continue;
        const int64_t rest0 = v0.in == v0.out ? 0 : geo::copied_units(v0.head_dim, 2 * pairs, V);
        const int64_t rest1 = num_views > 1 && v1.in != v1.out ? geo::copied_units(v1.head_dim, 2 * pairs, V) : 0;
        const int64_t rest2 = cache && copy != nullptr ? geo::copied_units(copied.head_dim, 0, V) : 0;
        const int64_t s2 = cache && copy != nullptr ? output_token(copied, seq, b, s) : s;
        const int64_t units0 = v0.heads * rest0;
        const int64_t units1 = units0 + (num_views > 1 ? v1.heads * rest1 : 0);
        const int64_t units = units1 + copied.heads * rest2;
        for (unsigned int t = 0; t < kThreads; ++t) {
          for (int64_t u = geo::stride_first(by, kThreads, t); u < units; u += geo::stride_step(grid.y, kThreads)) {
            const auto [which, h, channel] = geo::rotary_copy_unit(u, units0, units1, rest0, rest1, rest2, pairs, V);
            const auto& v = which == 0 ? v0 : which == 1 ? v1 : copied;
            const int64_t out_s = which == 0 ? s : which == 1 ? s1 : s2;
            if (cache && out_s < 0) continue;
            access(v, b, s, out_s, h, channel, thread_id(block, t));
          }
        }
      }
    }
  }
}

// Where a [B, S, H, D] tensor of each format keeps its elements: its storage dimensions in order (0 = b, 1 = s,
// 2 = h, 3 = d), and the view: "contiguous", "transposed" (storage with its first two dimensions swapped),
// "channel_strided" (every other element of a 2D-channel storage) or "unaligned" (one element on).
struct RopeLayoutSpec {
  std::array<int64_t, 4> strides;  // of b, s, h, d
  int64_t storage;
  int64_t misalign;
};

RopeLayoutSpec rope_layout(const std::string& fmt, const std::string& view, int64_t B, int64_t S, int64_t H,
                           int64_t D) {
  std::vector<int> order = fmt == "bshd"   ? std::vector<int>{0, 1, 2, 3}
                           : fmt == "bhsd" ? std::vector<int>{0, 2, 1, 3}
                           : fmt == "sbhd" ? std::vector<int>{1, 0, 2, 3}
                                           : std::vector<int>{1, 2, 3};  // thd: B = 1
  if (view == "transposed" && fmt != "thd") std::swap(order[0], order[1]);
  const std::array<int64_t, 4> size{B, S, H, D};
  const int64_t channel_step = view == "channel_strided" ? 2 : 1;
  RopeLayoutSpec spec{{0, 0, 0, 0}, 1, view == "unaligned" ? 1 : 0};
  int64_t stride = channel_step;
  for (int i = static_cast<int>(order.size()) - 1; i >= 0; --i) {
    spec.strides[order[i]] = order[i] == 3 ? channel_step : stride;
    stride *= order[i] == 3 ? size[3] : size[order[i]];
  }
  spec.storage = stride;
  return spec;
}

std::vector<int64_t> rope_elements(const RopeLayoutSpec& spec, int64_t B, int64_t S, int64_t H, int64_t D,
                                   int64_t channels_from, int64_t channels_to) {
  std::vector<int64_t> out;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t d = channels_from; d < channels_to; ++d) {
          out.push_back(b * spec.strides[0] + s * spec.strides[1] + h * spec.strides[2] + d * spec.strides[3]);
        }
      }
    }
  }
  return out;
}

// One rope op on views (q, and k when k_heads > 0) of one format: functional (a fresh output in the format) or in
// place; every channel of the output written once (in place: the rotated ones), each by the thread that read it.
void check_rope(const std::string& name, const std::string& fmt, const std::string& view, int64_t B, int64_t S,
                int64_t q_heads, int64_t q_dim, int64_t k_heads, int64_t k_dim, int64_t pairs, RopeLayout layout,
                bool in_place, bool scaled, int64_t element_bytes, int64_t sms, std::optional<bool> vectors) {
  SCOPED_TRACE(shape_name("rope " + name + " " + fmt + " " + view + (in_place ? " in place" : ""), element_bytes,
                          sms));
  if (fmt == "thd") B = 1;
  const auto q_in = rope_layout(fmt, view, B, S, q_heads, q_dim);
  const auto q_out = in_place ? q_in : rope_layout(fmt, "contiguous", B, S, q_heads, q_dim);
  const auto k_in = rope_layout(fmt, view, B, S, k_heads, k_dim);
  const auto k_out = in_place ? k_in : rope_layout(fmt, "contiguous", B, S, k_heads, k_dim);
  Memory qi("q", q_in.storage, element_bytes, q_in.misalign);
  Memory qo("q out", q_out.storage, element_bytes);
  Memory ki("k", k_in.storage, element_bytes, k_in.misalign);
  Memory ko("k out", k_out.storage, element_bytes);
  std::vector<RopeView> views{{q_heads, q_dim, q_in.strides, q_out.strides, &qi, in_place ? &qi : &qo}};
  if (k_heads >= 0) views.push_back({k_heads, k_dim, k_in.strides, k_out.strides, &ki, in_place ? &ki : &ko});
  run_rotary(views, nullptr, B, S, pairs, layout, scaled, max_vec(element_bytes), sms, vectors);
  (in_place ? qi : qo)
      .expect_written_once(rope_elements(q_out, B, S, q_heads, q_dim, 0, in_place ? 2 * pairs : q_dim));
  if (in_place) qi.expect_read_by_writer();
  if (k_heads >= 0) {
    (in_place ? ki : ko)
        .expect_written_once(rope_elements(k_out, B, S, k_heads, k_dim, 0, in_place ? 2 * pairs : k_dim));
    if (in_place) ki.expect_read_by_writer();
  }
  EXPECT_EQ(qi.failures() + qo.failures() + ki.failures() + ko.failures(), 0);
}

TEST(CudaGeometry, RotaryEveryChannelOnceAlignedInBounds) {
  for (const int64_t bytes : {2, 4, 8}) {
    for (const int64_t sms : {kH200, kOneSM}) {
      // test_rope_forward_backward_and_in_place: x [2, 5, 3, 32] in every format and view, rotary_dim 32, 16, 12
      for (const std::string fmt : {"bshd", "bhsd", "sbhd", "thd"}) {
        for (const std::string view : {"contiguous", "transposed", "channel_strided", "unaligned"}) {
          for (const int64_t pairs : {16, 8, 6}) {
            for (const auto layout : {RopeLayout::Neox, RopeLayout::Gptj}) {
              for (const bool in_place : {false, true}) {
                const bool whole = pairs % max_vec(bytes) == 0;
                const bool vectors = whole && (view == "contiguous" || (view == "transposed"));
                check_rope("x [2,5,3,32]", fmt, view, 2, 5, 3, 32, -1, 0, pairs, layout, in_place, false, bytes, sms,
                           vectors);
              }
            }
          }
        }
      }
      // test_rope_qk_gqa_long_heads_and_decoding: GQA past one chunk of coefficients (600 pairs), copied channels of
      // k; decoding [8, 1, 32, 128] and [8, 1, 8, 128]; a query scale (chunks of 128 pairs)
      for (const bool scaled : {false, true}) {
        check_rope("rope_qk GQA 600 pairs", "bshd", "contiguous", 2, 3, 8, 1200, 2, 1232, 600, RopeLayout::Neox, false,
                   scaled, bytes, sms, true);
        check_rope("rope_qk decoding", "bshd", "contiguous", 8, 1, 32, 128, 8, 128, 64, RopeLayout::Gptj, false,
                   scaled, bytes, sms, true);
      }
      // registry samples: rope bhsd view of bshd data [2, 8, 3, 134], 65 pairs; rope_backward channel-strided sbhd;
      // rope_qk GQA [2, 16, 4|2, 64]; rope_ thd [16, 3, 134]; rope_cos_sin [2, 8, 3, 134]
      check_rope("sample rope", "bhsd", "transposed", 2, 8, 3, 134, -1, 0, 65, RopeLayout::Gptj, false, false, bytes,
                 sms, false);
      check_rope("sample rope_backward", "sbhd", "channel_strided", 2, 8, 3, 134, -1, 0, 65, RopeLayout::Neox, false,
                 false, bytes, sms, false);
      check_rope("sample rope_qk", "bshd", "contiguous", 2, 16, 4, 64, 2, 64, 32, RopeLayout::Neox, false, false, bytes,
                 sms, true);
      check_rope("sample rope_", "thd", "contiguous", 1, 16, 3, 134, -1, 0, 65, RopeLayout::Neox, true, false, bytes,
                 sms, false);
      check_rope("sample rope large", "bshd", "contiguous", 2, 512, 8, 128, 2, 128, 64, RopeLayout::Neox, false, true,
                 bytes, sms, true);
      // edges: one pair; a view with no heads; pairs that fill no whole vector (21); an unaligned base; many tokens
      check_rope("one pair", "bshd", "contiguous", 1, 1, 1, 2, -1, 0, 1, RopeLayout::Neox, false, false, bytes, sms,
                 false);
      check_rope("q with no heads", "bshd", "contiguous", 2, 5, 0, 32, 2, 32, 16, RopeLayout::Neox, false, false,
                 bytes, sms, std::nullopt);
      check_rope("tail", "bshd", "contiguous", 2, 3, 2, 44, -1, 0, 21, RopeLayout::Gptj, false, false, bytes, sms,
                 false);
      check_rope("unaligned", "bshd", "unaligned", 2, 3, 2, 64, 2, 64, 32, RopeLayout::Neox, true, false, bytes, sms,
                 false);
      check_rope("many tokens", "thd", "contiguous", 1, 5000, 2, 32, 1, 32, 16, RopeLayout::Gptj, false, false, bytes,
                 sms, true);
      check_rope("no tokens", "bshd", "contiguous", 2, 0, 2, 32, 1, 32, 16, RopeLayout::Neox, false, false, bytes, sms,
                 std::nullopt);
    }
  }
}

TEST(CudaGeometry, RotaryKvCacheStoresEachTokenAtItsSlot) {
  // rope_qk_cache_: q rotated in place, k rotated into its cache at each token's slot, v copied into its cache at
  // the same slots; a slot out of range (only under graph capture, unchecked) stores nothing. Registry sample:
  // q [2, 512, 8, 128], k and v [2, 512, 2, 128] into bhsd caches of 1024 slots; the small one: thd, partial rotary
  // (65 pairs of 134 channels), gptj, v of 67 channels as a channel-strided view.
  struct Case {
    std::string name;
    int64_t B, S, q_heads, kv_heads, D, v_dim, pairs, cache_seq;
    bool strided_v;
    RopeLayout layout;
  };
  const std::vector<Case> cases = {
      {"sample large", 2, 512, 8, 2, 128, 128, 64, 1024, false, RopeLayout::Neox},
      {"sample small", 1, 16, 4, 2, 134, 67, 65, 40, true, RopeLayout::Gptj},
      {"one token", 1, 1, 1, 1, 8, 8, 4, 1, false, RopeLayout::Neox},
  };
  for (const auto& c : cases) {
    for (const int64_t bytes : {2, 4, 8}) {
      for (const int64_t sms : {kH200, kOneSM}) {
        SCOPED_TRACE(shape_name("rope_qk_cache_ " + c.name, bytes, sms));
        std::vector<int64_t> slots(c.B * c.S);
        for (int64_t b = 0; b < c.B; ++b) {
          for (int64_t s = 0; s < c.S; ++s) slots[b * c.S + s] = (s * 7 + 3 * b) % c.cache_seq;  // distinct per row
        }
        if (c.S > 2) slots[1] = c.cache_seq + 5;  // out of range: not stored
        const std::array<int64_t, 4> q_strides{c.S * c.q_heads * c.D, c.q_heads * c.D, c.D, 1};
        const std::array<int64_t, 4> kv_strides{c.S * c.kv_heads * c.D, c.kv_heads * c.D, c.D, 1};
        const std::array<int64_t, 4> cache_strides{c.kv_heads * c.cache_seq * c.D, c.D, c.cache_seq * c.D, 1};
        const int64_t v_step = c.strided_v ? 2 : 1;
        const std::array<int64_t, 4> v_strides{c.S * c.kv_heads * c.v_dim * v_step, c.kv_heads * c.v_dim * v_step,
                                               c.v_dim * v_step, v_step};
        const std::array<int64_t, 4> v_cache_strides{c.kv_heads * c.cache_seq * c.v_dim, c.v_dim,
                                                     c.cache_seq * c.v_dim, 1};
        Memory q("q", c.B * q_strides[0], bytes);
        Memory k("k", c.B * kv_strides[0], bytes);
        Memory v("v", c.B * v_strides[0], bytes);
        Memory k_cache("k cache", c.B * cache_strides[0], bytes);
        Memory v_cache("v cache", c.B * v_cache_strides[0], bytes);
        std::vector<RopeView> views{{c.q_heads, c.D, q_strides, q_strides, &q, &q},
                                    {c.kv_heads, c.D, kv_strides, cache_strides, &k, &k_cache, slots.data(),
                                     c.cache_seq}};
        RopeView copy{c.kv_heads, c.v_dim, v_strides, v_cache_strides, &v, &v_cache, slots.data(), c.cache_seq};
        run_rotary(views, &copy, c.B, c.S, c.pairs, c.layout, false, max_vec(bytes), sms, std::nullopt);
        std::vector<int64_t> k_stored, v_stored;
        for (int64_t b = 0; b < c.B; ++b) {
          for (int64_t s = 0; s < c.S; ++s) {
            const int64_t slot = slots[b * c.S + s];
            if (slot < 0 || slot >= c.cache_seq) continue;
            for (int64_t h = 0; h < c.kv_heads; ++h) {
              for (int64_t d = 0; d < c.D; ++d) {
                k_stored.push_back(b * cache_strides[0] + slot * cache_strides[1] + h * cache_strides[2] + d);
              }
              for (int64_t d = 0; d < c.v_dim; ++d) {
                v_stored.push_back(b * v_cache_strides[0] + slot * v_cache_strides[1] + h * v_cache_strides[2] + d);
              }
            }
          }
        }
        q.expect_written_once(rope_elements({{q_strides[0], q_strides[1], q_strides[2], 1}, 0, 0}, c.B, c.S,
                                            c.q_heads, c.D, 0, 2 * c.pairs));
        q.expect_read_by_writer();
        k_cache.expect_written_once(k_stored);
        v_cache.expect_written_once(v_stored);
        EXPECT_EQ(q.failures() + k.failures() + v.failures() + k_cache.failures() + v_cache.failures(), 0);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- qk_norm_rope

// A view of qk_norm_rope: [B, S, H, D] contiguous (bshd), norm groups of `group` channels (D: per head; H * D:
// all heads of a token).
struct NormView {
  int64_t heads;
  int64_t head_dim;
  int64_t group;
};

// Every (block, thread, step) of norm_rope_kernel (and fold_chunks_kernel), forward or backward: each output element
// written once, in place by the thread that read it; the sums of squares of every (token, group) taken once by a team
// whose lane l adds channels l, l + 16, ... (lane_dot's); and (backward) the order in which each weight channel's
// chunk partials take tokens and heads, and the chunks' fold.
struct NormOrder {
  // per view, chunk, weight channel: the (token, head) added, in order
  std::vector<std::vector<std::vector<std::vector<std::pair<int64_t, int64_t>>>>> partials;
  std::vector<std::vector<std::vector<int64_t>>> folds;  // per view, weight channel: the chunks added, in order
  int64_t chunk = 0;
};

NormOrder run_norm_rope(const std::vector<NormView>& views, int64_t batch, int64_t seq, int64_t pairs,
                        RopeLayout layout, bool backward, bool in_place, int64_t opmath_bytes, int64_t sms) {
  const int64_t tokens = batch * seq;
  NormOrder order;
  if (views.empty() || tokens == 0) return order;  // launch_norm_rope launches nothing
  int64_t max_groups = 1;
  for (const auto& v : views) max_groups = std::max(max_groups, v.heads * v.head_dim / v.group);
  const int64_t chunk = backward ? posenc::portable::norm_tokens_per_chunk(tokens) : 1;
  const auto plan = geo::norm_rope_launch(tokens, chunk, max_groups, static_cast<int64_t>(views.size()), pairs,
                                          opmath_bytes, backward, sms);
  expect_launchable(plan.grid, "norm_rope_kernel");
  // The backward never splits a token's groups; nor does a launch with a global cos/sin row per block (the scratch
  // holds gridDim.x * gridDim.z rows).
  if (backward || !plan.in_shared) {
    EXPECT_EQ(plan.grid.y, 1);
  }
  order.chunk = chunk;
  for (size_t z = 0; z < views.size(); ++z) {
    const auto& v = views[z];
    SCOPED_TRACE("view " + std::to_string(z));
    const int64_t D = v.head_dim;
    const int64_t heads_per_group = v.group / D;
    const int64_t groups = v.heads * D / v.group;
    const int64_t row = v.heads * D;  // a token's channels
    Memory in("in", tokens * row, 4);
    Memory out_memory("out", tokens * row, 4);
    Memory& out = in_place ? in : out_memory;
    Memory weight("weight", v.group, 4);
    std::vector<int> summed(tokens * groups, 0);
    order.partials.emplace_back(plan.chunks, std::vector<std::vector<std::pair<int64_t, int64_t>>>(v.group));
    auto& partials = order.partials.back();
    std::vector<int64_t> partial_owner(plan.chunks * v.group, -1);
    for (int64_t by = 0; by < plan.grid.y; ++by) {
      for (int64_t bx = 0; bx < plan.grid.x; ++bx) {
        const int64_t block = (static_cast<int64_t>(z) * plan.grid.y + by) * plan.grid.x + bx;
        for (int64_t c = bx; c < plan.chunks; c += plan.grid.x) {
          const auto [first, end] = geo::chunk_tokens(c, chunk, tokens);
          for (int64_t token = first; token < end; ++token) {
            const auto [b, s] = geo::split(token, seq);
            const int64_t at = (b * seq + s) * row;
            const auto [begin, stop] = geo::block_share(groups, plan.grid.y, by);
            for (int64_t g0 = begin; g0 < stop; g0 += geo::kGroupBatch) {
              const int64_t count = geo::piece_length(stop, g0, geo::kGroupBatch);
              EXPECT_LE(count, geo::kGroupBatch);
              // The teams' sums of squares, before a barrier.
              for (unsigned int t = 0; t < kThreads; ++t) {
                const auto [lane, team, teams] = geo::norm_team(t, kThreads);
                for (int64_t base = 0; base < count; base += teams) {
                  const int64_t gi = base + team;
                  if (gi >= count) continue;
                  const int64_t first_head = (g0 + gi) * heads_per_group;
                  if (lane == 0) ++summed[token * groups + g0 + gi];
                  geo::GroupChannel ch(first_head, lane, D);
                  for (int64_t cc = lane; cc < v.group; cc += geo::kNormLanes, ch.advance(geo::kNormLanes, D)) {
                    if (ch.head != first_head + cc / D || ch.d != cc % D) {  // lane_dot's channel cc of the group
                      in.fail("lane " + std::to_string(lane) + " reads channel (" + std::to_string(ch.head) + ", " +
                              std::to_string(ch.d) + ") as the group's channel " + std::to_string(cc));
                    }
                    in.read(at + ch.head * D + ch.d, 1, thread_id(block, t), false);
                  }
                }
              }
              if (!backward) {  // a pair, or a channel past rotary_dim, of a head of the batch, per thread
                const int64_t per_head = D - pairs;
                const int64_t first_head = g0 * heads_per_group;
                const int64_t units = count * heads_per_group * per_head;
                for (unsigned int t = 0; t < kThreads; ++t) {
                  for (int64_t u = t; u < units; u += kThreads) {
                    const auto [hb, k, gi] = geo::norm_unit(u, per_head, heads_per_group);
                    EXPECT_EQ(gi, hb / heads_per_group);
                    const int64_t w0 = (hb - gi * heads_per_group) * D;
                    const int64_t head = (first_head + hb) * D;
                    std::vector<int64_t> channels;
                    if (k < pairs) {
                      const auto [a, zc] = geo::pair_channels(layout, k, pairs, 1);
                      channels = {a, zc};
                    } else {
                      channels = {pairs + k};
                    }
                    for (const int64_t d : channels) {
                      weight.read(w0 + d, 1, thread_id(block, t), false);
                      in.read(at + head + d, 1, thread_id(block, t));
                    }
                    for (const int64_t d : channels) out.write(at + head + d, 1, thread_id(block, t));
                  }
                }
              } else {  // a weight channel per thread: the token's groups in order, into the chunk's partial
                const bool fresh = token == first && g0 == begin;
                for (unsigned int t = 0; t < kThreads; ++t) {
                  for (int64_t j = t; j < v.group; j += kThreads) {
                    const auto [head_in_group, d] = geo::group_channel(j, D);
                    const bool rotated = d < 2 * pairs;
                    const auto pair_of = geo::channel_pair(layout, d, pairs);
                    const int64_t partner = rotated ? pair_of.partner : d;
                    auto& partial = partials[c][j];
                    int64_t& owner = partial_owner[c * v.group + j];
                    if (fresh) {
                      EXPECT_TRUE(partial.empty() && owner < 0) << "chunk " << c << " channel " << j << " restarted";
                      owner = thread_id(block, t);
                    }
                    EXPECT_EQ(owner, thread_id(block, t)) << "chunk " << c << " channel " << j << " shared";
                    for (int64_t gi = 0; gi < count; ++gi) {
                      const int64_t h = (g0 + gi) * heads_per_group + head_in_group;
                      partial.emplace_back(token, h);
                      in.read(at + h * D + d, 1, thread_id(block, t));
                      if (partner != d) in.read(at + h * D + partner, 1, thread_id(block, t), false);
                      out.write(at + h * D + d, 1, thread_id(block, t));
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
    for (int64_t n = 0; n < tokens * groups; ++n) {
      EXPECT_EQ(summed[n], 1) << "token, group " << n;
    }
    if (backward) {  // the fold reads every chunk's partial row: each written
      for (int64_t e = 0; e < plan.chunks * v.group; ++e) {
        EXPECT_GE(partial_owner[e], 0) << "partial " << e;
      }
    }
    out.expect_written_once(view_elements({tokens * row}, {1}));
    if (in_place) in.expect_read_by_writer();
    EXPECT_EQ(in.failures() + out_memory.failures() + weight.failures(), 0);
    if (backward) {  // fold_chunks_kernel: a thread per weight channel, the chunks in order
      order.folds.emplace_back(v.group);
      const int64_t blocks = geo::grid_size(v.group, kThreads, sms);
      for (int64_t block = 0; block < blocks; ++block) {
        for (unsigned int t = 0; t < kThreads; ++t) {
          for (int64_t j = geo::stride_first(block, kThreads, t); j < v.group;
               j += geo::stride_step(blocks, kThreads)) {
            for (int64_t c = 0; c < plan.chunks; ++c) order.folds.back()[j].push_back(c);
          }
        }
      }
    }
  }
  return order;
}

// The CPU's order (cpu/kernels/rope.cpp): chunks of norm_tokens_per_chunk tokens, each token's heads in order adding
// gz * xhat into their weight channels (per head: every head into channel d; over all heads: head h into h * D + d),
// then each channel's chunks added in chunk order.
NormOrder cpu_norm_order(const std::vector<NormView>& views, int64_t tokens) {
  NormOrder order;
  const int64_t chunk = posenc::portable::norm_tokens_per_chunk(tokens);
  const int64_t chunks = (tokens + chunk - 1) / chunk;
  order.chunk = chunk;
  for (const auto& v : views) {
    const bool per_head = v.group == v.head_dim;
    order.partials.emplace_back(chunks, std::vector<std::vector<std::pair<int64_t, int64_t>>>(v.group));
    for (int64_t n = 0; n < tokens; ++n) {
      for (int64_t h = 0; h < v.heads; ++h) {
        for (int64_t d = 0; d < v.head_dim; ++d) {
          order.partials.back()[n / chunk][(per_head ? 0 : h * v.head_dim) + d].emplace_back(n, h);
        }
      }
    }
    order.folds.emplace_back(v.group);
    for (int64_t j = 0; j < v.group; ++j) {
      for (int64_t c = 0; c < chunks; ++c) order.folds.back()[j].push_back(c);
    }
  }
  return order;
}

TEST(CudaGeometry, QkNormRopeEveryElementOnceInTheCpuOrder) {
  struct Case {
    std::string name;
    int64_t batch, seq;
    std::vector<NormView> views;
    int64_t pairs;
    RopeLayout layout;
  };
  const std::vector<Case> cases = {
      // test_cuda.py: 80 heads (more than a batch of 64 groups), head_dim 8 over all heads (a lane steps over heads),
      // 5000 pairs (cos/sin past 32 KiB: a global row per block), decoding [8, 1, 32 | 8, 128]; 20012 tokens (chunks of
      // 20, the last of 12)
      {"80 heads", 2, 3, {{80, 64, 64}, {8, 64, 64}}, 32, RopeLayout::Neox},
      {"head_dim 8 over all heads", 2, 5, {{6, 8, 8}, {3, 8, 24}}, 4, RopeLayout::Gptj},
      {"5000 pairs", 1, 2, {{2, 10000, 10000}, {1, 10008, 10008}}, 5000, RopeLayout::Neox},
      {"decoding", 8, 1, {{32, 128, 128}, {8, 128, 1024}}, 64, RopeLayout::Neox},
      {"20012 tokens", 4, 5003, {{4, 32, 32}, {1, 32, 32}}, 16, RopeLayout::Neox},
      // registry samples: OLMo 2 over all heads [2, 8, 4 | 2, 134], 65 pairs; gemma thd [16, 4 | 2, 134]
      {"sample olmo2", 2, 8, {{4, 134, 4 * 134}, {2, 134, 2 * 134}}, 65, RopeLayout::Gptj},
      {"sample gemma thd", 1, 16, {{4, 134, 134}, {2, 134, 2 * 134}}, 65, RopeLayout::Neox},
      // edges: one token, one pair; one view (an empty q or k is dropped before the launch)
      {"one token", 1, 1, {{1, 2, 2}}, 1, RopeLayout::Neox},
      {"one view", 2, 5, {{2, 32, 32}}, 16, RopeLayout::Gptj},
  };
  for (const auto& c : cases) {
    for (const int64_t sms : {kH200, kOneSM}) {
      for (const int64_t opmath_bytes : {4, 8}) {
        SCOPED_TRACE(shape_name("qk_norm_rope " + c.name, opmath_bytes, sms));
        for (const bool in_place : {false, true}) {
          run_norm_rope(c.views, c.batch, c.seq, c.pairs, c.layout, false, in_place, opmath_bytes, sms);
        }
        const auto gpu = run_norm_rope(c.views, c.batch, c.seq, c.pairs, c.layout, true, false, opmath_bytes, sms);
        const auto cpu = cpu_norm_order(c.views, c.batch * c.seq);
        EXPECT_EQ(gpu.chunk, cpu.chunk);
        EXPECT_TRUE(gpu.partials == cpu.partials) << "the weight gradients' chunk partials take other terms";
        EXPECT_TRUE(gpu.folds == cpu.folds) << "the chunks are folded in another order";
      }
    }
  }
}

// The channels of a rotated pair (rotate_unit, norm_rope's units) and a channel's pair and partner (norm_rope's
// backward, rotated_channel) agree: for V = 1, pair i is channels (lo, hi), lo its first; and each V-pair unit of
// pairs [i, i + V) covers the channels of exactly those pairs.
TEST(CudaGeometry, PairChannelsAndChannelPairsAgree) {
  for (const auto layout : {RopeLayout::Neox, RopeLayout::Gptj}) {
    for (int64_t pairs = 1; pairs <= 40; ++pairs) {
      std::vector<int> seen(2 * pairs, 0);
      for (int64_t i = 0; i < pairs; ++i) {
        const auto [lo, hi] = geo::pair_channels(layout, i, pairs, 1);
        ++seen.at(lo);
        ++seen.at(hi);
        const auto a = geo::channel_pair(layout, lo, pairs);
        const auto z = geo::channel_pair(layout, hi, pairs);
        EXPECT_TRUE(a.first && !z.first && a.pair == i && z.pair == i && a.partner == hi && z.partner == lo)
            << "pair " << i << " of " << pairs;
      }
      for (const int count : seen) {
        EXPECT_EQ(count, 1);
      }
      for (const int V : {2, 4, 8}) {
        if (pairs % V != 0) continue;
        for (int64_t i = 0; i < pairs; i += V) {
          const auto [lo, hi] = geo::pair_channels(layout, i, pairs, V);
          std::vector<int64_t> unit, expected;
          for (int k = 0; k < V; ++k) unit.insert(unit.end(), {lo + k, hi + k});
          for (int64_t j = i; j < i + V; ++j) {
            const auto [a, z] = geo::pair_channels(layout, j, pairs, 1);
            expected.insert(expected.end(), {a, z});
          }
          std::sort(unit.begin(), unit.end());
          std::sort(expected.begin(), expected.end());
          EXPECT_EQ(unit, expected) << "pairs [" << i << ", " << i + V << ") of " << pairs;
        }
      }
    }
  }
}

// A team's sum of squares replayed: lane l adds channels l, l + 16, ... of the group through GroupChannel, then the
// lanes fold as __shfl_down_sync within 16 lanes does (lane j += lane j + w for w = 8, 4, 2, 1, all lanes at once;
// a lane past the 16 keeps its value): the bits of portable::lane_dot, the CPU's.
TEST(CudaGeometry, QkNormTeamSumsAreLaneDot) {
  for (const auto& [heads, head_dim, group] : std::vector<std::array<int64_t, 3>>{
           {4, 134, 134}, {4, 134, 536}, {6, 8, 48}, {3, 8, 8}, {2, 1000, 2000}, {1, 5, 5}, {80, 64, 64}}) {
    SCOPED_TRACE("heads " + std::to_string(heads) + ", head_dim " + std::to_string(head_dim) + ", group " +
                 std::to_string(group));
    const auto x = spread_values({heads * head_dim}, at::kFloat, 40 + group);
    const float* data = x.const_data_ptr<float>();
    for (int64_t g = 0; g < heads * head_dim / group; ++g) {
      const int64_t first_head = g * (group / head_dim);
      float lanes[geo::kNormLanes];
      for (int lane = 0; lane < geo::kNormLanes; ++lane) {
        float sum = 0;
        geo::GroupChannel at(first_head, lane, head_dim);
        for (int64_t c = lane; c < group; c += geo::kNormLanes, at.advance(geo::kNormLanes, head_dim)) {
          const float v = data[at.head * head_dim + at.d];
          sum += v * v;
        }
        lanes[lane] = sum;
      }
      for (int w = geo::kNormLanes / 2; w > 0; w /= 2) {
        float next[geo::kNormLanes];
        for (int j = 0; j < geo::kNormLanes; ++j) {
          next[j] = lanes[j] + (j + w < geo::kNormLanes ? lanes[j + w] : lanes[j]);
        }
        std::copy(next, next + geo::kNormLanes, lanes);
      }
      const float* row = data + g * group;
      const float cpu = posenc::portable::lane_dot(row, row, group);
      EXPECT_EQ(lanes[0], cpu) << "group " << g;
    }
  }
}

}  // namespace
