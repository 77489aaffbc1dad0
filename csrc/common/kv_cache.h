#pragma once
// Decoding through a KV cache (rope_qk_cache_): the checks shared by the CPU, CUDA and Meta kernels (metadata only,
// SymInt-aware), the host check of the slots the tokens are written to, and the op layer, one template over the
// device. q and k are rotated by the rotary family's own path (common/rope.h): k's output is its cache, read through
// the cache's strides at each token's slot, and v is copied into its cache in the same pass.
#include "common/positions.h"
#include "common/rope.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace posenc {

inline RopeFormat parse_cache_format(const char* op, std::string_view cache_format) {
  if (cache_format == "bhsd") return RopeFormat::BHSD;
  if (cache_format == "bshd") return RopeFormat::BSHD;
  if (cache_format == "shd") return RopeFormat::THD;  // one pool of slots, no batch: read as thd is
  TORCH_CHECK(false, "posenc.", op, ": cache_format must be \"bhsd\", \"bshd\" or \"shd\", got \"", cache_format,
              "\"");
}

// v has k's batch, sequence and heads (its head_dim may differ); each cache has the dtype, device, heads and head_dim
// of the tensor it receives and, unless it is one pool ("shd"), its batch; both caches have S_max slots. The slots
// come from cache_positions ([S] for every batch row or [B, S]; [T] for thd), else from the rotary positions, which
// must then be one per token (no pair_axis). Returns the caches' format.
inline RopeFormat check_kv_cache(const char* op, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const std::optional<at::Tensor>& cache_positions,
                                 std::string_view cache_format,
                                 RopeFormat format, const std::optional<at::Tensor>& pair_axis) {
  const auto cache = parse_cache_format(op, cache_format);
  check_floating(op, "v", v);
  check_same_device(op, "v", v, k);
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "posenc.", op, ": v is ", v.scalar_type(), " but k is ",
              k.scalar_type());
  TORCH_CHECK(v.dim() == k.dim(), "posenc.", op, ": v must be ", k.dim(), "-D as k is, got shape ", v.sym_sizes());
  const auto k_sizes = rope_sizes(k, format);
  const auto v_sizes = rope_sizes(v, format);
  TORCH_CHECK(v_sizes[0] == k_sizes[0] && v_sizes[1] == k_sizes[1] && v_sizes[2] == k_sizes[2], "posenc.", op,
              ": v has shape ", v.sym_sizes(), " but needs the batch, sequence and heads of k ", k.sym_sizes());
  const int64_t cache_dims = cache == RopeFormat::THD ? 3 : 4;
  for (const auto& [name, c, t, t_name, t_sizes] :
       {std::make_tuple("k_cache", &k_cache, &k, "k", &k_sizes), std::make_tuple("v_cache", &v_cache, &v, "v", &v_sizes)}) {
    check_same_device(op, name, *c, k);
    TORCH_CHECK(c->scalar_type() == t->scalar_type(), "posenc.", op, ": ", name, " is ", c->scalar_type(), " but ",
                t_name, " is ", t->scalar_type());
    TORCH_CHECK(c->dim() == cache_dims, "posenc.", op, ": ", name, " must be ", cache_dims, "-D for cache_format \"",
                cache_format, "\", got shape ", c->sym_sizes());
    const auto sizes = rope_sizes(*c, cache);
    TORCH_CHECK(sizes[2] == (*t_sizes)[2] && sizes[3] == (*t_sizes)[3] &&
                    (cache == RopeFormat::THD || sizes[0] == (*t_sizes)[0]),
                "posenc.", op, ": ", name, " has shape ", c->sym_sizes(), " in cache_format \"", cache_format,
                "\", whose ", cache == RopeFormat::THD ? "" : "batch, ", "heads or head_dim differ from those of ",
                t_name, " ", t->sym_sizes());
  }
  TORCH_CHECK(rope_sizes(k_cache, cache)[1] == rope_sizes(v_cache, cache)[1], "posenc.", op, ": k_cache has shape ",
              k_cache.sym_sizes(), " but v_cache has shape ", v_cache.sym_sizes(), ": their slots differ");
  if (cache_positions) {
    check_index(op, "cache_positions", *cache_positions);
    check_same_device(op, "cache_positions", *cache_positions, k);
    const bool per_token = cache_positions->dim() == 2 && format != RopeFormat::THD &&
                           cache_positions->sym_size(0) == k_sizes[0] && cache_positions->sym_size(1) == k_sizes[1];
    const bool shared = cache_positions->dim() == 1 && cache_positions->sym_size(0) == k_sizes[1];
    TORCH_CHECK(per_token || shared, "posenc.", op, ": cache_positions has shape ", cache_positions->sym_sizes(),
                " but needs ", format == RopeFormat::THD ? "[T]" : "[S] or [B, S]", " for k of shape ", k.sym_sizes());
    return cache;
  }
  TORCH_CHECK(!pair_axis, "posenc.", op,
              ": with pair_axis a token has several positions; pass cache_positions to place it in the cache");
  return cache;
}

