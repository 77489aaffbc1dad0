"""Benchmarks posenc's ops against the paths users run today, as ratios measured in the same run.

    python scripts/bench.py [--ops rope,sinusoidal,...] [--repeat 10] [--quick] [--reuse-memory] [--cold]
                            [--no-thp] [--json bench.json] [--markdown bench.md] [--from-json bench.json] [--check]

For every op and shape: our median time, each baseline's median time and its ratio to ours (> 1: we are
faster), and two bounds, each with our time over it:
  copy   the same bytes moved by `out.copy_(x)` into a tensor allocated once (one copy for a forward pass,
         two for forward + backward): the memory-bandwidth bound;
  fresh  the same copies into freshly allocated tensors (`x.clone()`): the least any op that returns a new
         tensor pays, ours and the baselines alike.
Ours, the baselines and the bounds of a row are timed round-robin (every repetition runs each once), so a
burst of load from elsewhere on this shared machine slows them alike. Uses every thread of the machine. Each
call finds in the last-level cache whatever the call before it left there (a tensor of a few tens of MiB is
partly still cached when the next contender reads it); --cold reads a buffer twice that cache's size before
every timed call, so every contender starts with none of its data cached.

Why two bounds: glibc serves tensors over 32 MiB with a fresh mmap, and the kernel zeroes every page on
first touch, which costs about as much as the copy itself. The benchmark sets THP_MEM_ALLOC_ENABLE=1
(PyTorch's CPU allocator then asks for transparent huge pages, which cuts the fault count; --no-thp turns it
off). --reuse-memory keeps freed memory mapped (glibc mallopt), so every allocation reuses touched pages:
fresh then equals copy, and the ratios show the kernels alone, as in a training loop whose allocator
caches.
"""
import os

if "--no-thp" not in os.sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse
import contextlib
import copy
import functools
import json
import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import posenc
from posenc import functional as PF

# Each case compiles its baseline afresh, but Dynamo keeps one cache per code object (apply_rotary_pos_emb's): the
# cases of three dtypes, two shapes and two modes pass its default limit of 8 recompilations.
torch._dynamo.config.recompile_limit = 64


COLD_BUFFER: Optional[torch.Tensor] = None  # --cold: read before every timed call


