// The rotary family on the CPU: how positions are read and the kernels called under the op layer of
// common/rope.h; the loops are in cpu/kernels/rope.cpp.
#include "common/kv_cache.h"
#include "common/positions.h"
#include "common/qk_norm.h"
#include "common/rope.h"
#include "cpu/device.h"
#include "cpu/encoding_tables.h"
#include "cpu/kernels/rope.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>
#include <vector>

namespace posenc {
namespace {

// A norm as the kernels read it; the backward's input is read through its own strides.
template <typename scalar_t, typename opmath = opmath_t<scalar_t>>
RmsNormView<scalar_t, opmath> norm_view(const RotationNorm& norm, RopeFormat format) {
  RmsNormView<scalar_t, opmath> view{norm.weight.const_data_ptr<opmath>(), norm.group, static_cast<opmath>(norm.eps),
                                     norm.convention, nullptr, {}, nullptr};
  if (norm.input.defined()) {
    const auto order = rope_dim_order(format);
    view.input = norm.input.const_data_ptr<scalar_t>();
    for (int i = 0; i < 4; ++i) view.input_stride[i] = order[i] < 0 ? 0 : norm.input.stride(order[i]);
    view.weight_grad = norm.weight_grad.mutable_data_ptr<opmath>();
  }
  return view;
}

// view with its rows stored past the caches where the call's output allows (cpu::streams_output). In-process A/Bs,
// token by token: float32 M-RoPE q, k [1, 4096, 16, 128] 3.79 -> 2.32 ms and Llama-like q, k [4, 2048, 16, 128]
// 5.65 -> 4.92; bfloat16 rows were 7-12% slower, but for those the kernels round by AVX-512 BF16 and store as whole
// lines from registers (rotate_heads_bf16, and QK-norm's forward and backward). Those rows, ordinary stores ->
// streamed, in separate processes: Llama-like 3.97-4.98 -> 2.42-3.40 ms, M-RoPE 1.41-1.72 -> 1.16-1.43. fp16 rows
// likewise, rounded by F16C in the AVX2 and AVX-512 builds (rotate_half_row_by_instruction; in-process A/B, AVX-512,
// Llama-like q, k [4, 2048, 16|8, 128]: neox 1.46x, gptj 1.33x, fwd+bwd 1.39x on 2 threads; 1.42-1.49x on one).
// lines: the kernel is rope_kernel's (the rotations and QK-norm), which stores bf16 and fp16 rows as whole lines
// where it rounds them in registers (other bf16 and fp16 rows ignore the flag); bf16 rows stream where AVX-512 BF16
// rounds them, or where the baseline and AVX2 builds round them in registers (rotary.h's rotate_bf16_vectors; AVX2
// 1.11x on 2 threads, 1.19-1.21x on one); fp16 rows as whole lines from registers (AVX2, AVX-512), else through a
// row in L1 (rotary.h's rotate_unit_row). Inputs of that size are read a token ahead (read_ahead: rotary.h's
// prefetch_next_token).
template <typename scalar_t>
RotaryView<scalar_t> streamed(RotaryView<scalar_t> view, int64_t bytes_read, int64_t bytes_written,
                              bool lines = false) {
  view.read_ahead = cpu::past_caches(bytes_read);
  view.stream = cpu::streams_output<scalar_t>(bytes_written);
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
    // the kernels keep ordinary stores for the rows they do not round in registers (rotate_tokens)
    view.stream = lines && cpu::past_caches(bytes_written);
  }
  return view;
}

struct CpuRope : CpuDevice {

  // Positions of every batch row whose rows are all the same (Hugging Face's position_ids [B, S] of a batch without
  // padding): the kernels take them as shared by the batch, one table of coefficients for every row rather than a
  // row formed per token, the same values. A/B, rope_qk q, k [4, 2048, 16|8, 128] bf16, 2 threads, Zen 2 (AVX2):
  // 3.47-3.52 -> 3.20-3.26 ms, as with positions [S].
  static bool rows_repeat(const AxisPositions& pos, int64_t batch, int64_t seq) {
    const auto row = seq * pos.n_axes;
    const double* values = pos.values.data();
    if (batch < 2 || values == nullptr || static_cast<int64_t>(pos.values.values.size()) != batch * row) return false;
    for (int64_t b = 1; b < batch; ++b) {
      if (std::memcmp(values, values + b * row, row * sizeof(double)) != 0) return false;
    }
    return true;
  }

