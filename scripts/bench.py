"""Benchmarks posenc's ops against the paths users run today, as ratios measured in the same run.

    python scripts/bench.py [--ops sinusoidal,embedding,...] [--repeat 10] [--json bench.json] [--quick]

For every op and shape: our median time, each baseline's median time and its ratio to ours (> 1: we are
faster), and the copy bound: the same bytes moved by `out.copy_(x)` (one copy for a forward pass, two for
forward + backward), with our time over it. Uses every thread of the machine (torch.get_num_threads()).

Every op that returns a fresh tensor (ours and the baselines alike) pays for the kernel zeroing the pages
it first touches; with 4 KiB pages that alone costs about as much as the copy on this machine (a fresh
33 MB output: 45 ms against 16 ms for a copy into a reused buffer). The benchmark therefore sets
THP_MEM_ALLOC_ENABLE=1 (PyTorch's CPU allocator then asks for transparent huge pages), which serves every
contender equally; --no-thp measures with 4 KiB pages.
"""
import os

if "--no-thp" not in os.sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse
import json
import math
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import posenc
from posenc import functional as PF


def median_ms(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def copy_ms(reference: torch.Tensor, copies: int, repeat: int) -> float:
    """The copy bound: `copies` copies of `reference` into a buffer allocated once."""
    out = torch.empty_like(reference)
    return median_ms(lambda: [out.copy_(reference) for _ in range(copies)], repeat)


def alloc_copy_ms(reference: torch.Tensor, copies: int, repeat: int) -> float:
    """The same copies into fresh tensors, as an op that returns a new tensor must do."""
    return median_ms(lambda: [torch.empty_like(reference).copy_(reference) for _ in range(copies)], repeat)


def leaves(outputs) -> List[torch.Tensor]:
    """The leaf tensors an autograd graph accumulates into."""
    found, seen = [], set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            found.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def backward(outputs, grads) -> None:
    """A training step's backward: gradients of every leaf, computed fresh (as after zero_grad(set_to_none))."""
    torch.autograd.grad(outputs, leaves(outputs), grads)


def fwd_bwd(forward: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    def run():
        backward([forward()], [grad])
    return run


class Table:
    """Rows of one op: ours against named baselines and the copy bound."""

    def __init__(self, op: str, repeat: int):
        self.op, self.repeat, self.rows = op, repeat, []

    def add(self, shape: str, dtype: torch.dtype, mode: str, ours: Callable, baselines: Dict[str, Callable],
            copy_reference: Optional[torch.Tensor] = None, copies: int = 1, **extra):
        row = {"op": self.op, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "mode": mode,
               "ours_ms": median_ms(ours, self.repeat), "baselines_ms": {}, "speedup": {}}
        for name, fn in baselines.items():
            row["baselines_ms"][name] = median_ms(fn, self.repeat)
            row["speedup"][name] = row["baselines_ms"][name] / row["ours_ms"]
        if copy_reference is not None:
            row["copy_ms"] = copy_ms(copy_reference, copies, self.repeat)
            row["ours_over_copy"] = row["ours_ms"] / row["copy_ms"]
            row["alloc_copy_ms"] = alloc_copy_ms(copy_reference, copies, self.repeat)
        row.update(extra)
        self.rows.append(row)
        print(format_row(row), flush=True)


def format_row(row) -> str:
    parts = [f"{row['op']:<22} {row['shape']:<28} {row['dtype']:<9} {row['mode']:<8} ours {row['ours_ms']:8.2f} ms"]
    for name, ms in row["baselines_ms"].items():
        parts.append(f"{name} {ms:8.2f} ms ({row['speedup'][name]:5.2f}x)")
    if "copy_ms" in row:
        parts.append(f"copy {row['copy_ms']:7.2f} ms (ours/copy {row['ours_over_copy']:4.2f}) "
                     f"alloc+copy {row['alloc_copy_ms']:7.2f} ms")
    for key in ("saved_bytes", "baseline_saved_bytes", "us_per_call"):
        if key in row:
            parts.append(f"{key} {row[key]}")
    return " | ".join(parts)


# ---------------------------------------------------------------- sinusoidal and the shared embedding backward

def bench_sinusoidal(repeat: int, quick: bool) -> List[dict]:
    table = Table("add_sinusoidal", repeat)
    batch, seq, dim = (2, 512, 1024) if quick else (8, 2048, 1024)
    inv_freq = posenc.frequencies.sinusoidal(dim)
    cached = PF.sinusoidal(torch.arange(seq), inv_freq)  # the eager path's cached table
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(batch, seq, dim, dtype=dtype)
        pe = cached.to(dtype)
        table.add(f"x [{batch}, {seq}, {dim}]", dtype, "fwd", lambda: PF.add_sinusoidal(x, None, inv_freq, 2.0),
                  {"eager table+add": lambda: x * 2.0 + pe}, x, copies=1)
        xg = x.clone().requires_grad_()
        grad = torch.randn_like(x)
        table.add(f"x [{batch}, {seq}, {dim}]", dtype, "fwd+bwd",
                  fwd_bwd(lambda: PF.add_sinusoidal(xg, None, inv_freq, 2.0), grad),
                  {"eager table+add": fwd_bwd(lambda: xg * 2.0 + pe, grad)}, x, copies=2)

    fused = Table("embed_sinusoidal", repeat)
    vocab = 32000
    tokens = torch.randint(0, vocab, (batch, seq))
    positions = torch.arange(seq)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(vocab, dim, dtype=dtype)
        pe = cached.to(dtype)
        out_like = torch.empty(batch, seq, dim, dtype=dtype)
        fused.add(f"tokens [{batch}, {seq}], V {vocab}, D {dim}", dtype, "fwd",
                  lambda: PF.embed_sinusoidal(tokens, weight, None, inv_freq, 32.0),
                  {"eager two lookups": lambda: F.embedding(tokens, weight) * 32.0 + F.embedding(positions, pe)},
                  out_like, copies=1)
    return table.rows + fused.rows


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
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(batch, seq, dim, dtype=dtype)
        wpe = torch.randn(seq, dim, dtype=dtype)
        table.add(f"x [{batch}, {seq}, {dim}]", dtype, "fwd", lambda: PF.add_learned(x, wpe),
                  {"eager x+embedding": lambda: x + F.embedding(positions, wpe)}, x, copies=1)
        xg, wg = x.clone().requires_grad_(), wpe.clone().requires_grad_()
        grad = torch.randn_like(x)
        table.add(f"x [{batch}, {seq}, {dim}]", dtype, "fwd+bwd", fwd_bwd(lambda: PF.add_learned(xg, wg), grad),
                  {"eager x+embedding": fwd_bwd(lambda: xg + F.embedding(positions, wg), grad)}, x, copies=2)

    fused = Table("embed_learned", repeat)
    tokens = torch.randint(0, vocab, (batch, seq))
    for dtype in (torch.float32, torch.bfloat16):
        wte, wpe = torch.randn(vocab, dim, dtype=dtype), torch.randn(seq, dim, dtype=dtype)
        out_like = torch.empty(batch, seq, dim, dtype=dtype)
        fused.add(f"tokens [{batch}, {seq}], V {vocab}, D {dim}", dtype, "fwd", lambda: PF.embed_learned(tokens, wte, wpe),
                  {"eager two lookups": lambda: F.embedding(tokens, wte) + F.embedding(positions, wpe)},
                  out_like, copies=1)
        wte_g, wpe_g = wte.clone().requires_grad_(), wpe.clone().requires_grad_()
        grad = torch.randn_like(out_like)
        fused.add(f"tokens [{batch}, {seq}], V {vocab}, D {dim}", dtype, "fwd+bwd",
                  fwd_bwd(lambda: PF.embed_learned(tokens, wte_g, wpe_g), grad),
                  {"eager two lookups": fwd_bwd(lambda: F.embedding(tokens, wte_g) + F.embedding(positions, wpe_g), grad)})
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
        table.add(shape, dtype, "fwd+bwd", fwd_bwd(lambda: PF.add_alibi(sg, mg, "symmetric"), grad),
                  {"eager bias+add": fwd_bwd(lambda: sg + (-mg.to(dtype)[:, None, None] * dist), grad)}, scores, copies=2)
    return table.rows


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
        out_like = torch.empty(1, heads, q_len, k_len, dtype=dtype)
        shape = f"bias [1, {heads}, {q_len}, {k_len}]"
        table.add(shape, dtype, "fwd", lambda: PF.t5_bias(weight, q_len, k_len, True, buckets, distance),
                  {"eager bucket+embedding": lambda: eager_t5_bias(weight, q_len, k_len, buckets, distance)},
                  out_like, copies=1)
        wg = weight.clone().requires_grad_()
        grad = torch.randn_like(out_like)
        table.add(shape, dtype, "fwd+bwd", fwd_bwd(lambda: PF.t5_bias(wg, q_len, k_len, True, buckets, distance), grad),
                  {"eager bucket+embedding": fwd_bwd(lambda: eager_t5_bias(wg, q_len, k_len, buckets, distance), grad)},
                  out_like, copies=2)
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
        for dtype in (torch.float32, torch.bfloat16):
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
            table.add(shape, dtype, "fwd", lambda: PF.rope_qk(q, k, pos, inv_freq), baselines, both, copies=1)

            qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
            grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)

            def train(fn):
                def run():
                    backward(list(fn()), [grad_q, grad_k])
                return run

            ours = lambda: PF.rope_qk(qg, kg, pos, inv_freq)  # noqa: E731
            hf_eager = lambda: hf(qg, kg)  # noqa: E731
            table.add(shape, dtype, "fwd+bwd", train(ours),
                      {"HF eager": train(hf_eager), "HF compile": train(lambda: hf(qg, kg, hf_compiled))}, both,
                      copies=2, saved_bytes=saved_bytes(ours), baseline_saved_bytes=saved_bytes(hf_eager))
    return table.rows


def bench_overhead(repeat: int, quick: bool) -> List[dict]:
    """Per-call overhead through torch.ops on a tiny input."""
    table = Table("overhead", repeat)
    x = torch.randn(1, 1, 8)
    inv_freq = posenc.frequencies.sinusoidal(8)
    calls = 2000

    def many(fn):
        return lambda: [fn() for _ in range(calls)]

    ours = median_ms(many(lambda: torch.ops.posenc.add_sinusoidal(x, None, inv_freq)), repeat)
    add = median_ms(many(lambda: torch.add(x, x)), repeat)
    row = {"op": "overhead", "shape": "x [1, 1, 8]", "dtype": "float32", "mode": "fwd",
           "ours_ms": ours / calls, "baselines_ms": {"torch.add": add / calls},
           "speedup": {"torch.add": add / ours}, "us_per_call": round(ours / calls * 1e3, 2)}
    table.rows.append(row)
    print(format_row(row), flush=True)
    return table.rows


BENCHMARKS = {
    "rope": bench_rope,
    "sinusoidal": bench_sinusoidal,
    "embedding": bench_embedding_backward,
    "learned": bench_learned,
    "alibi": bench_alibi,
    "t5": bench_t5,
    "overhead": bench_overhead,
}


def markdown(rows: List[dict]) -> str:
    """The rows as the README's table: ms medians, baselines as (their time / ours)."""
    lines = ["| op | shape | dtype | mode | ours ms | baselines ms (baseline / ours) | copy ms (ours / copy) | alloc+copy ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        baselines = "; ".join(f"{name} {ms:.2f} ({r['speedup'][name]:.2f}x)" for name, ms in r["baselines_ms"].items())
        copy = f"{r['copy_ms']:.2f} ({r['ours_over_copy']:.2f})" if "copy_ms" in r else ""
        alloc = f"{r['alloc_copy_ms']:.2f}" if "alloc_copy_ms" in r else ""
        ours = f"{r['us_per_call']} us/call" if "us_per_call" in r else f"{r['ours_ms']:.2f}"
        lines.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['mode']} | {ours} | {baselines} | {copy} | {alloc} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(BENCHMARKS), help="comma-separated: " + ",".join(BENCHMARKS))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--no-thp", action="store_true", help="do not set THP_MEM_ALLOC_ENABLE=1")
    parser.add_argument("--markdown", help="also write the rows as a markdown table to this file")
    parser.add_argument("--from-json", help="format the rows of an earlier --json run instead of measuring")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}, posenc {posenc.library_path}")
    rows = []
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)["rows"]
    else:
        for name in args.ops.split(","):
            rows += BENCHMARKS[name](args.repeat, args.quick)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
