"""Train short, test long: which positional encoding should a language model train with?

One small causal byte-level transformer, trained once per encoding at one sequence length, then evaluated
on held-out text at 1x, 2x, 4x, 8x and 16x that length (the experiment of Press, Smith and Lewis, "Train
Short, Test Long", ICLR 2022). Every position the models see comes from posenc:

    none        no positional information at all (NoPE): causal attention alone
    sinusoidal  embed_sinusoidal: token lookup and the fixed sinusoidal encoding in one op
    learned     embed_learned: token lookup plus a trained table of train_len positions (GPT-2)
    rotary      rope_qk on the queries and keys (RoPE)
    rotary+ntk  the same rotary model, evaluated with dynamic NTK scaling past the training length
    alibi       add_alibi_ on the attention mask: a linear penalty on distance (fixed slopes)
    t5          t5_bias: one learned bias per head and distance bucket, shared by the layers

Attention is torch.nn.functional.scaled_dot_product_attention; ALiBi and T5 pass their bias, with the
causal -inf above the diagonal, as its float attn_mask.

The text ships with Python (pydoc's topic help and the standard library's top-level modules), read at run
time; ``--data FILE`` trains on any file instead. Results go to one folder: the table (printed, CSV, JSON),
a plot, the settings, and the best long-context model exported with TorchScript and torch.export for the
C++ program in scripts/study_cpp, which also decodes greedily with key/value caches (``decode_step``, whose
attention layers write their caches with posenc's ``rope_qk_cache_``).

    python scripts/study.py [--out build/study] [--preset default|quick|large] [--steps N] ...
    torchrun --standalone --nproc_per_node 2 scripts/study.py ...      (DistributedDataParallel over gloo)
"""
# A program beside the library, not part of the posenc package: only it needs matplotlib and tqdm.
import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import posenc

ENCODINGS = ("none", "sinusoidal", "learned", "rotary", "alibi", "t5")
ROTARY_SCALED = "rotary+ntk"  # evaluation-time variant of the rotary model, not trained on its own
VOCAB = 256  # bytes
BLOCK = 16384  # the corpus is cut into blocks of this many bytes; every tenth block is held out
HELD_OUT_EVERY = 10

# Sizes of the run. "default" is the demo's (about 4 minutes of 2 cores, 10 with a cold setup); "quick" is for
# tests; "large" is a longer, larger run (about 15 times the default's work) at the same training length.
PRESETS: Dict[str, Dict[str, float]] = {
    "quick": dict(dim=32, layers=1, heads=2, train_len=16, batch=8, steps=12, lr=3e-3, eval_chunks=4),
    "default": dict(dim=128, layers=3, heads=4, train_len=64, batch=32, steps=400, lr=2e-3, eval_chunks=32),
    "large": dict(dim=192, layers=4, heads=6, train_len=64, batch=32, steps=2000, lr=1.5e-3, eval_chunks=64),
}


def describe(preset: Dict[str, float]) -> str:
    return (f"{preset['layers']} x {preset['dim']}, {preset['heads']} heads, {preset['steps']} steps of "
            f"{preset['batch']} x {preset['train_len']} bytes")


# ---------------------------------------------------------------- the model