def last_level_cache_bytes() -> int:
    """One instance of the last-level cache as Linux describes it; 32 MiB where it does not."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            size = f.read().strip()
        return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


def evict_caches() -> None:
    """With --cold, read a buffer twice the last-level cache, so the next call finds none of its data there.
    Read, not written: the lines it leaves behind are clean, and evicting them during the timed call writes
    nothing back."""
    if COLD_BUFFER is not None:
        COLD_BUFFER.sum()


def medians_ms(fns: Dict[str, Callable[[], object]], repeat: int, warmup: int = 2,
               prepare: Optional[Dict[str, Callable[[], object]]] = None) -> Dict[str, float]:
    """Median time of each function, measured round-robin: every repetition runs each function once.
    `prepare[name]`, where given, runs before each call of that function, untimed (a decode's fresh cache);
    so does evict_caches (with --cold)."""
    prepare = prepare or {}
    for name, fn in fns.items():
        for _ in range(warmup):
            prepare.get(name, lambda: None)()
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            prepare.get(name, lambda: None)()
            evict_caches()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


REUSE_MEMORY = False  # --reuse-memory: freed memory stays resident, so peak memory is not measured
FP16 = False  # --fp16: the rotations', QK-norm's and the additive families' rows in float16 too


def dtypes() -> tuple:
    """The dtypes of the CPU rows that --fp16 extends."""
    return (torch.float32, torch.bfloat16, torch.float16) if FP16 else (torch.float32, torch.bfloat16)


def reuse_memory() -> None:
    """Keep freed memory mapped (glibc): no allocation is served by a fresh mmap, none is returned to the kernel."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2 ** 31 - 1)):
        raise RuntimeError("mallopt failed: --reuse-memory needs glibc")


def fwd_grads(forward: Callable[[], object], inputs: Sequence[torch.Tensor],
              grads: Sequence[torch.Tensor]) -> Callable[[], object]:
    """Forward, then the gradients of `inputs` through torch.autograd.grad: the forward and backward kernels
    only. .backward() would also accumulate into each leaf's .grad (x.grad += dx, 1.5 more copies of x, for
    ours and the baselines alike), which is not the op's cost: in training x is an activation."""
    def run():
        outputs = forward()
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        return torch.autograd.grad(outputs, inputs, grads)
    return run


class Table:
    """Rows of one op: ours against named baselines and the copy bounds."""

    def __init__(self, op: str, repeat: int):
        self.op, self.repeat, self.rows = op, repeat, []

    def add(self, shape: str, dtype: torch.dtype, mode: str, ours: Callable, baselines: Dict[str, Callable],
            copy_reference: Optional[torch.Tensor] = None, copies: int = 1, fresh: bool = True,
            prepare: Optional[Dict[str, Callable]] = None, warmup: int = 2, **extra):
        """`prepare`: untimed calls before each timed one, keyed "ours" or a baseline's name (see medians_ms)."""
        fns = {"ours": ours, **{f"baseline {name}": fn for name, fn in baselines.items()}}
        if copy_reference is not None:
            out = torch.empty_like(copy_reference)
            fns["copy"] = lambda: [out.copy_(copy_reference) for _ in range(copies)]
            if fresh:
                fns["fresh"] = lambda: [copy_reference.clone() for _ in range(copies)]
        prepare = {("ours" if name == "ours" else f"baseline {name}"): fn for name, fn in (prepare or {}).items()}
        ms = medians_ms(fns, self.repeat, warmup, prepare)
        row = {"op": self.op, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "mode": mode,
               "ours_ms": ms["ours"], "baselines_ms": {}, "speedup": {}}
        for name in baselines:
            row["baselines_ms"][name] = ms[f"baseline {name}"]
            row["speedup"][name] = row["baselines_ms"][name] / row["ours_ms"]
        for bound in ("copy", "fresh"):
            if bound in ms:
                row[f"{bound}_ms"] = ms[bound]
                row[f"ours_over_{bound}"] = row["ours_ms"] / ms[bound]
        row.update(extra)
        self.rows.append(row)
        print(format_row(row), flush=True)


def format_row(row) -> str:
    head = f"{row['op']:<22} {row['shape']:<34} {row['dtype']:<9} {row['mode']:<12}"
    if "us_per_call" in row:
        parts = [f"{head} ours {row['us_per_call']:6.2f} us"]
        parts += [f"{name} {us:6.2f} us" for name, us in row["us_per_call_parts"].items()]
        return " | ".join(parts)
    parts = [f"{head} ours {row['ours_ms']:8.2f} ms"]
    for name, ms in row["baselines_ms"].items():
        parts.append(f"{name} {ms:8.2f} ms ({row['speedup'][name]:5.2f}x)")
    for bound in ("copy", "fresh"):
        if f"{bound}_ms" in row:
            parts.append(f"{bound} {row[bound + '_ms']:7.2f} ms (ours/{bound} {row['ours_over_' + bound]:4.2f})")
    for key in ("saved_bytes", "baseline_saved_bytes", "peak_bytes", "baseline_peak_bytes"):
        if key in row:
            parts.append(f"{key} {row[key]}")
    return " | ".join(parts)


# Floors: baselines that show how low a measure goes on this machine for any call of its kind (one returning a
# fresh tensor, one differentiated, a gather, a call through torch.ops). --check prints a row's floor by its target.
EAGER_OP_FLOOR = "one eager op, x * 1"  # its own allocation, checks and dispatch: what a small call costs in ATen
AUTOGRAD_FLOOR = "autograd of x * 1"  # the cheapest differentiable op on q and k, then the same grad call
GATHER_FLOOR = "gather alone"
OPS_FLOOR = "torch.ops.aten.add"  # the Python binding and boxed dispatch of an ATen op, its output allocated as ours
FLOORS = (EAGER_OP_FLOOR, AUTOGRAD_FLOOR, GATHER_FLOOR, OPS_FLOOR)


# ---------------------------------------------------------------- sinusoidal and the shared embedding backward

def gather_alone(table: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
    """The fused embeddings' floor: `index_select` of the token rows alone into a buffer allocated once, nothing
    added. Rows gathered at random from a table larger than the caches cost more than the copy bound's sequential
    reads (DRAM pages and TLB entries that the prefetchers cannot guess), for PyTorch as for us."""
    rows = out.view(-1, table.shape[-1])
    return lambda: torch.index_select(table, 0, tokens.reshape(-1), out=rows)


def bench_sinusoidal(repeat: int, quick: bool) -> List[dict]:
    table = Table("add_sinusoidal", repeat)
    batch, seq, dim = (2, 512, 1024) if quick else (8, 2048, 1024)
    inv_freq = posenc.frequencies.sinusoidal(dim)
    cached = PF.sinusoidal(torch.arange(seq), inv_freq)  # the eager path's cached table
    for dtype in dtypes():
        x = torch.randn(batch, seq, dim, dtype=dtype)
        pe = cached.to(dtype)
        table.add(f"x [{batch}, {seq}, {dim}]", dtype, "fwd", lambda: PF.add_sinusoidal(x, None, inv_freq, 2.0),
                  {"eager table+add": lambda: x * 2.0 + pe}, x, copies=1)
        xg = x.clone().requires_grad_()
        grad = torch.randn_like(x)
        table.add(f"x [{batch}, {seq}, {dim}]", dtype, "fwd+bwd",
                  fwd_grads(lambda: PF.add_sinusoidal(xg, None, inv_freq, 2.0), [xg], [grad]),
                  {"eager table+add": fwd_grads(lambda: xg * 2.0 + pe, [xg], [grad])}, x, copies=2)
    # Batch 1 (inference): the sin/cos of the positions are no longer shared by batch rows, so the kept tables
    # (docs/sinusoidal.md) decide the row, as the cached table does eager's.
    single = Table("add_sinusoidal batch 1", repeat)
    for dtype in dtypes():
        x = torch.randn(1, seq, dim, dtype=dtype)
        pe = cached.to(dtype)
        single.add(f"x [1, {seq}, {dim}]", dtype, "fwd", lambda: PF.add_sinusoidal(x, None, inv_freq, 2.0),
                   {"eager table+add": lambda: x * 2.0 + pe}, x, copies=1)

    fused = Table("embed_sinusoidal", repeat)
    vocab = 32000
    tokens = torch.randint(0, vocab, (batch, seq))
    positions = torch.arange(seq)
    for dtype in dtypes():
        weight = torch.randn(vocab, dim, dtype=dtype)
        pe = cached.to(dtype)
        # zeros, not empty: an untouched tensor's pages all map the zero page, so copying it reads nothing
        out_like = torch.zeros(batch, seq, dim, dtype=dtype)
        fused.add(f"tokens [{batch}, {seq}], V {vocab}, D {dim}", dtype, "fwd",
                  lambda: PF.embed_sinusoidal(tokens, weight, None, inv_freq, 32.0),
                  {"eager two lookups": lambda: F.embedding(tokens, weight) * 32.0 + F.embedding(positions, pe),
                   GATHER_FLOOR: gather_alone(weight, tokens, out_like)},
                  out_like, copies=1)
        weight_g = weight.clone().requires_grad_()
        grad = torch.randn_like(out_like)
        fused.add(f"tokens [{batch}, {seq}], V {vocab}, D {dim}", dtype, "fwd+bwd",
                  fwd_grads(lambda: PF.embed_sinusoidal(tokens, weight_g, None, inv_freq, 32.0), [weight_g], [grad]),
                  {"eager two lookups": fwd_grads(lambda: F.embedding(tokens, weight_g) * 32.0
                                                  + F.embedding(positions, pe), [weight_g], [grad])})
    return table.rows + single.rows + fused.rows


def bench_sincos_grid(repeat: int, quick: bool, device: str = "cpu") -> List[dict]:
    """The fixed 2-D / 3-D sincos tables of diffusion transformers added to their patch tokens: PixArt-alpha at
    1024 px (64 x 64 patches of 1152 channels, batch 2 for guidance; diffusers rebuilds the table in float64 when the
    size differs from its buffer's) and CogVideoX-2b (13 x 30 x 45 patches of 1920 channels), against diffusers'
    eager table + add (built on the latent's device, as its PatchEmbed does) and the add of a cached table. On the
    GPU: batch 8 and 2, past the L2 cache."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed, get_3d_sincos_pos_embed
    table = table_for(device, "add_sinusoidal grid", repeat)
    side, dim, batch = (32, 1152, 2) if quick else (64, 1152, 8 if device == "cuda" else 2)
    frames, height, width, video_dim = (4, 16, 16, 1920) if quick else (13, 30, 45, 1920)
    video_batch = 2 if device == "cuda" and not quick else 1
    cases = [(f"x [{batch}, {side * side}, {dim}] PixArt 2-D", batch, dim,
              posenc.nn.SinusoidalGridEncoding(dim, "mae", base_size=side, interpolation_scale=2.0), [side, side],
              lambda: get_2d_sincos_pos_embed(dim, (side, side), base_size=side, interpolation_scale=2.0,
                                              device=device)),
             (f"x [{video_batch}, {frames * height * width}, {video_dim}] CogVideoX 3-D", video_batch, video_dim,
              posenc.nn.SinusoidalGridEncoding(video_dim, "cogvideox", interpolation_scale=[1.0, 1.875, 1.875]),
              [frames, height, width],
              lambda: get_3d_sincos_pos_embed(video_dim, (width, height), frames, 1.875, 1.0,
                                              device=device).flatten(0, 1))]
    for shape, rows, channels, module, grid, diffusers_table in cases:
        cached = diffusers_table().float()
        module = module.to(device)
        for dtype in dtypes():
            x = torch.randn(rows, cached.shape[0], channels, dtype=dtype, device=device)
            # diffusers adds its float32 table to the latent and casts back (PatchEmbed.forward)
            eager = lambda: (x + diffusers_table().float()).to(dtype)  # noqa: E731
            table.add(shape, dtype, "fwd", lambda: module(x, grid),
                      {"diffusers table+add": eager, "cached table add": lambda: (x + cached).to(dtype)}, x)
            xg = x.clone().requires_grad_()
            grad = torch.randn_like(x)
            table.add(shape, dtype, "fwd+bwd", fwd_grads(lambda: module(xg, grid), [xg], [grad]),
                      {"diffusers table+add": fwd_grads(lambda: (xg + diffusers_table().float()).to(dtype), [xg], [grad]),
                       "cached table add": fwd_grads(lambda: (xg + cached).to(dtype), [xg], [grad])}, x, copies=2)
    return table.rows


def bench_resampled_learned(repeat: int, quick: bool, device: str = "cpu") -> List[dict]:
    """Learned position tables resized to the image's patch grid on every forward pass, fused with the add: ViT-B/16
    at 384 px (a 14 x 14 table to 24 x 24, cls, D 768) and DINOv2-L at 644 px (37 x 37 to 46 x 46, cls, D 1024),
    bicubic, against Hugging Face's eager interpolate_pos_encoding (F.interpolate of the float32 table, cat of the
    cls row, cast, add) and the copy of x. On the GPU: four times the batch, past the L2 cache."""
    table = table_for(device, "add_resampled_learned", repeat)
    scale = 4 if device == "cuda" else 1
    cases = [("ViT-B/16 384px", (8 if quick else 32) * scale, (14, 14), (24, 24), 768),
             ("DINOv2-L 644px", (2 if quick else 8) * scale, (37, 37), (46, 46), 1024)]
    for name, batch, source_grid, grid, dim in cases:
        tokens = 1 + grid[0] * grid[1]
        for dtype in dtypes():
            x = torch.randn(batch, tokens, dim, dtype=dtype, device=device)
            weight = torch.randn(1 + source_grid[0] * source_grid[1], dim, dtype=dtype, device=device)

            def eager(x, weight, dtype=dtype, source_grid=source_grid, grid=grid, dim=dim):
                patches = weight[1:].float().reshape(1, *source_grid, dim).permute(0, 3, 1, 2)
                patches = F.interpolate(patches, size=grid, mode="bicubic", align_corners=False)
                pos = torch.cat([weight[:1].float(), patches.permute(0, 2, 3, 1).reshape(-1, dim)]).to(dtype)
                return x + pos

            def ours(x, weight, source_grid=source_grid, grid=grid):
                return PF.add_resampled_learned(x, weight, list(source_grid), list(grid), "bicubic",
                                                num_prefix_tokens=1)

            shape = f"x [{batch}, {tokens}, {dim}] {name}"
            table.add(shape, dtype, "fwd", lambda: ours(x, weight), {"HF eager": lambda: eager(x, weight)}, x)
            xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
            grad = torch.randn_like(x)
            table.add(shape, dtype, "fwd+bwd", fwd_grads(lambda: ours(xg, wg), [xg, wg], [grad]),
                      {"HF eager": fwd_grads(lambda: eager(xg, wg), [xg, wg], [grad])}, x, copies=2)
    return table.rows


def bench_embedding_backward(repeat: int, quick: bool) -> List[dict]:
    table = Table("embedding_backward", repeat)
    batch, seq, dim, vocab = (2, 512, 1024, 32000) if quick else (8, 2048, 1024, 32000)
    indices = torch.randint(0, vocab, (batch, seq))
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.randn(batch, seq, dim, dtype=dtype)
        flat_grad, flat_indices = grad.view(-1, dim), indices.flatten()
        table.add(f"grad [{batch}, {seq}, {dim}] -> [{vocab}, {dim}]", dtype, "bwd",
                  lambda: PF.embedding_backward(grad, indices, vocab),
                  {"eager index_add_": lambda: torch.zeros(vocab, dim, dtype=dtype).index_add_(0, flat_indices, flat_grad),
                   "eager embedding bwd": lambda: torch.ops.aten.embedding_dense_backward(grad, indices, vocab, -1, False)})
    return table.rows


def bench_learned(repeat: int, quick: bool) -> List[dict]:
    batch, seq, dim, vocab = (2, 512, 1024, 32000) if quick else (8, 2048, 1024, 32000)
    positions = torch.arange(seq)
    table = Table("add_learned", repeat)
    for dtype in dtypes():
        x = torch.randn(batch, seq, dim, dtype=dtype)
        wpe = torch.randn(seq, dim, dtype=dtype)
        table.add(f"x [{batch}, {seq}, {dim}]", dtype, "fwd", lambda: PF.add_learned(x, wpe),
                  {"eager x+embedding": lambda: x + F.embedding(positions, wpe)}, x, copies=1)
        xg, wg = x.clone().requires_grad_(), wpe.clone().requires_grad_()
        grad = torch.randn_like(x)
        table.add(f"x [{batch}, {seq}, {dim}]", dtype, "fwd+bwd",
                  fwd_grads(lambda: PF.add_learned(xg, wg), [xg, wg], [grad]),
                  {"eager x+embedding": fwd_grads(lambda: xg + F.embedding(positions, wg), [xg, wg], [grad])},
                  x, copies=2)

    fused = Table("embed_learned", repeat)
    tokens = torch.randint(0, vocab, (batch, seq))
    for dtype in dtypes():
        wte, wpe = torch.randn(vocab, dim, dtype=dtype), torch.randn(seq, dim, dtype=dtype)
        out_like = torch.zeros(batch, seq, dim, dtype=dtype)
        fused.add(f"tokens [{batch}, {seq}], V {vocab}, D {dim}", dtype, "fwd", lambda: PF.embed_learned(tokens, wte, wpe),
                  {"eager two lookups": lambda: F.embedding(tokens, wte) + F.embedding(positions, wpe),
                   GATHER_FLOOR: gather_alone(wte, tokens, out_like)},
                  out_like, copies=1)
        wte_g, wpe_g = wte.clone().requires_grad_(), wpe.clone().requires_grad_()
        grad = torch.randn_like(out_like)
        fused.add(f"tokens [{batch}, {seq}], V {vocab}, D {dim}", dtype, "fwd+bwd",
                  fwd_grads(lambda: PF.embed_learned(tokens, wte_g, wpe_g), [wte_g, wpe_g], [grad]),
                  {"eager two lookups": fwd_grads(lambda: F.embedding(tokens, wte_g) + F.embedding(positions, wpe_g),
                                                  [wte_g, wpe_g], [grad])})
    return table.rows + fused.rows


def bench_alibi(repeat: int, quick: bool) -> List[dict]:
    table = Table("add_alibi", repeat)
    batch, heads, q_len, k_len = (1, 16, 512, 512) if quick else (4, 16, 1024, 1024)
    slopes = PF.alibi_slopes(heads)
    distance = (torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None] - (k_len - q_len)).abs()
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(batch, heads, q_len, k_len, dtype=dtype)
        bias = (-slopes[:, None, None] * distance).to(dtype)  # the eager path's materialized [H, Q, K] bias
        shape = f"scores [{batch}, {heads}, {q_len}, {k_len}]"
        table.add(shape, dtype, "fwd", lambda: PF.add_alibi(scores, slopes, "symmetric"),
                  {"eager bias+add": lambda: scores + bias}, scores, copies=1)
        sg, mg = scores.clone().requires_grad_(), slopes.clone().requires_grad_()
        grad = torch.randn_like(scores)
        dist = distance.to(dtype)
        table.add(shape, dtype, "fwd+bwd", fwd_grads(lambda: PF.add_alibi(sg, mg, "symmetric"), [sg, mg], [grad]),
                  {"eager bias+add": fwd_grads(lambda: sg + (-mg.to(dtype)[:, None, None] * dist), [sg, mg], [grad])},
                  scores, copies=2)
        # In place: no output to allocate, so the kernel alone against the copy bound.
        buffer = scores.clone()
        table.add(shape, dtype, "fwd in place", lambda: PF.add_alibi_(buffer, slopes, "symmetric"),
                  {"eager bias+add_": lambda: buffer.add_(bias)}, scores, copies=1, fresh=False)
    slope_grad = Table("alibi_backward", repeat)  # the slope gradient alone: one read of grad
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.randn(batch, heads, q_len, k_len, dtype=dtype)
        dist = distance.to(dtype)
        slope_grad.add(f"grad [{batch}, {heads}, {q_len}, {k_len}]", dtype, "bwd",
                       lambda: PF.alibi_backward(grad, slopes, "symmetric"),
                       {"eager autograd": lambda: -(grad.sum(0) * dist).sum((1, 2))})
    return table.rows + slope_grad.rows


def eager_t5_bias(weight: torch.Tensor, q_len: int, k_len: int, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Hugging Face T5's compute_bias: bidirectional buckets in torch ops, then an embedding lookup."""
    relative = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).long() * half
    n = relative.abs()
    max_exact = half // 2
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (half - max_exact)).long()
    buckets = buckets + torch.where(n < max_exact, n, torch.clamp(large, max=half - 1))
    return F.embedding(buckets, weight).permute(2, 0, 1).unsqueeze(0)


