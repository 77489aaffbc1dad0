"""Scripts and saves small modules that use the posenc ops, for the C++ round-trip tests (tests/cpp).

Usage: python scripts/export_torchscript.py OUT_DIR   (writes OUT_DIR/<name>.pt for every fixture)
Each fixture's C++ test recomputes the expected values from float64 formulas of its own.
"""
import sys
from pathlib import Path

import torch

import posenc


class SinusoidalFixture(torch.nn.Module):
    """Fused token + sinusoidal embedding (interleaved, token_scale 2, padding row 0), then an added
    half-layout shift-1 encoding of a second input with x_scale 0.5 and offset 3."""

    def __init__(self):
        super().__init__()
        self.embed = posenc.nn.SinusoidalEmbedding(11, 8, padding_idx=0, token_scale=2.0)
        self.encode = posenc.nn.SinusoidalPositionalEncoding(6, shift=1, layout="half", x_scale=0.5)

    def forward(self, tokens: torch.Tensor, x: torch.Tensor):
        return self.embed(tokens), self.encode(x, None, 3)


class LearnedFixture(torch.nn.Module):
    """GPT-2 style fused token + position embedding (token_scale 2, padding row 0) after a cache of
    `past_length` tokens; an OPT style positional embedding (offset 2) of a second input at positions
    from a left-padding mask; and fairseq positions of the tokens (padding_idx 0)."""

    def __init__(self):
        super().__init__()
        self.embed = posenc.nn.LearnedEmbedding(11, 8, 4, padding_idx=0, token_scale=2.0)
        self.position = posenc.nn.LearnedPositionalEmbedding(6, 4, offset=2)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, x: torch.Tensor, past_length: int):
        positions = torch.ops.posenc.positions_from_mask(attention_mask, -1)
        return (self.embed(tokens, None, past_length), self.position(x, positions),
                torch.ops.posenc.make_positions(tokens, 0))


class AlibiFixture(torch.nn.Module):
    """Learnable causal ALiBi for the shard of heads 2-5 of an 8-head model, and the symmetric bias of 6 heads."""

    def __init__(self):
        super().__init__()
        self.shard = posenc.nn.ALiBi(8, "causal", learnable=True, head_offset=2, num_local_heads=4)
        self.symmetric = posenc.nn.ALiBi(6, "symmetric")

    def forward(self, scores: torch.Tensor, q_len: int, k_len: int):
        return self.shard(scores), self.symmetric.bias(q_len, k_len, torch.float64)


class T5Fixture(torch.nn.Module):
    """Scores plus an encoder bias (bidirectional, 32 buckets, 128) and a decoder bias (causal, 16 buckets, 20)
    for queries after a cache of q_offset tokens."""

    def __init__(self):
        super().__init__()
        self.encoder = posenc.nn.T5RelativeBias(3, 32, 128, True)
        self.decoder = posenc.nn.T5RelativeBias(3, 16, 20, False)

    def forward(self, scores: torch.Tensor, q_offset: int):
        q_len, k_len = scores.shape[2], scores.shape[3]
        return scores + self.encoder(q_len, k_len), scores + self.decoder(q_len, k_len, q_offset)


class RopeFixture(torch.nn.Module):
    """Rotary q/k of an attention layer: RotaryEmbedding(head_dim 8, rotary_dim 6, base 100, linear factor 2,
    neox) on bshd q [B,S,4,8] / k [B,S,2,8] with per-row positions and offset 2; then gptj rope of packed thd
    tokens with cu_seqlens and attention_scale 0.5, reusing the module's frequencies."""

    def __init__(self):
        super().__init__()
        self.rotary = posenc.nn.RotaryEmbedding(8, 6, base=100.0, scaling={"rope_type": "linear", "factor": 2.0})

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, packed: torch.Tensor,
                cu_seqlens: torch.Tensor):
        q, k = self.rotary(q, k, positions, 2)
        packed = torch.ops.posenc.rope(packed, None, self.rotary.inv_freq, 0.5, "gptj", "thd", 0, cu_seqlens)
        return q, k, packed