class NoRotation(torch.nn.Module):
    """The rotary slot of an attention layer for encodings that do not rotate q and k; the rotary encoding fills
    it with posenc.nn.RotaryEmbedding (``rope_qk`` at positions 0..S-1, frequencies from posenc.frequencies).

    For cached decoding it has the attributes of RotaryEmbedding that ``Attention.decode`` reads, with zero
    frequencies: angle 0 (cos 1, sin 0) leaves q and k as they are, bit for bit, so ``rope_qk_cache_`` only
    writes the caches."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.inv_freq = torch.zeros(head_dim // 2, dtype=torch.float64)
        self.attention_scale, self.layout, self.length_dependent = 1.0, "neox", False

    def inv_freq_for(self, q: Tensor, positions: Optional[Tensor] = None, offset: int = 0) -> Tensor:
        return self.inv_freq

    def forward(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
        return q, k


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int, rotation: torch.nn.Module):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.rotation = rotation

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        q, k = self.rotation(q, k)  # rope_qk on bshd, or nothing
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))

    def decode(self, x: Tensor, mask: Optional[Tensor], start: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """``forward`` for the tokens at positions start..start+S-1 of x [B, S, dim]: writes their keys and values
        into the caches [B, H, S_max, D] (slots start..start+S-1) and attends over slots 0..start+S-1."""
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        end = start + length
        rotation = self.rotation
        # q rotated in place; k rotated into its cache and v copied into its own, in one pass.
        torch.ops.posenc.rope_qk_cache_(q, k, v, k_cache, v_cache, None, rotation.inv_freq_for(q, None, start), None,
                                        "bhsd", rotation.attention_scale, rotation.layout, "bshd", start)
        # Without a bias: the prompt at start 0 is square (SDPA's is_causal), and one new token sees every key.
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :, :end], v_cache[:, :, :end],
                                           attn_mask=mask, is_causal=mask is None and start == 0)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, rotation: torch.nn.Module):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim)
        self.attention = Attention(dim, heads, rotation)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        x = x + self.attention(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))

    def decode(self, x: Tensor, mask: Optional[Tensor], start: int, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        x = x + self.attention.decode(self.norm1(x), mask, start, k_cache, v_cache)
        return x + self.mlp(self.norm2(x))


def causal_mask(length: int, heads: int, device: torch.device, start: int = 0) -> Tensor:
    """``[1, heads, length - start, length]`` float mask of the queries at positions start..length-1 over the keys
    at 0..length-1: 0 where the key is not after the query, -inf where it is."""
    mask = torch.full((length - start, length), float("-inf"), device=device).triu(start + 1)
    return mask.expand(1, heads, length - start, length).contiguous()


class TokenEmbedding(torch.nn.Module):
    """Token lookup without positions (none, rotary, alibi, t5); N(0, 0.02^2) as GPT-2's wte."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, dim) * 0.02)

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:  # offset: the cache's length, no position here
        return F.embedding(tokens, self.weight)


class SinusoidalTokens(torch.nn.Module):
    """``embed_sinusoidal``: the paper's recipe, token rows N(0, 1/dim) scaled by sqrt(dim), plus PE."""

    def __init__(self, dim: int):
        super().__init__()
        self.embed = posenc.nn.SinusoidalEmbedding(VOCAB, dim)

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        return self.embed(tokens, None, offset)


class LearnedTokens(torch.nn.Module):
    """``embed_learned``: GPT-2's wte + wpe, both N(0, 0.02^2); wpe has train_len rows, no more."""

    def __init__(self, dim: int, max_positions: int):
        super().__init__()
        self.embed = posenc.nn.LearnedEmbedding(VOCAB, max_positions, dim)

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        return self.embed(tokens, None, offset)


class NoBias(torch.nn.Module):
    """Encodings without an attention bias: plain causal attention (SDPA's is_causal).

    Every bias module's ``forward(length, device, start)`` gives the mask of the queries at positions
    start..length-1 over the keys at 0..length-1: start 0 for a forward, the cache's length when decoding."""

    def forward(self, length: int, device: torch.device, start: int = 0) -> Optional[Tensor]:
        if start == 0 or length - start == 1:
            return None
        return causal_mask(length, 1, device, start)  # several new tokens after a cache


