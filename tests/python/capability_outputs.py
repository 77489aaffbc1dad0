"""Runs every posenc op, forward and backward, and every configuration formula (frequencies for every scaling
type, slopes, position grids) on fixed inputs and saves the outputs: the same file is written under each CPU
capability (POSENC_CPU_CAPABILITY, or an emulated CPU) and test_capabilities.py compares the bits. The file also
lists the posenc ops the run called, so that a new op fails the comparison until it is run here.

Usage: python tests/python/capability_outputs.py OUT.pt
Three parts: every op's registry sample (op_registry.SAMPLES: a new op is run here once it has its sample) in every
dtype with its gradients, on its values as made and with float specials written in; the ops that form angles at
positions whose angles take the slow path (far, float, NaN and infinite positions), in every layout and format, on
random bit patterns of fp16/bf16 (NaN payloads, infinities, denormals, -0) and float32 specials, odd widths and
strided views; and the configuration formulas. Every input is made with integer arithmetic or posenc's own ops,
so that the inputs themselves are the same bits on every CPU (torch's vectorized kernels, torch.cos and
torch.randn say, differ between CPUs).
"""
import sys

import torch
from torch.overrides import TorchFunctionMode

import posenc
from op_registry import SAMPLES, outputs_and_grads, uses_dtype
from posenc import functional as PF

# Every scaling type of posenc.frequencies.rope, with each of its optional keys given somewhere.
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.5, "max_position_embeddings": 2048},
    "ntk": {"rope_type": "ntk", "alpha": 1000.0},
    "yarn": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096},
    "yarn_deepseek": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 64 for i in range(64)],
                 "long_factor": [1.0 + i / 7 for i in range(64)], "original_max_position_embeddings": 4096,
                 "max_position_embeddings": 131072},
}