struct KvCacheArgs {
  RopeQkArgs rotation;
  RopeFormat cache_format;
};

// Every metadata check of rope_qk_cache_: rope_qk's, its query scale's and the caches'.
inline KvCacheArgs check_rope_qk_cache(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const std::optional<at::Tensor>& positions, const at::Tensor& inv_freq,
                                       const std::optional<at::Tensor>& cache_positions,
                                       std::string_view cache_format, std::string_view layout,
                                       std::string_view format, const std::optional<at::Tensor>& cu_seqlens,
                                       const std::optional<at::Tensor>& pair_axis, double q_scale_beta,
                                       int64_t q_scale_length, int64_t q_scale_shift) {
  const auto rotation = check_rope_qk(op, {{"q", &q}, {"k", &k}}, positions, inv_freq, layout, format, cu_seqlens,
                                      pair_axis, q_scale_beta, q_scale_length, q_scale_shift);
  const auto cache = check_kv_cache(op, k, v, k_cache, v_cache, cache_positions, cache_format, rotation.rope.format,
                                    pair_axis);
  TORCH_CHECK(cache_positions || !positions || !at::isFloatingType(positions->scalar_type()), "posenc.", op,
              ": positions are ", positions->scalar_type(),
              " coordinates, not cache slots; pass cache_positions to place the tokens in the cache");
  return {rotation, cache};
}


// The slots of caches of cache_seq (S_max) slots, as a domain of positions.
inline PositionDomain slot_domain(int64_t cache_seq) {
  return {0, cache_seq - 1, false, nullptr, true};
}

[[noreturn]] inline void cache_position_error(const char* op, int64_t n, int64_t value, int64_t cache_seq) {
  TORCH_CHECK(false, "posenc.", op, ": cache_positions holds ", value, " at flat index ", n, ", outside ",
              slot_domain(cache_seq).description());
}

// Tokens first < second (flat indices [batch * seq]) of one row, the two first in order, both at `slot`.
[[noreturn]] inline void repeated_slot_error(const char* op, int64_t first, int64_t second, int64_t slot, bool pooled) {
  TORCH_CHECK(false, "posenc.", op, ": tokens ", first, " and ", second, " (flat indices [batch * seq]) both go to slot ",
              slot, pooled ? " of the pooled caches" : " of their batch row's caches",
              "; each slot takes one token per call");
}

// The slot of every token of a cache write (the Rotation's outputs[1] is k's cache), on the host: [seq] shared by
// the batch rows, or [batch * seq]. Each lies in [0, S_max), and no two tokens of one cache row (a batch row, or
// every token for a pool) share one: the CPU's checks (cuda/rope.cu runs the same checks on the device).
struct CacheSlots {
  std::vector<int64_t> values;
  bool shared;
};