class AlibiBias(torch.nn.Module):
    """The causal mask with ALiBi's -m * (i - j) added in place (``add_alibi_``); fixed slopes."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads
        self.register_buffer("slopes", posenc.functional.alibi_slopes(heads), persistent=False)

    def forward(self, length: int, device: torch.device, start: int = 0) -> Optional[Tensor]:
        mask = causal_mask(length, self.heads, device, start)
        torch.ops.posenc.add_alibi_(mask, self.slopes, "causal", 0)  # bottom-right aligned: query i at start + i
        return mask


class T5Bias(torch.nn.Module):
    """The causal mask plus T5's learned bucket bias (``t5_bias``), one table shared by all layers as in T5.

    T5's defaults (32 buckets up to distance 128) suit 512-token training; here the log-spaced buckets end at
    half the training length, so that every bucket, the last one (all longer distances) included, is trained.
    The table starts at zero (every head begins as plain causal attention) and trains with a larger learning
    rate (``LR_SCALE``): Adam moves each entry by about the learning rate per step, and a bias must reach
    several units to shape attention within the few hundred steps of a short run.
    """

    LR_SCALE = 20.0

    def __init__(self, heads: int, max_distance: int, num_buckets: int = 32):
        super().__init__()
        self.heads, self.num_buckets, self.max_distance = heads, num_buckets, max_distance
        self.weight = torch.nn.Parameter(torch.zeros(num_buckets, heads))

    def forward(self, length: int, device: torch.device, start: int = 0) -> Optional[Tensor]:
        bias = torch.ops.posenc.t5_bias(self.weight, length - start, length, False, self.num_buckets,
                                        self.max_distance, start)
        return bias + causal_mask(length, self.heads, device, start)


class ByteLM(torch.nn.Module):
    """A pre-norm causal transformer over bytes: ``forward(tokens [B, S] int64) -> logits [B, S, 256]``, and
    ``decode_step``, the same logits through key/value caches (TorchScript methods both)."""

    def __init__(self, encoding: str, dim: int, layers: int, heads: int, train_len: int,
                 rotary_scaling: Optional[Dict[str, float]] = None):
        super().__init__()
        if encoding not in ENCODINGS:
            raise ValueError(f"study: encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        if dim % heads:
            raise ValueError(f"study: dim {dim} is not a multiple of heads {heads}")
        self.encoding = encoding
        if encoding == "sinusoidal":
            self.embed: torch.nn.Module = SinusoidalTokens(dim)
        elif encoding == "learned":
            self.embed = LearnedTokens(dim, train_len)
        else:
            self.embed = TokenEmbedding(dim)
        if encoding == "alibi":
            self.bias: torch.nn.Module = AlibiBias(heads)
        elif encoding == "t5":
            # 32 causal buckets: 16 exact distances, then log-spaced ones up to max_distance (at least 17).
            self.bias = T5Bias(heads, max(train_len // 2, 17))
        else:
            self.bias = NoBias()

        def rotation() -> torch.nn.Module:
            if encoding == "rotary":
                return posenc.nn.RotaryEmbedding(dim // heads, scaling=rotary_scaling)
            return NoRotation(dim // heads)

        self.blocks = torch.nn.ModuleList([Block(dim, heads, rotation()) for _ in range(layers)])
        # Dynamic NTK's frequencies depend on the length: at every step every key of every layer would change, so
        # a cache cannot hold them (Hugging Face's caches keep the stale keys); that model decodes without one.
        self.cached_decoding = not self.blocks[0].attention.rotation.length_dependent
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        mask = self.bias(tokens.size(1), tokens.device)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))

    @torch.jit.export
    def cache_shape(self) -> List[int]:
        """[layers, heads, head_dim]: ``decode_step`` takes, per layer, caches of zeros [B, heads, S_max, head_dim]."""
        attention = self.blocks[0].attention
        return [len(self.blocks), attention.heads, attention.qkv.in_features // attention.heads]

    @torch.jit.export
    def decode_step(self, tokens: Tensor, start: int, k_caches: List[Tensor], v_caches: List[Tensor]) -> Tensor:
        """The logits ``[B, S, 256]`` that ``forward`` gives the tokens at positions start..start+S-1 of a sequence
        whose first ``start`` positions are in the caches; writes the keys and values of ``tokens [B, S]`` there.
        Greedy decoding: the prompt at start 0, then one token per call. Inference only (``rope_qk_cache_``)."""
        if not self.cached_decoding:
            raise RuntimeError("study: decode_step: rotary frequencies that depend on the length (dynamic NTK) "
                               "change every cached key at every step")
        x = self.embed(tokens, start)
        mask = self.bias(start + tokens.size(1), tokens.device, start)
        for i, block in enumerate(self.blocks):
            x = block.decode(x, mask, start, k_caches[i], v_caches[i])
        return self.head(self.norm(x))


def dynamic_ntk(train_len: int) -> Dict[str, float]:
    """Dynamic NTK scaling (Hugging Face's "dynamic" rope type): the trained frequencies up to train_len, then
    base * (L / train_len) ** (d / (d - 2)) for a sequence of L > train_len tokens, recomputed per call."""
    return {"rope_type": "dynamic", "factor": 1.0, "max_position_embeddings": float(train_len)}


# ---------------------------------------------------------------- the text

def python_corpus() -> Tuple[bytes, str]:
    """pydoc's topic help (English prose about Python) and the standard library's top-level modules (code),
    both part of every Python installation, in a fixed order."""
    import pydoc_data.topics

    parts = [pydoc_data.topics.topics[key].encode() for key in sorted(pydoc_data.topics.topics)]
    prose = sum(map(len, parts))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(stdlib.glob("*.py"))
    parts += [path.read_bytes() for path in modules]
    text = b"\n\n".join(parts)
    return text, (f"Python {platform.python_version()}: pydoc_data.topics ({prose} bytes of prose) and "
                  f"{len(modules)} top-level modules of {stdlib} ({len(text) - prose} bytes of code)")


def split(text: bytes) -> Tuple[Tensor, Tensor]:
    """Blocks of 16 KiB, every tenth held out (block index % 10 == 9): both halves sample the whole text."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    blocks = list(data.split(BLOCK))
    held = [b for i, b in enumerate(blocks) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [b for i, b in enumerate(blocks) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    if not held:
        raise ValueError(f"study: the text has {len(text)} bytes, too few for a held-out part "
                         f"(every {HELD_OUT_EVERY}th block of {BLOCK} bytes); give at least {HELD_OUT_EVERY * BLOCK}")
    return torch.cat(train).long(), torch.cat(held).long()


def eval_chunks(held_out: Tensor, count: int, span: int) -> Tensor:
    """``count`` chunks of ``span + 1`` bytes spread evenly over the held-out text, ``[count, span + 1]``.

    Every evaluation length L cuts each chunk into span / L windows of L inputs and L targets, so every
    length predicts the same span * count bytes; only the context before each prediction differs."""
    if held_out.numel() < count * (span + 1):
        raise ValueError(f"study: {held_out.numel()} held-out bytes cannot give {count} chunks of {span + 1}")
    starts = torch.linspace(0, held_out.numel() - span - 1, count).long()
    return torch.stack([held_out[s:s + span + 1] for s in starts.tolist()])


# ---------------------------------------------------------------- processes

class Processes:
    """This process's place among ``torchrun``'s processes (rank, world size); one process by default."""

    def __init__(self, rank: int = 0, world: int = 1, threads: int = 0):
        self.rank, self.world, self.threads = rank, world, threads

    @classmethod
    def start(cls, threads: Optional[int] = None) -> "Processes":
        """Joins torchrun's process group (gloo) when there is one, and gives this process ``threads`` threads,
        by default its share of the cores: all of them for one process, cores / processes per node under
        torchrun."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if world > 1:
            dist.init_process_group("gloo")
        threads = threads or max(1, (os.cpu_count() or 1) // local)
        torch.set_num_threads(threads)
        return cls(rank, world, threads)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, *values: float) -> List[float]:
        """Sums over processes (float64, the same on every process)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    def close(self) -> None:
        """Leaves the process group once every process has reached here."""
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()

    def exit(self) -> None:
        """Ends a process of several without finalizing the interpreter. DistributedDataParallel keeps the gloo
        process group alive past destroy_process_group, and its worker threads can still be releasing a finished
        collective's tensors while the interpreter finalizes: they then need the GIL and abort the process
        (SIGABRT, "terminate called without an active exception"; 4 of 30 runs of two processes on a loaded
        2-core machine, 1 of 30 with the barrier of close). Everything is written by then."""
        if self.world > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def bits_per_byte(total_nats: float, count: float) -> float:
    return total_nats / count / math.log(2)


def train(model: ByteLM, data: Tensor, args: argparse.Namespace, procs: Processes, desc: str) -> Dict[str, object]:
    """AdamW with warmup and cosine decay. Step t draws a global batch of windows from a generator seeded with
    (seed, t), the same for every encoding and process; each process reads only its own rows of it, and
    DistributedDataParallel averages the gradients, so W processes compute what one process computes."""
    from tqdm import tqdm

    local = args.batch // procs.world
    rows = slice(procs.rank * local, (procs.rank + 1) * local)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if procs.world > 1 else model
    # Weight decay on the matrices of the layers; none on embeddings, norms, biases and the T5 table.
    groups: Dict[str, List[torch.nn.Parameter]] = {"decay": [], "rest": [], "t5": []}
    for name, p in model.named_parameters():
        kind = "t5" if isinstance(model.bias, T5Bias) and name.startswith("bias.") else \
            "decay" if p.dim() >= 2 and not name.startswith("embed.") else "rest"
        groups[kind].append(p)
    optimizer = torch.optim.AdamW([{"params": groups["decay"], "weight_decay": 0.1, "lr_scale": 1.0},
                                   {"params": groups["rest"], "weight_decay": 0.0, "lr_scale": 1.0},
                                   {"params": groups["t5"], "weight_decay": 0.0, "lr_scale": T5Bias.LR_SCALE}],
                                  lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    window = torch.arange(args.train_len + 1)
    losses: List[float] = []
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(args.steps), desc=f"train {desc}", disable=not procs.main, mininterval=0.5, dynamic_ncols=True)
    for step in bar:
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        offsets = torch.randint(0, data.numel() - args.train_len - 1, (args.batch,), generator=generator)
        batch = data[offsets[rows, None] + window]
        logits = ddp(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step) * group["lr_scale"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        (global_loss,) = procs.sum(loss.item() / procs.world)
        losses.append(global_loss)
        bar.set_postfix(loss=f"{global_loss:.3f}", bpb=f"{global_loss / math.log(2):.3f}", refresh=False)
    bar.close()
    return {"seconds": time.perf_counter() - start, "losses": losses,
            "final_loss": sum(losses[-10:]) / len(losses[-10:])}


@torch.no_grad()
def evaluate(model: torch.nn.Module, chunks: Tensor, length: int, procs: Processes, tokens_per_batch: int = 16384,
             bar=None) -> float:
    """Held-out bits per byte at ``length``: every chunk cut into windows of ``length`` bytes, the loss summed
    over every prediction. Each process evaluates its own chunks (chunks rank, rank + W, ...)."""
    mine = chunks[procs.rank::procs.world]
    inputs = mine[:, :-1].reshape(-1, length)
    targets = mine[:, 1:].reshape(-1, length)
    per_batch = max(1, tokens_per_batch // length)
    total = 0.0
    for i in range(0, inputs.size(0), per_batch):
        logits = model(inputs[i:i + per_batch])
        total += F.cross_entropy(logits.reshape(-1, VOCAB).double(), targets[i:i + per_batch].reshape(-1),
                                 reduction="sum").item()
        if bar is not None:
            bar.update(logits.size(0) * length * procs.world)
    nats, count = procs.sum(total, float(targets.numel()))
    return bits_per_byte(nats, count)


def evaluate_lengths(model: ByteLM, chunks: Tensor, lengths: List[int], procs: Processes,
                     desc: str) -> Dict[int, Dict[str, object]]:
    """bits per byte at each length; a length the model cannot encode (learned positions past their table)
    is reported with posenc's own error message instead of a number."""
    from tqdm import tqdm

    model.eval()
    results: Dict[int, Dict[str, object]] = {}
    bar = tqdm(total=chunks.size(0) * (chunks.size(1) - 1) * len(lengths), desc=f"eval  {desc}", unit="B",
               unit_scale=True, disable=not procs.main, mininterval=0.5, dynamic_ncols=True)
    for length in lengths:
        try:
            bpb = evaluate(model, chunks, length, procs, bar=bar)
            results[length] = {"bpb": bpb, "error": None}
            bar.set_postfix_str(" ".join(f"{n}:{r['bpb']:.3f}" for n, r in results.items() if r["bpb"] is not None))
        except RuntimeError as error:
            message = str(error).splitlines()[0]
            if not message.startswith("posenc."):
                raise
            results[length] = {"bpb": None, "error": message}
            bar.update(chunks.size(0) * (chunks.size(1) - 1))
    bar.close()
    return results


# ---------------------------------------------------------------- outputs

def format_table(results: Dict[str, Dict[int, Dict[str, object]]], lengths: List[int], train_len: int) -> str:
    width = max(len(name) for name in results) + 2
    lines = [f"held-out bits per byte (lower is better), trained on windows of {train_len} bytes",
             "encoding".ljust(width) + "".join(f"{n:>10d}" for n in lengths),
             "".ljust(width) + "".join(f"{f'{n // train_len}x':>10s}" for n in lengths)]
    notes = []
    for name, row in results.items():
        cells = []
        for n in lengths:
            bpb = row[n]["bpb"]
            cells.append(f"{bpb:10.4f}" if bpb is not None else f"{'n/a':>10s}")
            if bpb is None and row[n]["error"] not in (note for _, note in notes):
                notes.append((name, row[n]["error"]))
        lines.append(name.ljust(width) + "".join(cells))
    lines += [f"n/a ({name}): {note}" for name, note in notes]
    return "\n".join(lines)


def write_csv(path: Path, results: Dict[str, Dict[int, Dict[str, object]]], train_len: int) -> None:
    import csv

    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["encoding", "eval_length", "factor", "bits_per_byte", "error"])
        for name, row in results.items():
            for n, r in row.items():
                bpb = r["bpb"]
                writer.writerow([name, n, n // train_len, "" if bpb is None else f"{bpb:.6f}", r["error"] or ""])


def figure(results: Dict[str, Dict[int, Dict[str, object]]], lengths: List[int], train_len: int, title: str):
    """The plot: bits per byte against evaluation length (log scale), one line per encoding; a
    matplotlib Figure of its own (no pyplot state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.6), dpi=100)
    ax = fig.subplots()
    for name, row in results.items():
        xs = [n for n in lengths if row[n]["bpb"] is not None]
        label = name if len(xs) == len(lengths) else f"{name} (n/a past {max(xs, default=0)})"
        ax.plot(xs, [row[n]["bpb"] for n in xs], marker="o", linestyle="--" if "+" in name else "-", label=label)
    ax.axvline(train_len, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel(f"evaluation length (bytes; trained at {train_len})")
    ax.set_ylabel("held-out bits per byte (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: bytes, count: int, context: int) -> bytes:
    """Greedy continuation of ``prompt`` by ``count`` bytes, each step reading at most ``context`` bytes."""
    tokens = list(prompt)
    for _ in range(count):
        window = torch.tensor([tokens[-context:]], dtype=torch.long)
        tokens.append(int(model(window)[0, -1].argmax()))
    return bytes(tokens[len(prompt):])


def fits_cache(prompt: bytes, count: int, context: int) -> bool:
    """Whether every window of ``generate`` holds the whole text, so that decoding with a cache of every byte
    gives the same bytes (past ``context``, ``generate`` drops the first bytes and the positions restart)."""
    return len(prompt) + count - 1 <= context


@torch.no_grad()
def generate_cached(model: torch.nn.Module, prompt: bytes, count: int, context: int) -> bytes:
    """``generate`` through ``decode_step`` (the eager or the scripted model): the prompt in one call, then one
    byte per call, each reading the keys and values of the bytes before it from the caches instead of
    recomputing them. ``ValueError`` where ``generate`` would cut the text to ``context`` bytes; RuntimeError for
    dynamic NTK (see ``ByteLM.cached_decoding``)."""
    if not fits_cache(prompt, count, context):
        raise ValueError(f"study: {len(prompt)} + {count} bytes exceed the context of {context}")
    layers, heads, head_dim = model.cache_shape()
    shape = (1, heads, len(prompt) + count, head_dim)
    k_caches = [torch.zeros(shape) for _ in range(layers)]
    v_caches = [torch.zeros(shape) for _ in range(layers)]
    tokens, start, out = torch.tensor([list(prompt)], dtype=torch.long), 0, []
    for _ in range(count):
        logits = model.decode_step(tokens, start, k_caches, v_caches)
        start += tokens.size(1)
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(tokens))
    return bytes(out)


def export(model: ByteLM, name: str, chunks: Tensor, lengths: List[int], args: argparse.Namespace,
           out: Path, procs: Processes) -> Dict[str, object]:
    """Saves ``model`` with TorchScript (``model.pt``, with ``decode_step``) and torch.export (``model.pt2``,
    batch and length dynamic), checks both against the eager model at the shortest and longest length and the
    scripted cached decoding against ``generate``, and writes what the C++ program needs to repeat the
    evaluation and the greedy continuation of the prompt."""
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    with warnings.catch_warnings():  # TorchScript is deprecated upstream, and still what C++ programs load
        warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)
        torch.jit.script(model).save(str(out / "model.pt"))
        reloaded = torch.jit.load(str(out / "model.pt"))
    longest = max(lengths)
    # Batch and length both dynamic; an example of 2 x 2 keeps torch.export from specialising either to 1.
    example = chunks[:2, :2].contiguous()
    dims = {0: torch.export.Dim("batch", max=1 << 20), 1: torch.export.Dim("length", min=1, max=1 << 20)}
    program = torch.export.export(model, (example,), dynamic_shapes=(dims,))
    torch.export.save(program, str(out / "model.pt2"))
    loaded = torch.export.load(str(out / "model.pt2")).module()
    check = [min(lengths), longest]
    values = {}
    for length in check:
        eager = evaluate(model, chunks, length, procs)
        values[length] = {"eager": eager, "torchscript": evaluate(reloaded, chunks, length, procs),
                          "torch.export": evaluate(loaded, chunks, length, procs)}
    prompt = args.prompt.encode()
    continuation = generate(model, prompt, args.generate, longest)
    # The scripted model's decode_step, as C++ calls it, must continue the prompt with the same bytes.
    cached = None
    if model.cached_decoding and fits_cache(prompt, args.generate, longest):
        cached = generate_cached(reloaded, prompt, args.generate, longest) == continuation
    (out / "heldout.bin").write_bytes(bytes(chunks.to(torch.uint8).flatten().tolist()))
    (out / "prompt.txt").write_bytes(prompt)
    (out / "generated_python.txt").write_bytes(continuation)
    (out / "check.txt").write_text(
        "# written by scripts/study.py for scripts/study_cpp: the C++ program must reproduce these numbers\n"
        f"encoding {name}\nchunk {chunks.size(1)}\ncontext {longest}\ngenerate {args.generate}\n"
        + "".join(f"bpb {n} {values[n]['eager']:.10f}\n" for n in check))
    return {"encoding": name, "lengths": check, "bits_per_byte": values, "prompt": args.prompt,
            "generated": continuation.decode("utf-8", "replace"), "cached_generation_equal": cached}


# ---------------------------------------------------------------- main

def plot_title(args: argparse.Namespace) -> str:
    return (f"Train short, test long: {args.layers}-layer {args.dim}-wide byte LM, {args.steps} steps "
            f"at {args.train_len} bytes")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/study.py", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--out", default="build/study", help="folder for every output (default build/study)")
    parser.add_argument("--preset", choices=list(PRESETS), default="default",
                        help="sizes of the run (flags below override them): "
                        + "; ".join(f"{name}: {describe(p)}" for name, p in PRESETS.items()))
    parser.add_argument("--data", help="train and evaluate on this text file instead of Python's own text")
    parser.add_argument("--encodings", default=",".join(ENCODINGS), help="comma-separated subset of "
                        + ",".join(ENCODINGS))
    parser.add_argument("--factors", default="1,2,4,8,16", help="evaluation lengths as multiples of --train-len")
    for name, kind in (("dim", int), ("layers", int), ("heads", int), ("train-len", int), ("batch", int),
                       ("steps", int), ("lr", float), ("eval-chunks", int)):
        parser.add_argument(f"--{name}", type=kind, help=f"overrides the preset's {name}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="threads per process (default: the cores / the processes)")
    parser.add_argument("--prompt", default="The ", help="the exported model continues this text greedily")
    parser.add_argument("--generate", type=int, default=200, help="bytes to generate from --prompt")
    parser.add_argument("--no-export", action="store_true", help="skip the TorchScript / torch.export step")
    args = parser.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, type(value)(value))
    args.dim, args.layers, args.heads, args.train_len = int(args.dim), int(args.layers), int(args.heads), \
        int(args.train_len)
    args.batch, args.steps, args.eval_chunks = int(args.batch), int(args.steps), int(args.eval_chunks)
    args.encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    for e in args.encodings:
        if e not in ENCODINGS:
            parser.error(f"unknown encoding {e!r}; choose from {', '.join(ENCODINGS)}")
    args.factors = sorted({int(f) for f in args.factors.split(",")})
    if args.data and not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name in ("batch", "eval_chunks"):
        if getattr(args, name) % world:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be a multiple of the {world} "
                         f"processes")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    procs = Processes.start(args.threads)
    started = time.perf_counter()
    out = Path(args.out)
    if procs.main:
        out.mkdir(parents=True, exist_ok=True)
    say = print if procs.main else (lambda *a, **k: None)

    if args.data:
        text, source = Path(args.data).read_bytes(), f"{args.data}"
    else:
        text, source = python_corpus()
    lengths = [args.train_len * f for f in args.factors]
    try:
        train_data, held_out = split(text)
        chunks = eval_chunks(held_out, args.eval_chunks, max(lengths))
    except ValueError as error:  # too little text: say so, no traceback
        procs.close()
        sys.exit(str(error))
    say(f"text: {source}\nsplit: {train_data.numel()} training bytes, {held_out.numel()} held-out bytes; "
        f"evaluating {chunks.size(0)} chunks of {chunks.size(1) - 1} predictions at lengths {lengths}\n"
        f"processes: {procs.world} x {procs.threads} threads (torch.set_num_threads)")

    results: Dict[str, Dict[int, Dict[str, object]]] = {}
    training: Dict[str, Dict[str, object]] = {}
    models: Dict[str, ByteLM] = {}
    for encoding in args.encodings:
        torch.manual_seed(args.seed)  # every encoding starts from the same seed and sees the same batches
        model = ByteLM(encoding, args.dim, args.layers, args.heads, args.train_len)
        training[encoding] = train(model, train_data, args, procs, encoding)
        results[encoding] = evaluate_lengths(model, chunks, lengths, procs, encoding)
        models[encoding] = model
        if encoding == "rotary":
            scaled = ByteLM("rotary", args.dim, args.layers, args.heads, args.train_len, dynamic_ntk(args.train_len))
            scaled.load_state_dict(model.state_dict())
            results[ROTARY_SCALED] = evaluate_lengths(scaled, chunks, lengths, procs, ROTARY_SCALED)
            models[ROTARY_SCALED] = scaled
    parameters = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}

    # The best long-context model: the lowest bits per byte at the longest length.
    scored = [(row[max(lengths)]["bpb"], name) for name, row in results.items() if row[max(lengths)]["bpb"] is not None]
    best = min(scored)[1] if scored else None
    exported = None
    if best is not None and not args.no_export and procs.main:
        exported = export(models[best], best, chunks, lengths, args, out / "export", Processes(threads=procs.threads))

    seconds = time.perf_counter() - started
    if procs.main:
        table = format_table(results, lengths, args.train_len)
        settings = {key: value for key, value in vars(args).items()}
        settings.update(text=source, train_bytes=train_data.numel(), held_out_bytes=held_out.numel(),
                        eval_predictions=chunks.size(0) * (chunks.size(1) - 1), lengths=lengths,
                        processes=procs.world, threads_per_process=procs.threads, parameters=parameters,
                        torch=torch.__version__, python=platform.python_version(), seconds=seconds,
                        command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]))
        report = {"settings": settings, "table": table,
                  "results": [{"encoding": name, "eval_length": n, "factor": n // args.train_len,
                               "bits_per_byte": r["bpb"], "error": r["error"]}
                              for name, row in results.items() for n, r in row.items()],
                  "training": training, "best_long_context": best, "export": exported}
        (out / "table.txt").write_text(table + "\n")
        write_csv(out / "results.csv", results, args.train_len)
        (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
        figure(results, lengths, args.train_len, plot_title(args)).savefig(out / "bpb.png")
        say("\n" + table)
        say("\ntraining: " + ", ".join(f"{n} {t['seconds']:.0f} s (final loss {t['final_loss']:.3f})"
                                       for n, t in training.items()))
        if exported is not None:
            say(f"best at {max(lengths)} bytes: {best}; exported to {out / 'export'} (model.pt, model.pt2)")
            say(f"greedy continuation of {args.prompt!r}: {exported['generated']!r}")
            equal = exported["cached_generation_equal"]
            verdict = "n/a" if equal is None else "the same bytes" if equal else "DIFFERENT bytes"
            say(f"cached greedy decoding (decode_step of model.pt): {verdict}")
        say(f"wall time {seconds:.0f} s; outputs in {out}")
    procs.close()
    procs.exit()
    return {"results": results, "best": best}


if __name__ == "__main__":
    main()