class RecordOps(TorchFunctionMode):
    """Names the posenc ops called (from Python) under it. A function mode, not a dispatch mode: it sees only the
    calls made from Python, not every aten op the calls run below autograd, which cost seconds under qemu."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.OpOverloadPacket) and func._qualified_op_name.startswith("posenc::"):
            self.names.add(func._qualified_op_name.split("::")[1])
        elif isinstance(func, torch._ops.OpOverload) and func.namespace == "posenc":
            self.names.add(func._schema.name.split("::")[1])
        return func(*args, **(kwargs or {}))


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 65504.0, 1e30]


def data(shape, dtype, seed):
    """Random values; for fp16/bf16 every bit pattern is as likely (NaN payloads, infinities, denormals)."""
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.float16, torch.bfloat16):
        return torch.randint(-2 ** 15, 2 ** 15, shape, generator=g, dtype=torch.int16).view(dtype)
    # Integers scaled by a power of two: exact, so the inputs are the same bits on every CPU (torch.randn's
    # own kernels differ between CPU capabilities).
    x = (torch.randint(-2 ** 22, 2 ** 22, shape, generator=g, dtype=torch.int64).double() * 2.0 ** -20).to(dtype)
    flat = x.view(-1)
    flat[: len(SPECIALS)] = torch.tensor(SPECIALS, dtype=torch.float64).to(dtype)
    return x


def outputs():
    out = samples()
    out.update(far_angles_and_special_values())
    out.update(configuration())
    return out


def samples():
    """Every op's registry sample (op_registry.SAMPLES, size "small": odd widths, views, offsets, every format, varlen,
    multi-axis, GQA, ...) in every dtype (one for the ops with no floating data), with the gradients of its inputs.
    Its inputs are made by integer arithmetic too (op_registry.exact_values); each sample runs on them as made, and
    again with float specials (NaN, infinities, zeros of both signs, denormals, ...) in the first values of its
    data."""
    out = {}
    for name in sorted(SAMPLES):
        for dtype in DTYPES if uses_dtype(name) else DTYPES[:1]:
            for values in ("exact", "special"):
                sample = SAMPLES[name](dtype=dtype, requires_grad=True)
                if values == "special":
                    if not sample.data:
                        continue
                    with torch.no_grad():
                        for data in sample.data:  # the first values of each, whatever views the op reads
                            n = min(len(SPECIALS), data.numel())
                            data.view(-1)[:n] = torch.tensor(SPECIALS[:n], dtype=torch.float64).to(data.dtype)
                # One flat tensor for the results of each dtype: fewer, larger tensors to compare.
                results = outputs_and_grads(sample)
                for result_dtype in dict.fromkeys(r.dtype for r in results):
                    key = f"sample/{name}/{str(dtype).split('.')[1]}/{values}/{str(result_dtype).split('.')[1]}"
                    out[key] = torch.cat([r.detach().flatten() for r in results if r.dtype == result_dtype])
    return out


def far_angles_and_special_values():
    """The ops that form angles, at positions whose angles take the slow path (far, float, NaN and infinite
    positions), in every layout and format, on data of every class of value."""
    out = {}
    positions = torch.tensor([0, 1, 7, 4095, 2 ** 20, 2 ** 26 + 3, 2 ** 40 + 1, -(2 ** 53)])
    float_positions = torch.tensor([0.0, 0.5, -3.25, 1e6 + 0.125, float("nan"), float("inf")], dtype=torch.float64)
    inv_freq = posenc.frequencies.sinusoidal(130)  # 65 pairs: vector bodies and odd tails
    for dtype in DTYPES:
        d = str(dtype).split(".")[1]
        for layout in ("interleaved", "half", "half_cos_first"):
            out[f"sinusoidal/{d}/{layout}"] = PF.sinusoidal(positions, inv_freq, layout, dtype)
            out[f"sinusoidal_float/{d}/{layout}"] = PF.sinusoidal(float_positions, inv_freq, layout, dtype)
            x = data((3, 8, 131), dtype, 1)
            out[f"add_sinusoidal/{d}/{layout}"] = PF.add_sinusoidal(x, positions, inv_freq, 0.75, layout, 5)
            out[f"add_sinusoidal_rows/{d}/{layout}"] = PF.add_sinusoidal(x, positions.expand(3, 8), inv_freq, 1.0,
                                                                         layout)
        weight = data((50, 130), dtype, 2)
        tokens = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(3))
        out[f"embed_sinusoidal/{d}"] = PF.embed_sinusoidal(tokens, weight, positions, inv_freq, 2.5)
        # A video grid in CogVideoX's channel order: segments of 40 and 60 channels, each added from where its axis's
        # values are kept; streamed, bf16 and fp16 rows go out as whole 64-byte lines, a line that two segments share
        # assembled first. Rows that start on a line (320 channels) and rows that start anywhere (336).
        for dim in (320, 336):
            grid = posenc.nn.SinusoidalGridEncoding(dim, "cogvideox", interpolation_scale=[1.0, 1.875, 1.875])
            out[f"grid_cogvideox/{d}/{dim}"] = grid(data((2, 30, dim), dtype, 12), [2, 3, 5])
        # Resampled tables whose float64 sums lie at the ends of float32's range (its least normals, its denormals,
        # its largest), zeros and specials among them: the baseline and AVX2 builds round such sums to odd value by
        # value, the others in vectors.
        for exponent in (-126, -131, 126):
            table = (data((1 + 5 * 7, 72), torch.float32, 13).double() * 2.0 ** exponent).to(dtype)
            table[1::4, 8:24] = 0
            if dtype == torch.bfloat16:  # the NaN of torch's conversion differs between CPUs
                table.view(torch.int16)[table.isnan()] = 0x7FC0
            out[f"resample_learned_range/{d}/{exponent}"] = PF.resample_learned(table, [5, 7], [9, 10], "bicubic",
                                                                                num_prefix_tokens=1)

        for layout in ("neox", "gptj"):
            for fmt, shape in (("bshd", (2, 8, 3, 134)), ("bhsd", (2, 3, 8, 134)), ("sbhd", (8, 2, 3, 134)),
                               ("thd", (8, 3, 134))):
                freq = posenc.frequencies.rope(130, 500.0)[0]  # partial rotary, 65 pairs (odd)
                q, k = data(shape, dtype, 7), data(shape, dtype, 8)
                key = f"{d}/{layout}/{fmt}"
                pos = positions if fmt == "thd" else positions.expand(2, 8)
                out[f"rope/{key}"] = PF.rope(q, pos, freq, 0.9, layout, fmt)
                qo, ko = PF.rope_qk(q, k, positions, freq, 1.0, layout, fmt)
                out[f"rope_qk/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                qo, ko = torch.ops.posenc.rope_qk_backward(q, k, positions, freq, 0.5, layout, fmt, 1)
                out[f"rope_qk_backward/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                strided = data(shape[:-1] + (2 * shape[-1],), dtype, 9)[..., ::2]
                out[f"rope_backward_strided/{key}"] = PF.rope_backward(strided, positions, freq, 1.0, layout, fmt)
                inplace = q.clone()
                PF.rope_(inplace, positions, freq, 1.0, layout, fmt)
                out[f"rope_/{key}"] = inplace
                # Multi-axis: three axes mixing near and far positions, interleaved pair axes.
                axes = torch.stack([positions, positions.flip(0), positions // 3])
                pair_axis = (torch.arange(65) * 7) % 3
                out[f"rope_axes/{key}"] = PF.rope(q, axes, freq, 0.9, layout, fmt, 2, None, pair_axis)
                if fmt != "thd":
                    rows = torch.stack([axes, axes.roll(1, 1)], 1)  # [3, B, S]
                    qo, ko = PF.rope_qk(q, k, rows, freq, 1.0, layout, fmt, 0, None, pair_axis)
                    out[f"rope_qk_axes/{key}"] = torch.cat([qo.flatten(), ko.flatten()])

    # bf16 heads whose pairs fill whole steps of the baseline's and the AVX2 build's vectors (16 and 48 pairs, 64 with
    # 6 channels past them, 64 on whole lines), which those builds rotate a word of two channels at a time: a token's
    # heads (bshd) and runs of heads (bhsd), both layouts, positions shared by the batch rows (a table of coefficients)
    # and per row, out of place, backward and in place.
    for pairs, head_dim in ((16, 32), (48, 96), (64, 134), (64, 128)):
        freq = posenc.frequencies.rope(2 * pairs, 500.0)[0]
        for layout in ("neox", "gptj"):
            for fmt, shape in (("bshd", (2, 8, 3, head_dim)), ("bhsd", (2, 5, 8, head_dim))):
                q, k = data(shape, torch.bfloat16, 21), data(shape, torch.bfloat16, 22)
                key = f"{pairs}/{head_dim}/{layout}/{fmt}"
                qo, ko = PF.rope_qk(q, k, positions, freq, 1.0, layout, fmt)
                out[f"rope_qk_words/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                qo, ko = PF.rope_qk(q, k, torch.stack([positions, positions.flip(0)]), freq, 1.0, layout, fmt)
                out[f"rope_qk_words_rows/{key}"] = torch.cat([qo.flatten(), ko.flatten()])  # no table shared by rows
                qo, ko = torch.ops.posenc.rope_qk_backward(q, k, positions, freq, 0.5, layout, fmt, 1)
                out[f"rope_qk_backward_words/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                PF.rope_(q, positions, freq, 1.0, layout, fmt)
                out[f"rope_words_/{key}"] = q

    # Positions that take few values (an M-RoPE prompt holding an image; [B, S] rows that repeat one another), whose
    # tokens gather their rows from sin and cos formed once per value: every dtype, both layouts, bshd and bhsd,
    # contiguous sections and interleaved ones, 64 pairs (the bf16 word kernels') and 13, forward, backward and in
    # place, with negative positions.
    types = torch.tensor([[0] * 5 + [1] * 24 + [0] * 3])
    image, _ = PF.mrope_positions(types, torch.tensor([[1, 8, 12]]))  # [3, 1, 32]: 4 x 6 merged patches
    for d in ("float32", "float64", "float16", "bfloat16"):
        dtype = getattr(torch, d)
        for pairs in (64, 13):
            sections = [pairs - 2 * (pairs * 3 // 8), pairs * 3 // 8, pairs * 3 // 8]
            for interleaved in (False, True):
                freq, pair_axis = posenc.frequencies.mrope(2 * pairs, sections, 1e4, interleaved)
                for layout in ("neox", "gptj"):
                    for fmt, shape in (("bshd", (1, 32, 3, 2 * pairs)), ("bhsd", (1, 3, 32, 2 * pairs))):
                        q, k = data(shape, dtype, 31), data(shape, dtype, 32)
                        key = f"{d}/{pairs}/{interleaved}/{layout}/{fmt}"
                        args = (image - 7, freq, 1.0, layout, fmt, 0, None, pair_axis)
                        qo, ko = PF.rope_qk(q, k, *args)
                        out[f"rope_qk_values/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                        qo, ko = PF.rope_qk_backward(q, k, *args)
                        out[f"rope_qk_backward_values/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                        PF.rope_(q, *args)
                        out[f"rope_values_/{key}"] = q
                row = torch.arange(-3, 13)
                rows = torch.stack([row, row.flip(0), row.roll(5)])  # [3, 16], one axis, the same values
                x = data((3, 16, 2, 2 * pairs), dtype, 33)
                out[f"rope_values_rows/{d}/{pairs}"] = PF.rope(x, rows, posenc.frequencies.rope(2 * pairs, 1e4)[0])

    # qk_norm_rope's bf16 heads rotated whole in neox pairs, forward and backward, which a CPU with AVX-512 BF16
    # rounds by instruction and redoes by the integer form where a denormal or a NaN meets a rounding: random bit
    # patterns, and values about 1 with bf16 denormals and zeros among them, times weights about 1 (zeros among them)
    # and weights that take the products below float32's normal range; gradients about 1 and tiny. 32 pairs (whole
    # lines of 32 in the forward) and 144 (16 at a time; more partners than the backward keeps in registers). Nine
    # query heads: the inverse RMS of the AVX2 and AVX-512 builds goes 8 or 16 heads at a time.
    g = torch.Generator().manual_seed(10)
    inv_freq = posenc.frequencies.rope(64, 10000.0)[0]
    for head_dim in (64, 288):
        about_one = torch.randint(-255, 256, (2, 4, 9 + 2, head_dim), generator=g).double() * 2.0 ** -7
        about_one.view(-1)[::7] *= 2.0 ** -130
        about_one.view(-1)[3::11] = 0
        freq = posenc.frequencies.rope(head_dim, 10000.0)[0]
        for norm in ("llama", "gemma", "olmo2", "fused"):
            for values, qk in (("bits", data((2, 4, 11, head_dim), torch.bfloat16, 11)),
                               ("denormals", about_one.bfloat16())):
                q, k = qk[:, :, :9], qk[:, :, 9:]
                q_width, k_width = (9 * head_dim, 2 * head_dim) if norm == "olmo2" else (head_dim, head_dim)
                for weights, scale in (("about_one", 1.0), ("tiny", 2.0 ** -120)):
                    qw = (torch.randint(-255, 256, (q_width,), generator=g).double() * 2.0 ** -7 * scale).float()
                    kw = (torch.randint(-255, 256, (k_width,), generator=g).double() * 2.0 ** -7).bfloat16()
                    positions = torch.arange(4).expand(2, 4)
                    key = f"{head_dim}/{norm}/{values}/{weights}"
                    qo, ko = PF.qk_norm_rope(q, k, qw, kw, positions, freq, 1e-6, norm)
                    out[f"qk_norm_rope/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                    grads = torch.ops.posenc.qk_norm_rope_backward(qk[:, :, :9] * scale, qk[:, :, 9:], q, k, qw, kw,
                                                                   positions, freq, 1e-6, norm)
                    for name, grad in zip(("q", "k", "q_weight", "k_weight"), grads):
                        out[f"qk_norm_rope_backward/{key}/{name}"] = grad

    # The same bf16 forward where its tokens are clean (values about 1, zeros among them): the rounding checks are then
    # skipped where bounds prove that no rounding can meet a denormal or a NaN. Each token holds one value scaled down
    # by 2^-e (e from 60 to 152: past bf16's smallest denormal) with a zero partner, so that its rotated values are
    # its products alone; the weights and the coefficients (through attention_scale) scaled down too. Between them,
    # tokens on both sides of the bounds and of the denormals the bounds keep out.
    exponents = torch.arange(60, 154, 2)
    about_one = torch.randint(-255, 256, (1, len(exponents), 3, 64), generator=g).double() * 2.0 ** -7
    about_one.view(-1)[5::13] = 0
    about_one[0, :, 0, 0] = 2.0 ** -exponents.double()
    about_one[0, :, 0, 32] = 0
    about_one = about_one.bfloat16()
    freq = posenc.frequencies.rope(64, 10000.0)[0]
    q, k = about_one[:, :, :2], about_one[:, :, 2:]
    for norm in ("llama", "gemma", "olmo2", "fused"):
        q_width, k_width = (128, 64) if norm == "olmo2" else (64, 64)
        for weight_scale in (1.0, 2.0 ** -40, 2.0 ** -90):
            qw = (torch.randint(1, 256, (q_width,), generator=g).double() * 2.0 ** -7 * weight_scale).bfloat16()
            kw = (torch.randint(1, 256, (k_width,), generator=g).double() * 2.0 ** -7).bfloat16()
            for attention_scale in (1.0, 2.0 ** -50, 2.0 ** -100):
                qo, ko = PF.qk_norm_rope(q, k, qw, kw, None, freq, 1e-6, norm, attention_scale)
                out[f"qk_norm_rope/clean/{norm}/{weight_scale}/{attention_scale}"] = torch.cat([qo.flatten(),
                                                                                                 ko.flatten()])

    # and float32, whose outputs and backward's input gradients go past the caches from registers where streamed;
    # inputs on a 64-byte line and a channel past one
    for norm in ("llama", "gemma", "fused"):
        qk = data((2, 4, 5, 64), torch.float32, 12)
        qw, kw = data((64,), torch.float32, 13), data((64,), torch.float32, 14)
        grad = data((2, 4, 5, 64), torch.float32, 15)
        # every channel rotated, and 16 pairs of 64 channels (the rest normalized only)
        for offset, freq in ((0, inv_freq), (1, inv_freq), (0, posenc.frequencies.rope(32, 10000.0)[0])):
            buffer = torch.zeros(qk.numel() + 16)
            shifted = buffer[offset:offset + qk.numel()].view(qk.shape).copy_(qk)
            q, k = shifted[:, :, :3], shifted[:, :, 3:]
            key = f"float32/{norm}/{offset}/{len(freq)}"
            qo, ko = PF.qk_norm_rope(q, k, qw, kw, None, freq, 1e-6, norm)
            out[f"qk_norm_rope/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
            grads = torch.ops.posenc.qk_norm_rope_backward(grad[:, :, :3], grad[:, :, 3:], q, k, qw, kw, None,
                                                           freq, 1e-6, norm)
            for name, g32 in zip(("q", "k", "q_weight", "k_weight"), grads):
                out[f"qk_norm_rope_backward/{key}/{name}"] = g32

    # float32 rotations of 16 pairs or more, which the AVX-512 build sends past the caches from registers where
    # streamed and a head's output starts on a 64-byte line: head_dim 72 (every other row on a line), 64 channels
    # rotated, the rest copied; token by token (bshd) and a few heads at a time (bhsd)
    for layout in ("neox", "gptj"):
        for fmt in ("bshd", "bhsd"):
            q, k = data((2, 8, 3, 72), torch.float32, 16), data((2, 8, 3, 72), torch.float32, 17)
            freq = posenc.frequencies.rope(64, 500.0)[0]
            seq = q.shape[1 if fmt == "bshd" else 2]
            positions = torch.arange(seq) * 1000
            key = f"float32/{layout}/16_pairs" + ("" if fmt == "bshd" else "/bhsd")
            out[f"rope/{key}"] = PF.rope(q, positions.expand(2, seq), freq, 0.9, layout, fmt)
            qo, ko = PF.rope_qk(q, k, positions, freq, 1.0, layout, fmt)
            out[f"rope_qk/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
            qo, ko = torch.ops.posenc.rope_qk_backward(q, k, positions, freq, 0.5, layout, fmt, 1)
            out[f"rope_qk_backward/{key}"] = torch.cat([qo.flatten(), ko.flatten()])

    # bf16 and fp16 rows rotated with whole vectors of pairs, token by token and a few bhsd heads at a time: a CPU with
    # AVX-512 BF16 rounds bf16 by instruction (by the integer form where a rotated value is a denormal or a NaN), the
    # baseline and AVX2 builds round it by integers in registers (neox 8 or 16 pairs a step, gptj 4 or 8; NaNs
    # selected only where a step has one), the AVX-512 build rotates fp16 in registers by F16C (neox 32 pairs a step,
    # gptj 16), each sending whole lines past the caches where the output streams. Random bit patterns and values
    # about 1 with denormals of the dtype and zeros among them; neox and gptj, out of place, in place, rope_qk and
    # backward, bshd and bhsd, a partial rotary (96 channels, 64 rotated).
    positions = torch.tensor([[0, 1, 7, 4095], [2 ** 20, 3, 2 ** 26 + 3, 12]])
    for name, dtype, tiny, seed in (("bf16", torch.bfloat16, 2.0 ** -130, 12), ("fp16", torch.float16, 2.0 ** -16, 21)):
        for head_dim, rotary_dim in ((64, 64), (128, 128), (96, 64)):
            inv_freq = posenc.frequencies.rope(rotary_dim, 10000.0)[0]
            small = torch.randint(-255, 256, (2, 4, 3, head_dim), generator=g).double() * 2.0 ** -7
            small.view(-1)[::7] *= tiny
            small.view(-1)[3::11] = 0
            for values, x in (("bits", data((2, 4, 3, head_dim), dtype, seed)), ("denormals", small.to(dtype))):
                for layout in ("neox", "gptj"):
                    key = f"{head_dim}/{rotary_dim}/{values}/{layout}"
                    out[f"rope_{name}_rows/{key}"] = PF.rope(x, positions, inv_freq, 0.9, layout)
                    rotated = x.clone()
                    PF.rope_(rotated, positions, inv_freq, 1.0, layout)
                    out[f"rope_{name}_rows_/{key}"] = rotated
                    out[f"rope_{name}_rows_backward/{key}"] = PF.rope_backward(x, positions, inv_freq, 1.0, layout)
                    qo, ko = PF.rope_qk(x, x.flip(2), positions, inv_freq, 1.0, layout)
                    out[f"rope_qk_{name}_rows/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                    # bhsd: each head's rows walked as one run
                    heads_first = x.transpose(1, 2).contiguous()
                    out[f"rope_{name}_rows_bhsd/{key}"] = PF.rope(heads_first, positions, inv_freq, 0.9, layout,
                                                                  "bhsd")
                    out[f"rope_{name}_rows_bhsd_backward/{key}"] = PF.rope_backward(heads_first, positions, inv_freq,
                                                                                    1.0, layout, "bhsd")
                    PF.rope_(heads_first, positions, inv_freq, 1.0, layout, "bhsd")
                    out[f"rope_{name}_rows_bhsd_/{key}"] = heads_first

    # qk_norm_rope's fp16 heads in neox pairs, which the AVX2 and AVX-512 builds round by F16C a vector of pairs at a
    # time (8 and 16) where the pair count allows, and whose backward they take 8 and 16 pairs at a time: random
    # bit patterns, and values about 1 with fp16 denormals and zeros among them, times weights about 1 and weights that
    # take the products into fp16's denormals; 24 pairs (AVX2's step only), 32 and 144.
    g = torch.Generator().manual_seed(19)
    for head_dim in (48, 64, 288):
        about_one = torch.randint(-255, 256, (2, 4, 5, head_dim), generator=g).double() * 2.0 ** -7
        about_one.view(-1)[::7] *= 2.0 ** -16
        about_one.view(-1)[3::11] = 0
        freq = posenc.frequencies.rope(head_dim, 10000.0)[0]
        for norm in ("llama", "gemma", "olmo2", "fused"):
            for values, qk in (("bits", data((2, 4, 5, head_dim), torch.float16, 18)), ("denormals", about_one.half())):
                q, k = qk[:, :, :3], qk[:, :, 3:]
                q_width, k_width = (3 * head_dim, 2 * head_dim) if norm == "olmo2" else (head_dim, head_dim)
                for weights, scale in (("about_one", 1.0), ("tiny", 2.0 ** -12)):
                    qw = (torch.randint(-255, 256, (q_width,), generator=g).double() * 2.0 ** -7 * scale).half()
                    kw = (torch.randint(-255, 256, (k_width,), generator=g).double() * 2.0 ** -7).float()
                    positions = torch.arange(4).expand(2, 4)
                    key = f"float16/{head_dim}/{norm}/{values}/{weights}"
                    qo, ko = PF.qk_norm_rope(q, k, qw, kw, positions, freq, 1e-6, norm)
                    out[f"qk_norm_rope/{key}"] = torch.cat([qo.flatten(), ko.flatten()])
                    grads = torch.ops.posenc.qk_norm_rope_backward(qk[:, :, :3] * scale, qk[:, :, 3:], q, k, qw, kw,
                                                                   positions, freq, 1e-6, norm)
                    for name, grad in zip(("q", "k", "q_weight", "k_weight"), grads):
                        out[f"qk_norm_rope_backward/{key}/{name}"] = grad

    # posenc rounds every NaN result to bf16 as c10 does, to 0x7FC0, on every capability. The comparison lets a NaN
    # be any NaN (torch's own vectorized bf16 conversions, run by the samples around posenc's ops, give 0xFFFF);
    # these int16 patterns of the NaNs of posenc's own bf16 outputs above are compared exactly.
    for key in [key for key, value in out.items() if value.dtype == torch.bfloat16]:
        out[f"{key}/nan_bits"] = out[key].view(torch.int16)[out[key].isnan()]

    # Relative positions near int64's limits, for several bucket configurations.
    distances = torch.cat([torch.arange(-3000, 3000), torch.tensor([2 ** 40, -(2 ** 62), 2 ** 63 - 1])])
    for bidirectional in (False, True):
        for num_buckets, max_distance in ((32, 128), (64, 1000), (320, 2048), (7, 13)):
            out[f"relative_position_bucket/{bidirectional}/{num_buckets}/{max_distance}"] = (
                PF.relative_position_bucket(distances, bidirectional, num_buckets, max_distance))
    return out


def configuration():
    """Every configuration formula: frequencies, scales, slopes, position grids."""
    out = {}
    for dim in (2, 7, 64, 130, 1024):
        for base in (10000.0, 10000.5, 1.25, 1e30):
            for shift in (0, 1):
                if dim // 2 - shift > 0:
                    out[f"sinusoidal_inv_freq/{dim}/{base}/{shift}"] = posenc.frequencies.sinusoidal(dim, base, shift)
    for name, scaling in SCALINGS.items():
        for rotary_dim, base in ((128, 10000.0), (128, 500000.0), (96, 1e6 + 0.5)):
            if name == "longrope" and rotary_dim != 128:
                continue
            lengths = (None, 1, 2048, 4096, 4097, 10 ** 6)
            for seq_len in lengths:
                inv_freq, scale = posenc.frequencies.rope(rotary_dim, base, scaling, seq_len)
                key = f"rope_inv_freq/{name}/{rotary_dim}/{base}/{seq_len}"
                out[key] = torch.cat([inv_freq, torch.tensor([scale], dtype=torch.float64)])
                if seq_len is not None:
                    rope_type, keywords = posenc.frequencies.rope_arguments(scaling)
                    for dtype in (torch.int64, torch.float64):
                        out[f"rope_inv_freq_for_length/{name}/{rotary_dim}/{base}/{seq_len}/{dtype}"] = (
                            torch.ops.posenc.rope_inv_freq_for_length(torch.tensor(seq_len, dtype=dtype), rotary_dim,
                                                                       base, rope_type, **keywords))
    out["alibi_slopes"] = torch.cat([PF.alibi_slopes(n, torch.float64) for n in list(range(1, 80)) + [256, 1000]])
    out["alibi_slopes/bfloat16"] = PF.alibi_slopes(12, torch.bfloat16)
    for key, (inv_freq, pair_axis) in {
        "multiaxis": posenc.frequencies.multiaxis([16, 56, 56], [10000.0, 500.0, 3.5]),
        "axial": posenc.frequencies.axial(96, 3, 100.0),
        "mrope": posenc.frequencies.mrope(128, [16, 24, 24], 1e6, True),
    }.items():
        out[f"{key}_inv_freq"] = inv_freq
        out[f"{key}_pair_axis"] = pair_axis
    out["mrope_pair_axis"] = posenc.frequencies.mrope_pair_axis([16, 24, 24])
    for convention in posenc.frequencies.GRID_CONVENTIONS:
        inv_freq, pair_axis, _ = posenc.frequencies.grid_sinusoidal(48, convention, 100.0)
        out[f"grid_sinusoidal_inv_freq/{convention}"] = torch.cat([inv_freq, pair_axis.double()])
    out["grid_positions"] = PF.grid_positions([3, 5, 7], [5, 9, 7], [1.0, 1.875, 0.7], 2.0)
    # without augmentations: those go through ATen's float32 exp, whose bits follow ATen's own CPU capability
    out["patch_center_positions"] = PF.patch_center_positions(5, 7, 2)
    out["image_positions"] = PF.image_positions(5, 7)
    out["video_positions"] = PF.video_positions(3, 4, 5, 0.7 * 3)
    out["zigzag_positions"] = PF.zigzag_positions(48, 3, 1)
    out["zigzag_positions_varlen"] = torch.cat(PF.zigzag_positions_varlen(torch.tensor([0, 12, 36, 60]), 3, 2))
    token_types = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0, 0]])
    positions, deltas = PF.mrope_positions(token_types, torch.tensor([[1, 4, 4]]), torch.tensor([[2, 4, 2]]),
                                           None, 2, 25.0, torch.tensor([0.5]))
    out["mrope_positions"] = torch.cat([positions.flatten(), deltas.flatten()])
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    with RecordOps() as recorder:
        results = outputs()
    results["capability"] = posenc.cpu_capability()
    results["ops_called"] = sorted(recorder.names)
    torch.save(results, sys.argv[1])