inline CacheSlots read_cache_slots(const Rotation& r, const std::optional<at::Tensor>& cache_positions,
                                   const std::optional<at::Tensor>& positions,
                                   const std::optional<at::Tensor>& cu_seqlens) {
  const char* op = r.op;
  const int64_t batch = r.batch;
  const int64_t seq = r.seq;
  const int64_t cache_seq = rope_sizes(r.outputs[1], r.cache->format)[1].expect_int();
  const bool pooled = r.cache->format == RopeFormat::THD;
  CacheSlots slots;
  if (cache_positions) {
    const auto values = cache_positions->to(at::kLong).contiguous();
    slots.values.assign(values.const_data_ptr<int64_t>(), values.const_data_ptr<int64_t>() + values.numel());
    slots.shared = cache_positions->dim() == 1;
    for (size_t n = 0; n < slots.values.size(); ++n) {
      if (slots.values[n] < 0 || slots.values[n] >= cache_seq) cache_position_error(op, n, slots.values[n], cache_seq);
    }
  } else {
    slots.shared = r.args.shared_positions;
    const int64_t count = slots.shared ? seq : batch * seq;
    slots.values = read_positions<int64_t>(op, positions, count, r.offset, slot_domain(cache_seq), cu_seqlens);
  }
  // Each row's (slot, token) pairs sorted: a repeated slot is a neighbour (no buffer of S_max entries per call).
  const int64_t rows = pooled || slots.shared ? 1 : batch;
  const int64_t per_row = pooled ? batch * seq : seq;
  std::vector<std::pair<int64_t, int64_t>> row(per_row);
  for (int64_t r = 0; r < rows && per_row > 1; ++r) {
    for (int64_t i = 0; i < per_row; ++i) {
      const int64_t n = r * per_row + i;
      row[i] = {slots.values[slots.shared ? n % seq : n], n};
    }
    std::sort(row.begin(), row.end());
    for (int64_t i = 1; i < per_row; ++i) {
      if (row[i].first == row[i - 1].first) repeated_slot_error(op, row[i - 1].second, row[i].second, row[i].first, pooled);
    }
  }
  return slots;
}

// The view of a tensor of a cache write written into its cache: read through the Rotation's format, stored through
// the cache's at the slots (on the kernel's device).
template <typename scalar_t>
RotaryView<scalar_t> cache_view(const Rotation& r, const at::Tensor& in, const at::Tensor& cache, const int64_t* slots,
                                bool shared_slots) {
  auto view = rotary_view<scalar_t>(in, cache, r.args.format, r.cache->format);
  view.slots = slots;
  view.slot_batch_stride = shared_slots ? 0 : r.seq;
  view.out_seq = cache.size(rope_dim_order(r.cache->format)[1]);
  return view;
}

template <typename Device>
struct KvCacheOps {
  static void rope_qk_cache_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const std::optional<at::Tensor>& positions,
                             const at::Tensor& inv_freq, const std::optional<at::Tensor>& cache_positions,
                             c10::string_view cache_format, double attention_scale, c10::string_view layout,
                             c10::string_view format, int64_t offset, const std::optional<at::Tensor>& cu_seqlens,
                             const std::optional<at::Tensor>& pair_axis, double q_scale_beta, int64_t q_scale_length,
                             int64_t q_scale_shift) {
    constexpr const char* op = "rope_qk_cache_";
    const auto args = check_rope_qk_cache(op, q, k, v, k_cache, v_cache, positions, inv_freq, cache_positions,
                                          cache_format, layout, format, cu_seqlens, pair_axis, q_scale_beta,
                                          q_scale_length, q_scale_shift);
    constexpr const char* advice = "give the caches and q memory of their own";
    check_no_internal_overlap(op, "q", q, "rotate a copy with posenc.rope_qk");
    check_no_internal_overlap(op, "k_cache", k_cache, advice);
    check_no_internal_overlap(op, "v_cache", v_cache, advice);
    // Written tensors share no element with each other or with what the call reads (q, k and v may be slices of one
    // projection along the heads).
    const int64_t heads = rope_dim_order(args.rotation.rope.format)[2];
    const int64_t cache_heads = rope_dim_order(args.cache_format)[2];
    check_no_shared_elements(op, "q", q, "k", k, heads, advice);
    check_no_shared_elements(op, "q", q, "v", v, heads, advice);
    check_no_shared_elements(op, "k_cache", k_cache, "v_cache", v_cache, cache_heads, advice);
    for (const auto& [name, t] : {std::make_pair("q", &q), std::make_pair("k", &k), std::make_pair("v", &v)}) {
      check_no_shared_elements(op, "k_cache", k_cache, name, *t, -1, advice);
      check_no_shared_elements(op, "v_cache", v_cache, name, *t, -1, advice);
    }
    const CacheWrite write{v, v_cache, args.cache_format, cache_positions};
    RopeOps<Device>::rotate(op, {q, k}, {q, k_cache}, args.rotation.rope, positions, inv_freq, attention_scale,
                            offset, cu_seqlens, pair_axis, false, nullptr, args.rotation.q_scale, &write);
  }

  static void register_kernels(torch::Library& m) { POSENC_KV_CACHE_OPS(POSENC_IMPL_MEMBER, KvCacheOps) }
};

}  // namespace posenc