class ScaledRopeFixture(torch.nn.Module):
    """Rotary embeddings whose frequencies follow each call's length (the op rope_inv_freq_for_length inside the
    scripted forward): dynamic NTK (head_dim 16, factor 2, max_position_embeddings 8) on bshd q/k, and LongRoPE
    (head_dim 8, short factors 1, 1.5, 2, 2.5, long factors 3, 4, 5, 6, original length 8, max 32) on a second
    pair, both without positions."""

    def __init__(self):
        super().__init__()
        self.dynamic = posenc.nn.RotaryEmbedding(16, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                              "max_position_embeddings": 8})
        self.longrope = posenc.nn.RotaryEmbedding(8, scaling={"rope_type": "longrope",
                                                              "short_factor": [1.0, 1.5, 2.0, 2.5],
                                                              "long_factor": [3.0, 4.0, 5.0, 6.0],
                                                              "original_max_position_embeddings": 8,
                                                              "max_position_embeddings": 32})

    def forward(self, q: torch.Tensor, k: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor):
        return self.dynamic(q, k) + self.longrope(q8, k8)
class QKNormRopeFixture(torch.nn.Module):
    """QK-norm + RoPE: QKNormRotaryEmbedding(head_dim 8, base 100, "gemma") on bshd q [B,S,4,8] (per-head weight
    0.1 i - 0.3, i < 8) / k [B,S,2,8] (weight over both heads, 0.05 i - 0.4, i < 16), eps 1e-6, positions [B,S];
    then rope_qk of the results with the query scale beta 0.1, length 4, shift 1 (Llama 4's form)."""

    def __init__(self):
        super().__init__()
        self.qk = posenc.nn.QKNormRotaryEmbedding(8, base=100.0, norm="gemma", k_norm_dim=16)
        with torch.no_grad():
            self.qk.q_weight.copy_(torch.arange(8) * 0.1 - 0.3)
            self.qk.k_weight.copy_(torch.arange(16) * 0.05 - 0.4)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        q, k = self.qk(q, k, positions)
        return torch.ops.posenc.rope_qk(q, k, positions, self.qk.rotary.inv_freq, 1.0, "neox", "bshd", 0, None, None,
                                        0.1, 4, 1)


class MultiaxisFixture(torch.nn.Module):
    """Multi-axis rotary: M-RoPE of bshd q [B,S,4,8] / k [B,S,2,8] (head_dim 8, sections [2, 1, 1] interleaved,
    base 100) with positions [3, B, S] and offset 1; axial 2-D rotary (head_dim 8, base 10000, gptj) of packed
    patches [T,2,8] by their (row, column); and the M-RoPE positions of token types with image grids."""

    def __init__(self):
        super().__init__()
        self.text = posenc.nn.MultimodalRotaryEmbedding(8, [2, 1, 1], 100.0, interleaved=True)
        self.vision = posenc.nn.AxialRotaryEmbedding(8, layout="gptj", format="thd")

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, patches: torch.Tensor,
                grid: torch.Tensor, token_types: torch.Tensor, image_grid_thw: torch.Tensor):
        q, k = self.text(q, k, positions, 1)
        patches, _ = self.vision(patches, patches, grid)
        mrope, deltas = torch.ops.posenc.mrope_positions(token_types, image_grid_thw)
        return q, k, patches, mrope, deltas


class VisionFixture(torch.nn.Module):
    """Images: MAE's 2-D sincos table (dim 8) added to a cls token and 2 x 3 patch tokens, the cls token left alone;
    axial rotary (head_dim 8, neox, bshd) by real coordinates [2, S], its frequencies a learned parameter."""

    def __init__(self):
        super().__init__()
        self.grid = posenc.nn.SinusoidalGridEncoding(8, "mae", num_prefix_tokens=1)
        self.rotary = posenc.nn.AxialRotaryEmbedding(8, learned_freq=True)

    def forward(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        q, k = self.rotary(q, k, positions)
        return self.grid(x, [2, 3]), q, k


class ResampledFixture(torch.nn.Module):
    """ViT's positional step: a learned float64 table [1 + 2 * 2, 4] (a cls row, then a 2 x 2 grid) resampled to a
    3 x 2 grid (bilinear, corners aligned) and added to x [B, 1 + 6, 4]."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(20, dtype=torch.float64).view(5, 4) * 0.1 - 1.0)

    def forward(self, x: torch.Tensor):
        return torch.ops.posenc.add_resampled_learned(x, self.weight, [2, 2], [3, 2], "bilinear", True, False, None, 1)


FIXTURES = {
    "sinusoidal": SinusoidalFixture,
    "learned": LearnedFixture,
    "alibi": AlibiFixture,
    "t5": T5Fixture,
    "rope": RopeFixture,
    "scaled_rope": ScaledRopeFixture,
    "multiaxis": MultiaxisFixture,
    "qk_norm_rope": QKNormRopeFixture,
    "vision": VisionFixture,
    "resampled": ResampledFixture,
}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    for name, build in FIXTURES.items():
        torch.jit.script(build()).save(str(out / f"{name}.pt"))
        print(f"saved {out / name}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