  static void rotate(const Rotation& r) {
    check_cu_seqlens_values(r.op, r.cu_seqlens, r.seq);
    const auto pos = read_axis_positions(r.op, r.positions, r.seq, r.offset, rotary_domain(), r.pair_axis,
                                         r.cu_seqlens);
    // rope_qk_cache_'s slots, read and checked before any token is stored.
    const auto slots = r.cache != nullptr ? read_cache_slots(r, r.cache->cache_positions, r.positions, r.cu_seqlens)
                                          : CacheSlots{};
    bool empty = true;
    for (const auto& t : r.inputs) empty = empty && t.numel() == 0;
    if (empty) return;
    const Frequencies freq(r.inv_freq);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.inputs[0].scalar_type(), "posenc_rope", [&] {
      using opmath = opmath_t<scalar_t>;
      std::vector<RotaryView<scalar_t>> views;
      std::vector<RmsNormView<scalar_t, opmath>> norms;
      int64_t scaled_view = -1;
      for (size_t i = 0; i < r.inputs.size(); ++i) {
        if (r.inputs[i].numel() == 0) continue;
        if (i == 0 && r.q_scale.beta != 0.0) scaled_view = static_cast<int64_t>(views.size());
        views.push_back(r.cache != nullptr && i == 1
                            ? cache_view<scalar_t>(r, r.inputs[i], r.outputs[i], slots.values.data(), slots.shared)
                            : rotary_view<scalar_t>(r.inputs[i], r.outputs[i], r.args.format));
        if (r.norms != nullptr) norms.push_back(norm_view<scalar_t>((*r.norms)[i], r.args.format));
      }
      int64_t read = 0, written = 0;  // written: out of place
      for (size_t i = 0; i < r.inputs.size(); ++i) {
        read += r.inputs[i].nbytes();
        if (!r.outputs[i].is_same(r.inputs[i])) written += r.inputs[i].nbytes();
      }
      for (auto& view : views) view = streamed(view, read, written, true);
      // the sin and cos of whole-number positions read from a kept table (the same bits as computing them)
      const at::Tensor kept = cpu::kept_rotation_table(c10::CppTypeToScalarType<opmath>::value, freq, pos);
      const bool copies = r.cache != nullptr && r.cache->v.numel() != 0;
      const auto v_view = copies ? cache_view<scalar_t>(r, r.cache->v, r.cache->v_cache, slots.values.data(), slots.shared)
                                 : RotaryView<scalar_t>{};
      cpu::rope_stub<scalar_t>({views.data(), static_cast<int64_t>(views.size()), r.batch, r.seq, pos.values.data(),
                                pos.values.first, r.args.shared_positions || rows_repeat(pos, r.batch, r.seq),
                                pos.n_axes, pos.axes(),
                                freq.data(), freq.size(), freq.max_abs(), r.attention_scale, r.inverse,
                                r.args.layout, r.norms != nullptr ? norms.data() : nullptr, r.q_scale,
                                scaled_view, copies ? &v_view : nullptr,
                                kept.defined() ? kept.const_data_ptr<opmath>() : nullptr});
    });
  }

  template <typename scalar_t, typename opmath>
  static void rotate_by_tables(const RotaryView<scalar_t>& view, int64_t batch, int64_t seq, const at::Tensor& cos,
                               const at::Tensor& sin, const RopeArgs& args, bool transpose) {
    const int64_t read = batch * seq * view.heads * view.head_dim * sizeof(scalar_t);
    const int64_t written = view.in != view.out ? read : 0;
    cpu::rope_tables_stub<scalar_t, opmath>({streamed(view, read, written), batch, seq, cos.const_data_ptr<opmath>(),
                                             sin.const_data_ptr<opmath>(), args.shared_positions, cos.size(-1),
                                             args.layout, transpose});
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(posenc, CPU, m) {
  RopeOps<CpuRope>::register_kernels(m);
  QkNormOps<CpuRope>::register_kernels(m);
  KvCacheOps<CpuRope>::register_kernels(m);
}

}  // namespace posenc