def bench_t5(repeat: int, quick: bool) -> List[dict]:
    table = Table("t5_bias", repeat)
    heads, q_len, k_len, buckets, distance = (16, 512, 512, 32, 128) if quick else (16, 1024, 1024, 32, 128)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(buckets, heads, dtype=dtype)
        out_like = torch.zeros(1, heads, q_len, k_len, dtype=dtype)
        shape = f"bias [1, {heads}, {q_len}, {k_len}]"
        table.add(shape, dtype, "fwd", lambda: PF.t5_bias(weight, q_len, k_len, True, buckets, distance),
                  {"eager bucket+embedding": lambda: eager_t5_bias(weight, q_len, k_len, buckets, distance)},
                  out_like, copies=1)
        wg = weight.clone().requires_grad_()
        grad = torch.randn_like(out_like)
        table.add(shape, dtype, "fwd+bwd",
                  fwd_grads(lambda: PF.t5_bias(wg, q_len, k_len, True, buckets, distance), [wg], [grad]),
                  {"eager bucket+embedding": fwd_grads(lambda: eager_t5_bias(wg, q_len, k_len, buckets, distance),
                                                       [wg], [grad])},
                  out_like, copies=2)
    backward = Table("t5_bias_backward", repeat)  # the weight gradient alone
    relative = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
    bucket_ids = PF.relative_position_bucket(relative, True, buckets, distance)
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.randn(1, heads, q_len, k_len, dtype=dtype)
        backward.add(f"grad [1, {heads}, {q_len}, {k_len}]", dtype, "bwd",
                     lambda: PF.t5_bias_backward(grad, True, buckets, distance),
                     {"eager embedding bwd": lambda: torch.ops.aten.embedding_dense_backward(
                         grad.squeeze(0).permute(1, 2, 0), bucket_ids, buckets, -1, False)})
    return table.rows + backward.rows


def bench_overhead(repeat: int, quick: bool) -> List[dict]:
    """Per-call overhead through torch.ops on a tiny input, and where it goes."""
    table = Table("overhead", repeat)
    x = torch.randn(1, 1, 8)
    inv_freq = posenc.frequencies.sinusoidal(8)
    calls = 2000

    def many(fn):
        return lambda: [fn() for _ in range(calls)]

    def many_in_inference_mode(fn):  # below the Autograd key: binding, dispatch and our CPU kernel only
        def run():
            with torch.inference_mode():
                return [fn() for _ in range(calls)]
        return run

    op = torch.ops.posenc.add_sinusoidal
    ms = medians_ms({"ours": many(lambda: op(x, None, inv_freq)),
                     "torch.add": many(lambda: torch.add(x, x)),
                     # the floor of a call through torch.ops that returns a fresh tensor; alias, which allocates
                     # nothing, the binding and boxed dispatch alone
                     OPS_FLOOR: many(lambda: torch.ops.aten.add(x, x)),
                     "torch.ops.aten.alias": many(lambda: torch.ops.aten.alias(x)),
                     "ours .default": many(lambda: op.default(x, None, inv_freq)),
                     "ours inference_mode": many_in_inference_mode(lambda: op(x, None, inv_freq))}, repeat)
    parts = {name: t / calls * 1e3 for name, t in ms.items()}
    ours = parts.pop("ours")
    row = {"op": "overhead", "shape": "x [1, 1, 8]", "dtype": "float32", "mode": "fwd",
           "ours_ms": ours / 1e3, "baselines_ms": {k: v / 1e3 for k, v in parts.items()},
           "speedup": {k: v / ours for k, v in parts.items()}, "us_per_call": round(ours, 2),
           "us_per_call_parts": {k: round(v, 2) for k, v in parts.items()}}
    table.rows.append(row)
    print(format_row(row), flush=True)
    return table.rows


def saved_bytes(forward: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves for backward during one forward pass (activation memory)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return total


def peak_rss_bytes(fn: Callable[[], object]) -> int:
    """How far the resident set rises above its level before fn while fn runs (Linux: VmHWM, reset through
    /proc/self/clear_refs). Large tensors are mapped when allocated and unmapped when freed, so this is the
    most memory fn's tensors hold at once. Not with --reuse-memory, which keeps freed memory resident."""
    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    fn()
    return (status_kib("VmHWM") - before) * 1024


def bench_rope(repeat: int, quick: bool) -> List[dict]:
    """RoPE on q and k: Hugging Face's apply_rotary_pos_emb (tables precomputed, as a model does once for all
    layers) eager and under torch.compile, rotary-embedding-torch (gptj pairing), and the copy bound."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        print("rope: transformers is not installed (pip install transformers); skipped")
        return []
    table = Table("rope_qk", repeat)
    head_dim = 128
    inv_freq = posenc.frequencies.rope(head_dim)[0]
    training = (1, 512, 16) if quick else (4, 2048, 16)
    for (batch, seq, heads), positions in [(training, None), ((8, 1, 32), "decode")]:
        pos = torch.randint(0, 4096, (batch, seq)) if positions else None
        hf_pos = pos if positions else torch.arange(seq).expand(batch, seq)
        angle = hf_pos.double()[..., None] * inv_freq
        emb = torch.cat([angle, angle], dim=-1)
        for dtype in dtypes():
            q = torch.randn(batch, seq, heads, head_dim, dtype=dtype)
            k = torch.randn(batch, seq, heads, head_dim, dtype=dtype)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            both = torch.cat([q, k])
            shape = f"q,k [{batch}, {seq}, {heads}, {head_dim}]" + (" +pos" if positions else "")

            def hf(qq, kk, fn=apply_rotary_pos_emb):
                return fn(qq, kk, cos, sin, unsqueeze_dim=2)

            # A fresh compiled function per case: the timed calls never recompile.
            hf_compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True, dynamic=False)

            baselines = {"HF eager": lambda: hf(q, k), "HF compile": lambda: hf(q, k, hf_compiled)}
            if not positions:
                try:
                    from rotary_embedding_torch import RotaryEmbedding
                    ret = RotaryEmbedding(head_dim)
                    q_bhsd, k_bhsd = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # its layout
                    baselines["rotary-emb-torch"] = lambda: (ret.rotate_queries_or_keys(q_bhsd),
                                                             ret.rotate_queries_or_keys(k_bhsd))
                except ImportError:
                    pass
            if positions:  # a decoding step: one eager op writing a fresh tensor of these bytes
                baselines[EAGER_OP_FLOOR] = lambda: both * 1.0
            table.add(shape, dtype, "fwd", lambda: PF.rope_qk(q, k, pos, inv_freq), baselines, both, copies=1)

            qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
            grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)

            def train(fn):
                return fwd_grads(fn, [qg, kg], [grad_q, grad_k])

            ours = lambda: PF.rope_qk(qg, kg, pos, inv_freq)  # noqa: E731
            hf_eager = lambda: hf(qg, kg)  # noqa: E731
            memory = {"saved_bytes": saved_bytes(ours), "baseline_saved_bytes": saved_bytes(hf_eager)}
            if not REUSE_MEMORY and not positions:  # decoding's few KiB come from the heap, not new pages
                memory.update(peak_bytes=peak_rss_bytes(train(ours)), baseline_peak_bytes=peak_rss_bytes(train(hf_eager)))
            baselines = {"HF eager": train(hf_eager), "HF compile": train(lambda: hf(qg, kg, hf_compiled))}
            if positions:  # a decoding step: what autograd itself costs on these tensors
                baselines[AUTOGRAD_FLOOR] = train(lambda: (qg * 1.0, kg * 1.0))
            table.add(shape, dtype, "fwd+bwd", train(ours), baselines, both, copies=2, **memory)
            # In place (rope_ on q and k stacked): no output to allocate, so the kernel alone against the copy.
            buffer = both.clone()
            buffer_pos = None if pos is None else torch.cat([pos, pos])
            table.add(shape, dtype, "fwd in place", lambda: PF.rope_(buffer, buffer_pos, inv_freq), {}, both,
                      copies=1, fresh=False)
    return table.rows


def rope_rows(table: Table, shape: str, dtype: torch.dtype, q: torch.Tensor, k: torch.Tensor,
              ours: Callable[[torch.Tensor, torch.Tensor], object],
              baselines: Dict[str, Callable[[torch.Tensor, torch.Tensor], object]],
              inplace: Callable[[torch.Tensor], object]) -> None:
    """fwd, fwd+bwd and in-place rows of a rotation of q and k: ours against the baselines and the copy bounds."""
    both = torch.cat([q.flatten(), k.flatten()])
    table.add(shape, dtype, "fwd", lambda: ours(q, k),
              {name: (lambda fn=fn: fn(q, k)) for name, fn in baselines.items()}, both, copies=1)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    def train(fn):
        return fwd_grads(lambda: fn(qg, kg), [qg, kg], [grad_q, grad_k])
    table.add(shape, dtype, "fwd+bwd", train(ours), {name: train(fn) for name, fn in baselines.items()}, both,
              copies=2, saved_bytes=saved_bytes(lambda: ours(qg, kg)))
    buffer = torch.cat([q, k], dim=0)  # rope_ of q and k stacked: the kernel alone against the copy
    table.add(shape, dtype, "fwd in place", lambda: inplace(buffer), {}, both, copies=1, fresh=False)


def bench_qk_norm_rope(repeat: int, quick: bool, device: str = "cpu") -> List[dict]:
    """QK-norm + RoPE (Qwen3's attention prologue) on q and k: Hugging Face's Qwen3RMSNorm modules then
    apply_rotary_pos_emb (tables precomputed), eager and under torch.compile, against qk_norm_rope; fwd+bwd takes
    the gradients of q, k and both norm weights. On the GPU: 32 query heads and twice the tokens."""
    try:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb
    except ImportError:
        print("qk_norm_rope: transformers is not installed (pip install transformers); skipped")
        return []
    table = table_for(device, "qk_norm_rope", repeat)
    head_dim, q_heads, kv_heads = 128, 32 if device == "cuda" else 16, 8
    inv_freq = posenc.frequencies.rope(head_dim, base=1e6)[0].to(device)
    batch, seq = (1, 512) if quick else (4, 4096 if device == "cuda" else 2048)
    angle = torch.arange(seq, device=device).double()[:, None] * inv_freq
    emb = torch.cat([angle, angle], dim=-1)[None]
    for dtype in dtypes():
        q = torch.randn(batch, seq, q_heads, head_dim, dtype=dtype, device=device)
        k = torch.randn(batch, seq, kv_heads, head_dim, dtype=dtype, device=device)
        q_norm = Qwen3RMSNorm(head_dim, eps=1e-6).to(device, dtype)
        k_norm = Qwen3RMSNorm(head_dim, eps=1e-6).to(device, dtype)
        with torch.no_grad():
            q_norm.weight.uniform_(0.5, 1.5)
            k_norm.weight.uniform_(0.5, 1.5)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        both = torch.cat([q.flatten(), k.flatten()])
        shape = f"q,k [{batch}, {seq}, {q_heads}|{kv_heads}, {head_dim}]"

        def hf(qq, kk):
            return apply_rotary_pos_emb(q_norm(qq), k_norm(kk), cos, sin, unsqueeze_dim=2)

        hf_compiled = torch.compile(hf, fullgraph=True, dynamic=False)  # fresh per case: never recompiled while timed

        def ours(qq, kk):
            return PF.qk_norm_rope(qq, kk, q_norm.weight, k_norm.weight, None, inv_freq, 1e-6)

        with torch.no_grad():
            table.add(shape, dtype, "fwd", lambda: ours(q, k), {"HF eager": lambda: hf(q, k),
                                                                 "HF compile": lambda: hf_compiled(q, k)}, both)
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
        leaves = [qg, kg, q_norm.weight, k_norm.weight]

        def train(fn):
            return fwd_grads(lambda: fn(qg, kg), leaves, [grad_q, grad_k])

        table.add(shape, dtype, "fwd+bwd", train(ours), {"HF eager": train(hf), "HF compile": train(hf_compiled)},
                  both, copies=2, saved_bytes=saved_bytes(lambda: ours(qg, kg)),
                  baseline_saved_bytes=saved_bytes(lambda: hf(qg, kg)))
    return table.rows


def bench_rope_qk_cache(repeat: int, quick: bool) -> List[dict]:
    """A decoding step's prologue with a static KV cache (Llama 3 8B's attention: 32 query heads, 8 KV heads of 128,
    one new token per sequence, caches [B, 8, 4096, 128] as Hugging Face's StaticCache holds them), batch 1-8:
    rope_qk_cache_ (q rotated in place, k rotated and v copied into their cache rows, one call) against Hugging Face
    eager: LlamaRotaryEmbedding's cos/sin for the positions ("HF eager+tables"; "HF eager": tables given, as a model
    forms them once per step for all its layers), apply_rotary_pos_emb, then StaticCache.update. Each timed call is
    1000 steps, so its ms are the us of one step. Inputs and cache rows stay in cache from step to step, alike for
    every contender. The copy bound is q + k + v through out.copy_(x), the bytes the step moves (q read and written,
    k and v read, their cache rows written). StaticCache.update of transformers 5.24 takes no cache_position: it
    writes every batch row at one running slot (it advances by one a call; the baseline resets it to 1000 every
    1000 calls), so Hugging Face's rows all go to one slot, ours to slot 1000 + b (row b's position; both rotate
    row b at 1000 + b)."""
    try:
        import itertools
        import transformers
        from transformers.cache_utils import StaticCache
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    except ImportError:
        print("rope_qk_cache: transformers is not installed (pip install transformers); skipped")
        return []
    table = Table("rope_qk_cache_", repeat)
    q_heads, kv_heads, head_dim, max_len, start, steps = 32, 8, 128, 4096, 1000, 1000
    config = transformers.LlamaConfig(hidden_size=q_heads * head_dim, num_attention_heads=q_heads,
                                      num_key_value_heads=kv_heads, num_hidden_layers=1,
                                      max_position_embeddings=max_len,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    hf_rotary = LlamaRotaryEmbedding(config)
    inv_freq = posenc.frequencies.rope(head_dim, base=500000.0)[0]

    def many(fn):
        return lambda: [fn() for _ in range(steps)]

    for batch in ((1, 8) if quick else (1, 2, 4, 8)):
        positions = (start + torch.arange(batch))[:, None]  # [B, 1]: row b's new token at 1000 + b
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(batch, 1, q_heads, head_dim, dtype=dtype)  # [B, S, H, D]: the projections' view
            k = torch.randn(batch, 1, kv_heads, head_dim, dtype=dtype)
            v = torch.randn(batch, 1, kv_heads, head_dim, dtype=dtype)
            k_cache = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype)
            v_cache = torch.zeros_like(k_cache)
            # Hugging Face's q, k, v: [B, H, 1, D] views of the same projections (LlamaAttention's transpose(1, 2))
            q_view, k_view, v_view = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            cache = StaticCache(config=config, max_cache_len=max_len)
            cache.update(k_view, v_view, 0)  # allocates the layer's [B, 8, 4096, 128] caches
            slot = cache.layers[0].cumulative_length
            calls = itertools.count()
            with torch.no_grad():
                cos, sin = hf_rotary(q_view, positions)

            def hf_step(tables=None):
                if next(calls) % steps == 0:
                    slot.fill_(start)
                cs = hf_rotary(q_view, positions) if tables is None else tables
                q_rot, k_rot = apply_rotary_pos_emb(q_view, k_view, *cs)
                return q_rot, cache.update(k_rot, v_view, 0)

            ours = many(lambda: PF.rope_qk_cache_(q, k, v, k_cache, v_cache, positions, inv_freq,
                                                  cache_format="bhsd"))
            moved = torch.cat([q.flatten(), k.flatten(), v.flatten()])
            with torch.no_grad():
                table.add(f"q [{batch}, 1, {q_heads}, {head_dim}] k,v Hkv {kv_heads} S_max {max_len} x{steps}", dtype,
                          "decode step", ours,
                          {"HF eager+tables": many(hf_step), "HF eager": many(lambda: hf_step((cos, sin)))},
                          moved, copies=steps, fresh=False)
    return table.rows


def bench_mrope(repeat: int, quick: bool) -> List[dict]:
    """M-RoPE (Qwen2-VL) on q and k of a prompt holding an image: Hugging Face's Qwen2VLRotaryEmbedding tables
    (built once per forward for all layers) + apply_rotary_pos_emb, eager and compiled, and the copy bound."""
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb
    table = Table("rope_qk mrope", repeat)
    seq, heads, head_dim, section = (1024, 16, 128, [16, 24, 24]) if quick else (4096, 16, 128, [16, 24, 24])
    # 96 text tokens, an image of 48 x 80 merged patches (a 1344 x 2240 image at 14-pixel patches), text.
    image = (16, 48) if quick else (48, 80)
    types = torch.tensor([[0] * 96 + [1] * (image[0] * image[1]) + [0] * (seq - 96 - image[0] * image[1])])
    positions, _ = PF.mrope_positions(types, torch.tensor([[1, 2 * image[0], 2 * image[1]]]))
    config = Qwen2VLTextConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                               rope_scaling={"type": "mrope", "mrope_section": section, "rope_theta": 1e6})
    hf_rotary = Qwen2VLRotaryEmbedding(config)
    rotary = posenc.nn.MultimodalRotaryEmbedding.from_hf_config(config)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, seq, heads, head_dim, dtype=dtype)
        k = torch.randn(1, seq, heads, head_dim, dtype=dtype)
        cos, sin = hf_rotary(q, positions)
        hf_compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True, dynamic=False)
        baselines = {"HF eager": lambda qq, kk: apply_rotary_pos_emb(qq, kk, cos, sin, unsqueeze_dim=2),
                     "HF eager+tables": lambda qq, kk: apply_rotary_pos_emb(qq, kk, *hf_rotary(qq, positions),
                                                                            unsqueeze_dim=2),
                     "HF compile": lambda qq, kk: hf_compiled(qq, kk, cos, sin, unsqueeze_dim=2)}
        inv_freq, pair_axis = rotary.inv_freq, rotary.pair_axis
        rope_rows(table, f"q,k [1, {seq}, {heads}, {head_dim}] pos [3, 1, {seq}]", dtype, q, k,
                  lambda qq, kk: rotary(qq, kk, positions), baselines,
                  lambda buffer: PF.rope_(buffer, positions.expand(3, 2, seq), inv_freq, pair_axis=pair_axis))
    return table.rows


def bench_axial(repeat: int, quick: bool) -> List[dict]:
    """2-D axial RoPE of a ViT-L (16 heads of 64 channels, 32 x 32 patches, batch 32): Hugging Face's Qwen2-VL
    vision rotary (neox, bshd) and diffusers' apply_rotary_emb (gptj, bhsd; Flux's axes), eager and compiled,
    with their tables built once per forward, and the copy bound."""
    from diffusers.models.embeddings import apply_rotary_emb
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision
    table = Table("rope_qk axial", repeat)
    batch, side, heads, head_dim = (8, 16, 16, 64) if quick else (32, 32, 16, 64)
    seq = side * side
    positions = PF.image_positions(side, side)
    inv_freq, pair_axis = posenc.frequencies.axial(head_dim, 2, 10000.0)
    angle = positions.double()[pair_axis].T * inv_freq  # [S, pairs]
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(batch, seq, heads, head_dim, dtype=dtype)
        k = torch.randn(batch, seq, heads, head_dim, dtype=dtype)
        # Hugging Face's vision tables: float32 [S, D], each angle in both halves (neox).
        cos, sin = torch.cat([angle, angle], -1).cos().float(), torch.cat([angle, angle], -1).sin().float()
        hf_compiled = torch.compile(apply_rotary_pos_emb_vision, fullgraph=True, dynamic=False)
        rope_rows(table, f"q,k [{batch}, {seq}, {heads}, {head_dim}] neox bshd", dtype, q, k,
                  lambda qq, kk: PF.rope_qk(qq, kk, positions, inv_freq, pair_axis=pair_axis),
                  {"HF eager": lambda qq, kk: apply_rotary_pos_emb_vision(qq, kk, cos, sin),
                   "HF compile": lambda qq, kk: hf_compiled(qq, kk, cos, sin)},
                  lambda buffer: PF.rope_(buffer, positions, inv_freq, pair_axis=pair_axis))
        # diffusers' tables: float32 [S, D], each angle in both channels of its pair (gptj).
        tables = (angle.repeat_interleave(2, -1).cos().float(), angle.repeat_interleave(2, -1).sin().float())
        q_bhsd, k_bhsd = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        diffusers_compiled = torch.compile(apply_rotary_emb, fullgraph=True, dynamic=False)
        rope_rows(table, f"q,k [{batch}, {heads}, {seq}, {head_dim}] gptj bhsd", dtype, q_bhsd, k_bhsd,
                  lambda qq, kk: PF.rope_qk(qq, kk, positions, inv_freq, 1.0, "gptj", "bhsd", pair_axis=pair_axis),
                  {"diffusers eager": lambda qq, kk: (apply_rotary_emb(qq, tables), apply_rotary_emb(kk, tables)),
                   "diffusers compile": lambda qq, kk: (diffusers_compiled(qq, tables),
                                                        diffusers_compiled(kk, tables))},
                  lambda buffer: PF.rope_(buffer, positions, inv_freq, 1.0, "gptj", "bhsd", pair_axis=pair_axis))
    return table.rows


def bench_dinov3(repeat: int, quick: bool, device: str = "cpu") -> List[dict]:
    """DINOv3 ViT-L's rotary (16 heads of 64 channels, 32 x 32 patches + cls and 4 registers at 512 px, batch 16;
    64 on the GPU): transformers' DINOv3ViTRopePositionEmbedding (cos/sin of the patch centres, built each forward)
    + its apply_rotary_pos_emb (prefix tokens split off, rotated patches concatenated back), eager and compiled,
    against rope_qk with patch_center_positions, and the copy bound."""
    from transformers import DINOv3ViTConfig
    from transformers.models.dinov3_vit import modeling_dinov3_vit as dinov3
    table = table_for(device, "rope_qk dinov3", repeat)
    batch, side = (4, 16) if quick else (64 if device == "cuda" else 16, 32)
    config = DINOv3ViTConfig(hidden_size=1024, num_attention_heads=16, image_size=side * 16, patch_size=16,
                             num_register_tokens=4)
    embedding = dinov3.DINOv3ViTRopePositionEmbedding(config).eval().to(device)
    pixels = torch.empty(1, 3, side * 16, side * 16, device=device)
    inv_freq, pair_axis = posenc.frequencies.axial(64, 2, config.rope_theta)
    inv_freq, pair_axis = (inv_freq * (2 * math.pi)).to(device), pair_axis.to(device)
    seq = 5 + side * side
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(batch, 16, seq, 64, dtype=dtype, device=device)
        k = torch.randn(batch, 16, seq, 64, dtype=dtype, device=device)

        def hf(qq, kk, apply=dinov3.apply_rotary_pos_emb):
            cos, sin = embedding(pixels.to(dtype))
            return apply(qq, kk, cos, sin)

        hf_compiled = torch.compile(hf, fullgraph=True, dynamic=False)

        def ours(qq, kk):
            positions = PF.patch_center_positions(side, side, 5, device=device)
            return PF.rope_qk(qq, kk, positions, inv_freq, 1.0, "neox", "bhsd", pair_axis=pair_axis)

        positions = PF.patch_center_positions(side, side, 5, device=device)
        rope_rows(table, f"q,k [{batch}, 16, {seq}, 64] bhsd", dtype, q, k, ours,
                  {"HF eager": hf, "HF compile": hf_compiled},
                  lambda buffer: PF.rope_(buffer, positions, inv_freq, 1.0, "neox", "bhsd", pair_axis=pair_axis))
    return table.rows


def positional_ms(step: Callable[[], object], label: Callable[[], object], steps: int = 3,
                  prepare: Callable[[], object] = lambda: None) -> Dict[str, float]:
    """Profiled steps: the medians of a step's wall time and of its positional code's time (ms), and the median
    of their ratio per step (the share). `prepare()` runs before each step, outside the profile.

    `label()` is a context manager under which the model's positional code runs inside
    torch.profiler.record_function("positional") ranges. Forward: the elapsed time of those ranges (the ops
    inside included), and of any posenc op called outside them (so that a patch which moves its work elsewhere
    is still counted). Backward: the autograd engine's evaluate_function events of the nodes those ops recorded,
    matched by sequence number."""
    from torch.profiler import ProfilerActivity, profile

    def outermost(event) -> bool:
        """Not inside a positional range, a posenc op or a backward node: counted once."""
        parent = event.cpu_parent
        while parent is not None:
            if parent.name == "positional" or parent.name.startswith(("posenc::", "autograd::engine::")):
                return False
            parent = parent.cpu_parent
        return True

    walls, positional = [], []
    with label():
        prepare()
        step()  # the profiler's own first-call cost stays out of the measured steps
        for _ in range(steps):
            prepare()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                step()
                walls.append(time.perf_counter() - start)
            events = prof.events()
            ranges = [e for e in events if (e.name == "positional" or e.name.startswith("posenc::")) and outermost(e)]
            sequence = set()
            pending = list(ranges)
            while pending:
                event = pending.pop()
                if event.sequence_nr >= 0:
                    sequence.add((event.thread, event.sequence_nr))
                pending += event.cpu_children
            backward = [e for e in events if e.name.startswith("autograd::engine::evaluate_function:")
                        and (e.fwd_thread, e.sequence_nr) in sequence]
            positional.append(sum(e.cpu_time_total for e in ranges + backward) / 1e3)
    return {"step_ms": statistics.median(walls) * 1e3, "positional_ms": statistics.median(positional),
            "share": statistics.median(p / (w * 1e3) for p, w in zip(positional, walls))}


MODELS = None  # --models: the families --ops model runs (None: all of MODEL_FAMILIES)
MODEL_FAMILIES = ("llama", "qwen3", "gemma3")


def model_families(quick: bool) -> Dict[str, tuple]:
    """name -> (row label, Auto class, config, decode rows or not). A training step runs the decoder stack (a
    causal LM's .model), so every family's training row measures the same thing as Llama's LlamaModel."""
    import transformers
    layers, hidden, heads, seq = (2, 256, 2, 512) if quick else (4, 1024, 8, 2048)
    size = dict(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                num_attention_heads=heads, max_position_embeddings=seq)
    gqa = dict(size, num_key_value_heads=heads // 2, head_dim=hidden // heads)
    window = seq // 4
    # Gemma 3's own pattern (five sliding layers, then a full one) would leave a 4-layer model without a full
    # layer; its released configs scale the global layers' rope linearly (factor 8): both per-layer ropes differ.
    gemma3 = transformers.Gemma3TextConfig(
        **gqa, query_pre_attn_scalar=hidden // heads, sliding_window=window,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    return {
        "llama": (f"Llama {layers}x{hidden}, {heads} heads, seq {seq}", transformers.AutoModel,
                  transformers.LlamaConfig(**size, num_key_value_heads=heads, rope_parameters={
                      "rope_type": "default", "rope_theta": 500000.0}), False),
        "qwen3": (f"Qwen3 {layers}x{hidden}, {heads}/{heads // 2} heads, seq {seq}",
                  transformers.AutoModelForCausalLM,
                  transformers.Qwen3Config(**gqa, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  True),
        "gemma3": (f"Gemma 3 {layers}x{hidden}, {heads}/{heads // 2} heads, seq {seq}, window {window}",
                   transformers.AutoModelForCausalLM, gemma3, True),
    }


@contextlib.contextmanager
def positional_ranges(model: torch.nn.Module):
    """record_function("positional") ranges around what the patch replaces or may fuse, patched or not: the rotary
    module, the modeling file's apply_rotary_pos_emb (Hugging Face's or posenc's wrapper), and the attention
    layers' q_norm and k_norm where the model has them (Qwen3, Gemma 3): qk_norm_rope fuses those norms into the
    rotation, so both sides count them and the comparison holds with or without that fusion. Modules are labelled
    by hooks, which stay around whatever forward a patch installs."""
    from torch.profiler import record_function
    modeling = sys.modules[type(model).__module__]
    decoder = getattr(model, "model", model)
    modules = [decoder.rotary_emb] + [m for name, m in model.named_modules() if name.endswith((".q_norm", ".k_norm"))]
    open_ranges = []

    def enter(*_):
        open_ranges.append(record_function("positional").__enter__())

    def leave(*_):
        open_ranges.pop().__exit__(None, None, None)

    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    apply = modeling.apply_rotary_pos_emb

    def labelled(*args, **kwargs):
        with record_function("positional"):
            return apply(*args, **kwargs)

    modeling.apply_rotary_pos_emb = labelled
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = apply
        for handle in handles:
            handle.remove()


class Decode:
    """Greedy decoding of `steps` tokens one at a time, batch `batch`, after a prompt prefilled once into a
    DynamicCache. prepare() (untimed) hands the next run a copy of the prefilled cache; run() decodes."""

    def __init__(self, model: torch.nn.Module, prompt: torch.Tensor, steps: int):
        import transformers
        self.model, self.steps = model, steps
        self.prefilled = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            logits = model(input_ids=prompt, cache=self.prefilled, use_cache=True, logits_to_keep=1).logits
        self.first = logits[:, -1:].argmax(-1)
        self.cache = None

    def prepare(self) -> None:
        self.cache = copy.deepcopy(self.prefilled)

    def run(self) -> None:
        token = self.first
        with torch.no_grad():
            for _ in range(self.steps):
                token = self.model(input_ids=token, cache=self.cache, use_cache=True).logits[:, -1:].argmax(-1)


def bench_model(repeat: int, quick: bool) -> List[dict]:
    """Small Llama-, Qwen3- (QK-norm) and Gemma 3-shaped (a rope per layer type) models, patched with
    posenc.integrations.transformers against the same models unpatched (Hugging Face eager rotary: cos/sin tables
    once per forward, apply_rotary_pos_emb in every layer). For each: a training step (forward + backward, gradients
    into every parameter) and, for Qwen3 and Gemma 3, a decode step (tokens generated one at a time after a
    prefilled prompt, tokens per second), with the share of the step spent in positional code before and after
    (torch.profiler)."""
    try:
        import transformers  # noqa: F401
        from posenc.integrations import transformers as posenc_hf
    except ImportError:
        print("model: transformers is not installed (pip install transformers); skipped")
        return []
    families = model_families(quick)
    unknown = sorted(set(MODELS or ()) - set(families))
    if unknown:
        raise SystemExit(f"bench.py --models: got {', '.join(unknown)}; choose from {', '.join(MODEL_FAMILIES)}")
    seq, batch, steps = (512, 4, 16) if quick else (2048, 4, 32)
    table = Table("model", repeat)
    for family in MODELS or MODEL_FAMILIES:
        label, auto, config, decode = families[family]
        tokens = torch.randint(0, config.vocab_size, (1, seq))
        prompt = torch.randint(0, config.vocab_size, (batch, seq))
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            # built in `dtype`, as from_pretrained(dtype=...) loads a model: the rotary frequencies stay float32
            # (model.to(dtype) would round them, and patch refuses tables that no longer match the config)
            models = {"unpatched": auto.from_config(config, dtype=dtype)}
            models["patched"] = copy.deepcopy(models["unpatched"])
            posenc_hf.patch(models["patched"])
            grad = torch.randn(1, seq, config.hidden_size, dtype=dtype)

            def train(model):
                decoder = getattr(model, "model", model)

                def run():
                    decoder.zero_grad(set_to_none=True)
                    decoder(input_ids=tokens).last_hidden_state.backward(grad)
                return run

            for model in models.values():
                model.train()
            model_rows(table, label, dtype, models, {name: train(m) for name, m in models.items()}, {}, "fwd+bwd",
                       repeat)
            if not decode:
                continue
            for model in models.values():
                model.zero_grad(set_to_none=True)
                model.eval()
            decoders = {name: Decode(m, prompt, steps) for name, m in models.items()}
            model_rows(table, f"{label}, decode {steps} after {seq}, batch {batch}", dtype, models,
                       {name: d.run for name, d in decoders.items()},
                       {name: d.prepare for name, d in decoders.items()}, "decode", repeat, tokens=batch * steps)
            del decoders
    return table.rows


def model_rows(table: Table, shape: str, dtype: torch.dtype, models: Dict[str, torch.nn.Module],
               fns: Dict[str, Callable], prepare: Dict[str, Callable], what: str, repeat: int,
               tokens: Optional[int] = None) -> None:
    """One row: `fns["patched"]` against `fns["unpatched"]` timed round-robin, then each profiled for its
    positional share. `tokens`: tokens generated per call, for tokens per second."""
    none = lambda: None  # noqa: E731
    shares = {name: positional_ms(fn, lambda m=models[name]: positional_ranges(m), steps=min(3, repeat),
                                  prepare=prepare.get(name, none))
              for name, fn in fns.items()}
    share = {name: s["share"] for name, s in shares.items()}
    extra = dict(positional_ms=shares["patched"]["positional_ms"], step_ms=shares["patched"]["step_ms"],
                 baseline_positional_ms=shares["unpatched"]["positional_ms"],
                 baseline_step_ms=shares["unpatched"]["step_ms"],
                 positional_share=share["patched"], baseline_positional_share=share["unpatched"])
    mode = f"{what}, positional {100 * share['unpatched']:.1f}% -> {100 * share['patched']:.1f}%"
    # no warm-up calls: the profiled steps above have run each function four times
    table.add(shape, dtype, mode, fns["patched"], {"HF eager": fns["unpatched"]},
              prepare={"ours": prepare.get("patched", none), "HF eager": prepare.get("unpatched", none)}, warmup=0,
              **extra)
    row = table.rows[-1]
    if tokens:
        row["tokens"] = tokens
        row["tokens_per_s"] = tokens / row["ours_ms"] * 1e3
        row["baseline_tokens_per_s"] = tokens / row["baselines_ms"]["HF eager"] * 1e3
        print(f"{'':<22} tokens/s: HF eager {row['baseline_tokens_per_s']:.1f}, posenc {row['tokens_per_s']:.1f}",
              flush=True)
    print(f"{'':<22} profiled steps (medians): HF eager positional {shares['unpatched']['positional_ms']:.1f} of "
          f"{shares['unpatched']['step_ms']:.1f} ms, posenc {shares['patched']['positional_ms']:.1f} of "
          f"{shares['patched']['step_ms']:.1f} ms", flush=True)


# ---------------------------------------------------------------- GPU (--device cuda)
# The same comparisons on a GPU, with its own shapes (sized well past the L2 cache) and baselines: Hugging Face
# eager, the same eager code under torch.compile (Inductor's Triton kernels), Liger's rope kernel where
# liger-kernel is installed, and the device-to-device copy of the same bytes (out.copy_(x)). Times come from
# CUDA events around each call, round-robin over the contenders; "copy bw" is the copy's time over ours: the
# fraction of the copy's bandwidth we reach (target >= 0.85 for RoPE and the adds).

def cuda_medians_ms(fns: Dict[str, Callable[[], object]], repeat: int, warmup: int = 3) -> Dict[str, float]:
    """Median GPU time of each function (CUDA events around each call), measured round-robin."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


class CudaTable:
    """GPU rows of one op: ours, named baselines, and the copy of `copy_reference` (`copies` times)."""

    def __init__(self, op: str, repeat: int):
        self.op, self.repeat, self.rows = op, repeat, []

    def add(self, shape: str, dtype: torch.dtype, mode: str, ours: Callable, baselines: Dict[str, Callable],
            copy_reference: Optional[torch.Tensor] = None, copies: int = 1, fresh: bool = True, **extra):
        """Table.add's arguments, so that a CPU benchmark runs on the GPU too: `fresh` (no fresh bound here) is
        ignored, `extra` goes into the row."""
        baselines = dict(baselines)
        for name, fn in list(baselines.items()):  # a baseline that fails here (a library's API) is left out
            try:
                fn()
            except Exception as error:  # noqa: BLE001
                print(f"{self.op} {mode}: baseline {name} left out: {type(error).__name__}: {error}"[:300])
                del baselines[name]
        fns = {"ours": ours, **{f"baseline {name}": fn for name, fn in baselines.items()}}
        if copy_reference is not None:
            out = torch.empty_like(copy_reference)
            fns["copy"] = lambda: [out.copy_(copy_reference) for _ in range(copies)]
        ms = cuda_medians_ms(fns, self.repeat)
        row = {"op": self.op, "device": torch.cuda.get_device_name(), "shape": shape,
               "dtype": str(dtype).replace("torch.", ""), "mode": mode, "ours_ms": ms["ours"], "baselines_ms": {},
               "speedup": {}}
        for name in baselines:
            row["baselines_ms"][name] = ms[f"baseline {name}"]
            row["speedup"][name] = row["baselines_ms"][name] / row["ours_ms"]
        if "copy" in ms:
            moved = 2 * copy_reference.numel() * copy_reference.element_size() * copies  # read + write
            row.update(copy_ms=ms["copy"], ours_over_copy=ms["ours"] / ms["copy"],
                       copy_bandwidth_fraction=ms["copy"] / ms["ours"], ours_tb_per_s=moved / ms["ours"] / 1e9,
                       copy_tb_per_s=moved / ms["copy"] / 1e9)
        row.update(extra)
        self.rows.append(row)
        line = format_row(row)
        if "copy_bandwidth_fraction" in row:
            line += f" | copy bw {row['copy_bandwidth_fraction']:.2f} ({row['ours_tb_per_s']:.2f} TB/s)"
        print(line, flush=True)


def table_for(device: str, op: str, repeat: int):
    """The rows of a benchmark written once for both devices: CudaTable's on the GPU, Table's on the CPU."""
    return CudaTable(op, repeat) if device == "cuda" else Table(op, repeat)


def liger_rope():
    """Liger's rope kernel with Hugging Face's signature, or None where liger-kernel is not installed."""
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        print("rope: liger-kernel is not installed: no Liger baseline")
        return None
    return liger_rotary_pos_emb


def bench_cuda_rope(repeat: int, quick: bool) -> List[dict]:
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        print("rope: transformers is not installed (pip install transformers); skipped")
        return []
    table = CudaTable("rope_qk", repeat)
    batch, seq, heads, head_dim = (2, 1024, 32, 128) if quick else (4, 4096, 32, 128)
    inv_freq = posenc.frequencies.rope(head_dim)[0].cuda()
    angle = torch.arange(seq, device="cuda", dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat([angle, angle], dim=-1)[None]  # [1, S, D], as a model builds it once for all layers
    liger = liger_rope()
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(batch, seq, heads, head_dim, dtype=dtype, device="cuda")
        k = torch.randn(batch, seq, heads, head_dim, dtype=dtype, device="cuda")
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        both = torch.cat([q, k])
        shape = f"q,k [{batch}, {seq}, {heads}, {head_dim}]"
        hf_compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True, dynamic=False)
        # HF's q and k are [B, H, S, D] views of [B, S, H, D] projections; Liger takes the same views.
        q_view, k_view = q.transpose(1, 2), k.transpose(1, 2)
        baselines = {"HF eager": lambda: apply_rotary_pos_emb(q_view, k_view, cos, sin),
                     "Inductor": lambda: hf_compiled(q_view, k_view, cos, sin)}
        if liger is not None:
            liger_q, liger_k = q_view.clone(), k_view.clone()  # Liger may write its inputs
            baselines["Liger"] = lambda: liger(liger_q, liger_k, cos, sin)
        table.add(shape, dtype, "fwd", lambda: PF.rope_qk(q, k, None, inv_freq), baselines, both, copies=1)

        grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
        bwd_baselines = {"HF eager": lambda: apply_rotary_pos_emb(grad_q.transpose(1, 2), grad_k.transpose(1, 2),
                                                                  cos, -sin)}
        table.add(shape, dtype, "bwd", lambda: torch.ops.posenc.rope_qk_backward(grad_q, grad_k, None, inv_freq),
                  bwd_baselines, both, copies=1)
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        qg_view, kg_view = qg.transpose(1, 2), kg.transpose(1, 2)

        def train(fn):
            return fwd_grads(fn, [qg, kg], [grad_q, grad_k])

        hf_train = lambda: [t.transpose(1, 2) for t in apply_rotary_pos_emb(qg_view, kg_view, cos, sin)]  # noqa: E731
        compiled_train = lambda: [t.transpose(1, 2) for t in hf_compiled(qg_view, kg_view, cos, sin)]  # noqa: E731
        table.add(shape, dtype, "fwd+bwd", train(lambda: PF.rope_qk(qg, kg, None, inv_freq)),
                  {"HF eager": train(hf_train), "Inductor": train(compiled_train)}, both, copies=2)
        buffer = both.clone()
        in_place = {}
        if liger is not None:
            buffer_view = buffer.clone().transpose(1, 2)  # q and k stacked: rotate each half once
            in_place["Liger"] = lambda: liger(buffer_view[:batch], buffer_view[batch:], cos, sin)
        table.add(shape, dtype, "fwd in place", lambda: PF.rope_(buffer, None, inv_freq), in_place, both, copies=1)
    # Multi-axis rotary (M-RoPE, as Qwen2-VL): three position axes, against the one-axis rotation given positions of
    # its own (each call checks its positions on the GPU and reads a flag back; the multi-axis one reads pair_axis).
    mrope_freq, pair_axis = posenc.frequencies.mrope(head_dim, [16, 24, 24])
    mrope_freq, pair_axis = mrope_freq.cuda(), pair_axis.cuda()
    q = torch.randn(batch, seq, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn_like(q)
    positions = torch.arange(seq, device="cuda").expand(batch, seq).contiguous()
    axes = positions.expand(3, batch, seq).contiguous()
    table.add(f"q,k [{batch}, {seq}, {heads}, {head_dim}]", torch.bfloat16, "fwd 3 axes",
              lambda: PF.rope_qk(q, k, axes, mrope_freq, pair_axis=pair_axis),
              {"one axis": lambda: PF.rope_qk(q, k, positions, inv_freq)}, torch.cat([q, k]), copies=1)
    return table.rows


def bench_cuda_adds(repeat: int, quick: bool) -> List[dict]:
    rows = []
    batch, seq, dim = (4, 1024, 2048) if quick else (8, 4096, 2048)
    inv_freq = posenc.frequencies.sinusoidal(dim).cuda()
    positions = torch.arange(seq, device="cuda")
    sinusoidal, learned = CudaTable("add_sinusoidal", repeat), CudaTable("add_learned", repeat)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(batch, seq, dim, dtype=dtype, device="cuda")
        pe = PF.sinusoidal(positions, inv_freq).to(dtype)
        shape = f"x [{batch}, {seq}, {dim}]"
        eager_sin = lambda: x * 2.0 + pe  # noqa: E731
        sinusoidal.add(shape, dtype, "fwd", lambda: PF.add_sinusoidal(x, None, inv_freq, 2.0),
                       {"eager table+add": eager_sin, "Inductor": torch.compile(eager_sin)}, x, copies=1)
        wpe = torch.randn(seq, dim, dtype=dtype, device="cuda")
        eager_learned = lambda: x + F.embedding(positions, wpe)  # noqa: E731
        learned.add(shape, dtype, "fwd", lambda: PF.add_learned(x, wpe),
                    {"eager x+embedding": eager_learned, "Inductor": torch.compile(eager_learned)}, x, copies=1)
    rows += sinusoidal.rows + learned.rows

    vocab = 32000
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
    fused, backward = CudaTable("embed_learned", repeat), CudaTable("embedding_backward", repeat)
    for dtype in (torch.float32, torch.bfloat16):
        wte, wpe = (torch.randn(vocab, dim, dtype=dtype, device="cuda"),
                    torch.randn(seq, dim, dtype=dtype, device="cuda"))
        out_like = torch.randn(batch, seq, dim, dtype=dtype, device="cuda")
        eager_two = lambda: F.embedding(tokens, wte) + F.embedding(positions, wpe)  # noqa: E731
        fused.add(f"tokens [{batch}, {seq}], V {vocab}, D {dim}", dtype, "fwd", lambda: PF.embed_learned(tokens, wte, wpe),
                  {"eager two lookups": eager_two, "Inductor": torch.compile(eager_two)}, out_like, copies=1)
        grad = torch.randn(batch, seq, dim, dtype=dtype, device="cuda")
        flat_grad, flat_tokens = grad.view(-1, dim), tokens.flatten()
        backward.add(f"grad [{batch}, {seq}, {dim}] -> [{vocab}, {dim}]", dtype, "bwd",
                     lambda: PF.embedding_backward(grad, tokens, vocab),
                     {"eager index_add_ (atomics)": lambda: torch.zeros(vocab, dim, dtype=dtype, device="cuda")
                      .index_add_(0, flat_tokens, flat_grad),
                      "eager embedding bwd": lambda: torch.ops.aten.embedding_dense_backward(grad, tokens, vocab, -1,
                                                                                              False)},
                     grad, copies=1)
    return rows + fused.rows + backward.rows


def bench_cuda_bias(repeat: int, quick: bool) -> List[dict]:
    batch, heads, q_len, k_len = (2, 16, 1024, 1024) if quick else (4, 32, 2048, 2048)
    slopes = PF.alibi_slopes(heads).cuda()
    distance = (torch.arange(k_len, device="cuda")[None, :] - torch.arange(q_len, device="cuda")[:, None]
                - (k_len - q_len)).abs()
    alibi, slope_grad = CudaTable("add_alibi", repeat), CudaTable("alibi_backward", repeat)
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(batch, heads, q_len, k_len, dtype=dtype, device="cuda")
        shape = f"scores [{batch}, {heads}, {q_len}, {k_len}]"
        eager = lambda: scores + (-slopes[:, None, None] * distance).to(dtype)  # noqa: E731
        alibi.add(shape, dtype, "fwd", lambda: PF.add_alibi(scores, slopes, "symmetric"),
                  {"eager bias+add": eager, "Inductor": torch.compile(eager)}, scores, copies=1)
        buffer = scores.clone()
        alibi.add(shape, dtype, "fwd in place", lambda: PF.add_alibi_(buffer, slopes, "symmetric"), {}, scores,
                  copies=1)
        dist = distance.to(dtype)
        eager_grad = lambda: -(scores.sum(0) * dist).sum((1, 2))  # noqa: E731
        slope_grad.add(f"grad [{batch}, {heads}, {q_len}, {k_len}]", dtype, "bwd",
                       lambda: PF.alibi_backward(scores, slopes, "symmetric"),
                       {"eager": eager_grad, "Inductor": torch.compile(eager_grad)})
    t5, t5_backward = CudaTable("t5_bias", repeat), CudaTable("t5_bias_backward", repeat)
    buckets, max_distance = 32, 128
    relative = torch.arange(k_len, device="cuda")[None, :] - torch.arange(q_len, device="cuda")[:, None]
    bucket_ids = PF.relative_position_bucket(relative, True, buckets, max_distance)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(buckets, heads, dtype=dtype, device="cuda")
        out_like = torch.randn(1, heads, q_len, k_len, dtype=dtype, device="cuda")
        eager = lambda: F.embedding(bucket_ids, weight).permute(2, 0, 1).unsqueeze(0)  # noqa: E731
        t5.add(f"bias [1, {heads}, {q_len}, {k_len}]", dtype, "fwd",
               lambda: PF.t5_bias(weight, q_len, k_len, True, buckets, max_distance),
               {"eager buckets+embedding": eager, "Inductor": torch.compile(eager)}, out_like, copies=1)
        grad = torch.randn(1, heads, q_len, k_len, dtype=dtype, device="cuda")
        t5_backward.add(f"grad [1, {heads}, {q_len}, {k_len}]", dtype, "bwd",
                        lambda: PF.t5_bias_backward(grad, True, buckets, max_distance),
                        {"eager embedding bwd": lambda: torch.ops.aten.embedding_dense_backward(
                            grad.squeeze(0).permute(1, 2, 0), bucket_ids, buckets, -1, False)})
    return alibi.rows + slope_grad.rows + t5.rows + t5_backward.rows


def bench_cuda_overhead(repeat: int, quick: bool) -> List[dict]:
    """Small calls, where launches and the checks' one synchronization show: a decoding step's RoPE with and
    without explicit positions (given positions are range-checked on the GPU and read back once)."""
    table = CudaTable("rope_qk decode", repeat)
    inv_freq = posenc.frequencies.rope(128)[0].cuda()
    q, k = torch.randn(8, 1, 32, 128, device="cuda"), torch.randn(8, 1, 8, 128, device="cuda")
    positions = torch.randint(0, 4096, (8, 1), device="cuda")
    calls = 100

    def many(fn):
        return lambda: [fn() for _ in range(calls)]

    table.add(f"q,k [8, 1, 32|8, 128] x{calls}", torch.float32, "fwd", many(lambda: PF.rope_qk(q, k, None, inv_freq, offset=4000)),
              {"with positions": many(lambda: PF.rope_qk(q, k, positions, inv_freq)),
               "torch.add": many(lambda: torch.add(q, q))})
    return table.rows


CUDA_BENCHMARKS = {
    "rope": bench_cuda_rope,
    "adds": bench_cuda_adds,
    "bias": bench_cuda_bias,
    "overhead": bench_cuda_overhead,
    # The CPU benchmarks of the newer families, with the GPU's shapes and table.
    "qk_norm_rope": functools.partial(bench_qk_norm_rope, device="cuda"),
    "sincos_grid": functools.partial(bench_sincos_grid, device="cuda"),
    "resampled_learned": functools.partial(bench_resampled_learned, device="cuda"),
    "dinov3": functools.partial(bench_dinov3, device="cuda"),
}


BENCHMARKS = {
    "rope": bench_rope,
    "qk_norm_rope": bench_qk_norm_rope,
    "rope_qk_cache": bench_rope_qk_cache,
    "mrope": bench_mrope,
    "axial": bench_axial,
    "dinov3": bench_dinov3,
    "sinusoidal": bench_sinusoidal,
    "sincos_grid": bench_sincos_grid,
    "resampled_learned": bench_resampled_learned,
    "embedding": bench_embedding_backward,
    "learned": bench_learned,
    "alibi": bench_alibi,
    "t5": bench_t5,
    "overhead": bench_overhead,
    "model": bench_model,
}


def markdown(rows: List[dict]) -> str:
    """The rows as the README's table: ms medians, baselines as (their time / ours), bounds as (ours / bound)."""
    lines = ["| op | shape | dtype | mode | ours ms | baselines ms (baseline / ours) | copy ms (ours / copy) "
             "| fresh ms (ours / fresh) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "us_per_call" in r:
            parts = "; ".join(f"{name} {us} us" for name, us in r["us_per_call_parts"].items())
            lines.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['mode']} | {r['us_per_call']} us/call "
                         f"| {parts} | | |")
            continue
        baselines = "; ".join(f"{name} {ms:.2f} ({r['speedup'][name]:.2f}x)" for name, ms in r["baselines_ms"].items())
        bounds = [f"{r[b + '_ms']:.2f} ({r['ours_over_' + b]:.2f})" if b + "_ms" in r else "" for b in ("copy", "fresh")]
        lines.append(f"| {r['op']} | {r['shape'].replace('|', chr(92) + '|')} | {r['dtype']} | {r['mode']} "
                     f"| {r['ours_ms']:.2f} | {baselines} | {bounds[0]} | {bounds[1]} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- targets (--check)

# The CPU targets, each a limit on one measure of the rows it selects (op, a piece of the shape, dtype, mode: None
# matches any): ours over the copy bound ("ours_over_copy"), a baseline's time over ours ("speedup:<baseline>",
# > 1: we are faster), or the per-call overhead over torch.add's ("overhead").
TARGETS = [
    ("rope_qk fwd, training shape", dict(op="rope_qk", shape="[4, 2048", mode="fwd"), "ours_over_copy", "<=", 1.10),
    ("rope_qk fwd+bwd, training shape", dict(op="rope_qk", shape="[4, 2048", mode="fwd+bwd"), "ours_over_copy",
     "<=", 1.15),
    ("rope_ in place bf16", dict(op="rope_qk", shape="[4, 2048", dtype="bfloat16", mode="fwd in place"),
     "ours_over_copy", "<=", 1.0),
    ("M-RoPE fwd", dict(op="rope_qk mrope", mode="fwd"), "ours_over_copy", "<=", 1.2),
    ("qk_norm_rope against HF eager", dict(op="qk_norm_rope"), "speedup:HF eager", ">=", 3.0),
    ("qk_norm_rope against HF compile", dict(op="qk_norm_rope"), "speedup:HF compile", ">=", 1.0),
    ("qk_norm_rope over the copy", dict(op="qk_norm_rope"), "ours_over_copy", "<=", 1.3),
    ("axial / Flux gptj fwd", dict(op="rope_qk axial", mode="fwd"), "ours_over_copy", "<=", 1.2),
    ("add_sinusoidal fwd, fwd+bwd", dict(op="add_sinusoidal"), "ours_over_copy", "<=", 1.2),
    ("add_sinusoidal batch 1 against eager", dict(op="add_sinusoidal batch 1"), "speedup:eager table+add", ">=",
     1.0),
    ("sincos grids against diffusers eager", dict(op="add_sinusoidal grid"), "speedup:diffusers table+add", ">=",
     2.0),
    ("sincos grids fwd", dict(op="add_sinusoidal grid", mode="fwd"), "ours_over_copy", "<=", 1.3),
    ("resampled tables against HF eager", dict(op="add_resampled_learned"), "speedup:HF eager", ">=", 2.0),
    ("resampled tables over the copy", dict(op="add_resampled_learned"), "ours_over_copy", "<=", 1.3),
    ("DINOv3 rope against HF eager", dict(op="rope_qk dinov3"), "speedup:HF eager", ">=", 2.0),
    ("DINOv3 rope fwd", dict(op="rope_qk dinov3", mode="fwd"), "ours_over_copy", "<=", 1.3),
    ("embed_sinusoidal fwd bf16", dict(op="embed_sinusoidal", dtype="bfloat16", mode="fwd"), "ours_over_copy", "<=",
     1.3),
    ("embed_learned fwd bf16", dict(op="embed_learned", dtype="bfloat16", mode="fwd"), "ours_over_copy", "<=", 1.3),
    ("add_learned fwd fp32 against eager", dict(op="add_learned", dtype="float32", mode="fwd"),
     "speedup:eager x+embedding", ">=", 1.2),
    ("add_learned fwd fp32", dict(op="add_learned", dtype="float32", mode="fwd"), "ours_over_copy", "<=", 1.2),
    ("per-call overhead against torch.add", dict(op="overhead"), "overhead", "<=", 1.2),
    ("decode rope_qk [8, 1, 32, 128] fwd", dict(op="rope_qk", shape="[8, 1, 32", mode="fwd"), "ours_over_copy", "<=",
     1.5),
    ("decode rope_qk [8, 1, 32, 128] fwd+bwd", dict(op="rope_qk", shape="[8, 1, 32", mode="fwd+bwd"),
     "ours_over_copy", "<=", 2.5),
]


def measure(row: dict, what: str) -> Optional[float]:
    if what == "overhead":
        parts = row.get("us_per_call_parts", {})
        return row["us_per_call"] / parts["torch.add"] if "torch.add" in parts else None
    if what.startswith("speedup:"):
        return row.get("speedup", {}).get(what.split(":", 1)[1])
    return row.get(what)


def floor_of(row: dict, what: str) -> Optional[Tuple[str, float]]:
    """The row's floor baseline (FLOORS) in the target's measure, where the row has one and the measure is a
    ratio to a bound: how low any op could go in this run."""
    if what == "overhead":
        parts = row.get("us_per_call_parts", {})
        return (OPS_FLOOR, parts[OPS_FLOOR] / parts["torch.add"]) if OPS_FLOOR in parts else None
    if what == "ours_over_copy":
        for name in FLOORS:
            if name in row.get("baselines_ms", {}):
                return name, row["baselines_ms"][name] / row["copy_ms"]
    return None


def check(rows: List[dict]) -> List[str]:
    """One line per target and dtype: the measured values of the rows it selects, met or missed, and the row's
    floor in the same measure where it has one."""
    lines = []
    for name, select, what, relation, limit in TARGETS:
        chosen = [r for r in rows if r["op"] == select["op"] and select.get("shape", "") in r["shape"]
                  and select.get("dtype") in (None, r["dtype"]) and select.get("mode") in (None, r["mode"])]
        # A row without the measure (an in-place row has no eager baseline to be faster than) is not the target's.
        measured = [(row, measure(row, what)) for row in chosen if measure(row, what) is not None]
        if not measured:
            lines.append(f"{name:<42} {relation} {limit:<5} not measured in this run")
            continue
        for row, value in measured:
            met = value <= limit if relation == "<=" else value >= limit
            line = (f"{name:<42} {relation} {limit:<5} {row['dtype']:<9} {row['mode']:<12} {value:>6.2f}  "
                    + ("met" if met else "MISSED"))
            below = floor_of(row, what)
            if below is not None:
                line += f"  (floor {below[1]:.2f}: {below[0]})"
            lines.append(line)
    return lines


def copy_bandwidth() -> float:
    """GB/s (bytes read + written) of out.copy_(x) on 64 MiB float32 buffers, past the last-level cache of the
    machines here: the state of the memory at that moment, which moves every row's copy bound between runs and
    within one (docs/benchmarks.md, "The copy's two states"). Printed at a CPU run's start and end."""
    x = torch.ones(16 * 2**20)
    out = torch.empty_like(x)
    times = []
    for _ in range(9):
        start = time.perf_counter()
        out.copy_(x)
        times.append(time.perf_counter() - start)
    return 2 * x.numel() * x.element_size() / statistics.median(times) / 1e9


def write_json(args, rows: List[dict], copy_gbps: Optional[List[float]] = None) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "device": args.device,
                       "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                       "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
                       "reuse_memory": args.reuse_memory, "cold": args.cold, "copy_gbps": copy_gbps or [],
                       "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", help="comma-separated: " + ",".join(BENCHMARKS) + " (with --device cuda: "
                        + ",".join(CUDA_BENCHMARKS) + "); default all. --ops rope_qk_cache: the cached decode "
                        "step (rope_qk_cache_ against Hugging Face's rotary + StaticCache.update, batch 1-8)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the GPU benchmark (its own shapes and baselines, CUDA-event timing)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument("--models", help="with --ops model: comma-separated, of " + ",".join(MODEL_FAMILIES)
                        + "; default all")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--no-thp", action="store_true", help="do not set THP_MEM_ALLOC_ENABLE=1")
    parser.add_argument("--markdown", help="also write the rows as a markdown table to this file")
    parser.add_argument("--from-json", help="format the rows of an earlier --json run instead of measuring")
    parser.add_argument("--check", action="store_true",
                        help="after the rows, each CPU target (TARGETS) with its measured ratio and met/missed")
    parser.add_argument("--reuse-memory", action="store_true",
                        help="keep freed memory mapped, so that no allocation pays page faults (glibc only)")
    parser.add_argument("--fp16", action="store_true",
                        help="float16 rows too, for rope, qk_norm_rope and the additive families (sinusoidal, "
                        "sincos_grid, resampled_learned, learned)")
    parser.add_argument("--cold", action="store_true",
                        help="before every timed call, read a buffer twice the last-level cache: each call starts "
                        "with none of its data cached, whatever ran before it")
    args = parser.parse_args()
    if args.cold:
        if args.device == "cuda":
            parser.error("--cold evicts the CPU's last-level cache; the CUDA benchmark times on the GPU")
        global COLD_BUFFER
        COLD_BUFFER = torch.ones(2 * last_level_cache_bytes() // 4)
    if args.models:
        global MODELS
        MODELS = args.models.split(",")
    if args.fp16:
        global FP16
        FP16 = True
    if args.reuse_memory:
        global REUSE_MEMORY
        REUSE_MEMORY = True
        reuse_memory()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}, posenc {posenc.library_path}"
          + (", --reuse-memory" if args.reuse_memory else "") + (", --cold" if args.cold else "")
          + (", --fp16" if args.fp16 else ""))
    rows = []
    copy_gbps = []  # the memory's state: copy_bandwidth() at a CPU run's start and end
    if args.device == "cpu" and not args.from_json:
        copy_gbps.append(copy_bandwidth())
        print(f"copy from memory at the start: {copy_gbps[0]:.0f} GB/s")
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)["rows"]
    else:
        benchmarks = CUDA_BENCHMARKS if args.device == "cuda" else BENCHMARKS
        failed = []
        for name in (args.ops or ",".join(benchmarks)).split(","):
            if args.device == "cpu":
                rows += benchmarks[name](args.repeat, args.quick)
                continue
            try:  # one GPU run answers as much as it can: a failing group is reported, the others still run
                rows += benchmarks[name](args.repeat, args.quick)
            except Exception:  # noqa: BLE001
                import traceback
                traceback.print_exc()
                failed.append(name)
            write_json(args, rows)  # the groups so far, should the run be cut short
    if copy_gbps:
        copy_gbps.append(copy_bandwidth())
        print(f"copy from memory at the end: {copy_gbps[1]:.0f} GB/s (at the start: {copy_gbps[0]:.0f})")
    if args.check:
        print("\n== targets (from the rows above" + ("" if args.reuse_memory else "; they are set for the kernels "
              "alone: run with --reuse-memory") + ("; measured --cold, where they are set on rows timed without it"
                                                  if args.cold else "") + ")")
        print("\n".join(check(rows)))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows))
    write_json(args, rows, copy_gbps)
    if not args.from_json and args.device == "cuda" and failed:
        return f"bench.py: the {', '.join(failed)} benchmarks failed (tracebacks above)"


if __name__ == "__main__":
    sys.exit(main())
