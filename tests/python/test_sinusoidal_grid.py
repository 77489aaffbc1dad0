"""Sinusoidal encodings of image and video grids (ViT / MAE, DiT, PixArt, SD3, CogVideoX, timm): the multi-axis
sinusoidal ops (sinusoidal and add_sinusoidal with pair_axis, the "half_per_axis" layout, num_prefix_tokens), the
grid frequencies (grid_sinusoidal_inv_freq), the grid coordinates (grid_positions) and posenc.nn.SinusoidalGridEncoding.

References: MAE's numpy formula and timm's build_sincos2d_pos_embed written here in float64; diffusers' own
get_2d_sincos_pos_embed, PatchEmbed (SD3's cropped table), get_3d_sincos_pos_embed and CogVideoXPatchEmbed, within
one rounding in float32 (their tables are float64 rounded to float32; posenc's float32 sin and cos are within 2e-7 of
the exact value, docs/architecture.md); float64 formulas written here for every layout; timm's own function where timm is installed.
Then gradients, opcheck, torch.compile, torch.export, TorchScript and the bad inputs."""
import math
import re

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import posenc
from helpers import first_difference, randn, same_bits, tolerance
from posenc import functional as PF

OPS = torch.ops.posenc
F64 = torch.float64
LAYOUTS = ["interleaved", "half", "half_cos_first", "half_per_axis"]
CONVENTIONS = ["mae", "timm", "timm_interleaved", "cogvideox"]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def assert_same_bits(actual, expected, what=""):
    assert same_bits(actual, expected), f"{what}: {first_difference(actual, expected)}"


def assert_within_rounding(actual, expected, what=""):
    """The same values but for the float32 rounding of the table: sin and cos within 2e-7 of the exact value
    (posenc's angle engine) against a table rounded to nearest (within 6e-8), then at most one rounding of a sum
    (one ulp of the result's dtype)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert_close(actual.float(), expected.float(), rtol=torch.finfo(actual.dtype).eps, atol=2.6e-7, msg=what)


def grid_frequencies(dim, convention="mae", base=10000.0):
    inv_freq, pair_axis, layout = OPS.grid_sinusoidal_inv_freq(dim, convention, base)
    return inv_freq, pair_axis, layout


# ---------------------------------------------------------------- float64 references written here

def axis_runs(pair_axis):
    """(start, length) of each run of consecutive pairs with the same axis."""
    axes = [int(a) for a in pair_axis]
    runs, start = [], 0
    for i in range(1, len(axes) + 1):
        if i == len(axes) or axes[i] != axes[start]:
            runs.append((start, i - start))
            start = i
    return runs


def reference_pe(positions, inv_freq, layout, pair_axis=None, offset=0):
    """float64 encoding from the definition. Without pair_axis: angle[..., i] = (p + offset) * w_i. With it,
    positions [n_axes, ...]: pair i takes positions[pair_axis[i]] + offset. Channels per layout: interleaved (sin,
    cos per pair), half (all sines, then all cosines), half_cos_first (cosines first), half_per_axis (each run of
    pairs on one axis: its sines, then its cosines; without pair_axis the whole as one run, i.e. half)."""
    p = positions.to(F64) + offset
    w = inv_freq.to(F64)
    if pair_axis is None:
        angle = p[..., None] * w
    else:
        angle = p[pair_axis.long()].movedim(0, -1) * w
    s, c = angle.sin(), angle.cos()
    if layout == "interleaved":
        return torch.stack([s, c], -1).flatten(-2)
    if layout == "half":
        return torch.cat([s, c], -1)
    if layout == "half_cos_first":
        return torch.cat([c, s], -1)
    assert layout == "half_per_axis"
    runs = axis_runs(pair_axis) if pair_axis is not None else [(0, w.numel())]
    return torch.cat([part for a, n in runs for part in (s[..., a:a + n], c[..., a:a + n])], -1)


def mae_get_1d_sincos_pos_embed_from_grid(embed_dim, pos):
    """facebookresearch/mae util/pos_embed.py (numpy, float64 frequencies)."""
    assert embed_dim % 2 == 0
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.
    omega = 1. / 10000 ** omega  # (D/2,)
    pos = pos.reshape(-1)  # (M,)
    out = np.einsum("m,d->md", pos, omega)  # (M, D/2), outer product
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)  # (M, D)


def mae_get_2d_sincos_pos_embed(embed_dim, grid_size, cls_token=False):
    """facebookresearch/mae util/pos_embed.py get_2d_sincos_pos_embed: [(1 +) grid_size ** 2, embed_dim]."""
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)  # here w goes first
    grid = np.stack(grid, axis=0)
    grid = grid.reshape([2, 1, grid_size, grid_size])
    emb_h = mae_get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0])  # (H*W, D/2)
    emb_w = mae_get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1])  # (H*W, D/2)
    pos_embed = np.concatenate([emb_h, emb_w], axis=1)  # (H*W, D)
    if cls_token:
        pos_embed = np.concatenate([np.zeros([1, embed_dim]), pos_embed], axis=0)
    return pos_embed


def timm_build_sincos2d_pos_embed(feat_shape, dim, temperature=10000.0, interleave_sin_cos=False):
    """timm's build_sincos2d_pos_embed (timm/layers/pos_embed_sincos.py), written in float64: [N, dim]."""
    assert dim % 4 == 0
    pos_dim = dim // 4
    bands = 1.0 / temperature ** (torch.arange(pos_dim, dtype=F64) / pos_dim)
    grid = torch.stack(torch.meshgrid([torch.arange(s, dtype=F64) for s in feat_shape], indexing="ij"))
    grid = grid.flatten(1).transpose(0, 1)  # [N, 2]: (row, column)
    pos2 = grid.unsqueeze(-1) * bands.unsqueeze(0)  # [N, 2, pos_dim]
    stack_dim = 2 if interleave_sin_cos else 1  # sin, cos, sin, cos instead of sin, sin, cos, cos
    return torch.stack([torch.sin(pos2), torch.cos(pos2)], dim=stack_dim).flatten(1)


def float32_grid(grid, crop_from=None, scale=None, interpolation_scale=1.0):
    """diffusers' float32 coordinates: (i + start) / scale / interpolation_scale, each division in float32;
    [len(grid), prod(grid)], tokens row-major."""
    axes = []
    for a, n in enumerate(grid):
        start = (crop_from[a] - n) // 2 if crop_from is not None else 0
        coordinate = torch.arange(start, start + n, dtype=torch.float32)
        if scale is not None:
            coordinate = coordinate / torch.tensor(scale[a], dtype=torch.float32)
        axes.append(coordinate / torch.tensor(interpolation_scale, dtype=torch.float32))
    return torch.stack([m.reshape(-1) for m in torch.meshgrid(axes, indexing="ij")])


# ---------------------------------------------------------------- the grid frequencies

@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("dim", [16, 32, 768, 1152])
@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_grid_inv_freq_conventions(convention, dim, base):
    def ladder(n):
        return [1.0 / base ** (k / n) for k in range(n)]

    q = dim // 4
    if convention == "cogvideox":
        t, s = dim // 8, 3 * dim // 16
        expected, axes, layout = ladder(t) + ladder(s) * 2, [0] * t + [2] * s + [1] * s, "half_per_axis"
    elif convention == "mae":
        expected, axes, layout = ladder(q) * 2, [1] * q + [0] * q, "half_per_axis"
    else:
        expected, axes, layout = ladder(q) * 2, [0] * q + [1] * q, \
            "half" if convention == "timm" else "half_per_axis"
    inv_freq, pair_axis, got_layout = grid_frequencies(dim, convention, base)
    assert inv_freq.dtype == F64 and inv_freq.shape == (dim // 2,)
    assert pair_axis.dtype == torch.int64 and pair_axis.tolist() == axes
    assert got_layout == layout
    assert_close(inv_freq, torch.tensor(expected, dtype=F64), rtol=1e-15, atol=0)


def test_grid_inv_freq_of_mae_are_those_of_mae_and_diffusers():
    """MAE / diffusers compute omega = arange(D/4) / (D/4), 1 / 10000 ** omega in float64: within one rounding."""
    for dim in (64, 1024):
        omega = torch.arange(dim // 4, dtype=F64) / (dim / 4)
        expected = 1.0 / 10000 ** omega
        inv_freq, _, _ = grid_frequencies(dim, "mae")
        assert_close(inv_freq, torch.cat([expected, expected]), rtol=2.3e-16, atol=0)


# ---------------------------------------------------------------- grid_positions

@pytest.mark.parametrize("grid, crop_from, scale, interpolation_scale", [
    ([3, 5], None, None, 1.0),
    ([48, 36], None, [48 / 64, 36 / 64], 2.0),  # PixArt at another resolution: non-integer ratios
    ([7, 5], None, [7 / 3, 5 / 3], 1.5),
    ([15, 9], [24, 24], [24 / 16, 24 / 16], 1.0),  # SD3: the centre crop of a 24 x 24 table, odd offsets
    ([4, 6, 9], None, [1.0, 1.875, 1.875], 1.0),  # CogVideoX
    ([5], None, [0.3], 0.7),
    ([2, 3, 4], [2, 7, 8], [2.0, 0.1, 3.0], 1.1),
])
def test_grid_positions_are_diffusers_float32_coordinates(grid, crop_from, scale, interpolation_scale):
    got = OPS.grid_positions(grid, crop_from, scale, interpolation_scale)
    assert got.dtype == torch.float32 and got.shape == (len(grid), math.prod(grid)) and got.device.type == "cpu"
    assert_same_bits(got, float32_grid(grid, crop_from, scale, interpolation_scale), f"grid {grid}")


def test_grid_positions_defaults_and_empty_grids():
    assert torch.equal(OPS.grid_positions([2, 3]), PF.image_positions(2, 3).float())
    assert torch.equal(OPS.grid_positions([2, 2, 3]), PF.video_positions(2, 2, 3).float())
    assert OPS.grid_positions([0, 3]).shape == (2, 0)
    assert OPS.grid_positions([4, 0, 2]).shape == (3, 0)


def test_python_wrappers_pass_the_new_arguments():
    """posenc.frequencies.grid_sinusoidal, posenc.functional.grid_positions / sinusoidal / add_sinusoidal: the ops'
    results for the same arguments."""
    inv_freq, pair_axis, layout = posenc.frequencies.grid_sinusoidal(32, "cogvideox", 100.0)
    expected = OPS.grid_sinusoidal_inv_freq(32, "cogvideox", 100.0)
    assert torch.equal(inv_freq, expected[0]) and torch.equal(pair_axis, expected[1]) and layout == expected[2]
    positions = PF.grid_positions([2, 3, 4], [2, 5, 4], [1.0, 1.875, 1.875], 0.5)
    assert_same_bits(positions, OPS.grid_positions([2, 3, 4], [2, 5, 4], [1.0, 1.875, 1.875], 0.5))
    assert_same_bits(PF.sinusoidal(positions, inv_freq, layout, F64, 1, pair_axis),
                     OPS.sinusoidal(positions, inv_freq, layout, F64, 1, pair_axis))
    x = torch.randn(2, 1 + 24, 33)
    assert_same_bits(PF.add_sinusoidal(x, positions, inv_freq, 2.0, layout, 1, pair_axis, 1),
                     OPS.add_sinusoidal(x, positions, inv_freq, 2.0, layout, 1, pair_axis, 1))


# ---------------------------------------------------------------- MAE

@pytest.mark.parametrize("dim, grid", [(16, 1), (32, 7), (768, 14), (1024, 16)])
def test_mae_pos_embed_within_rounding(dim, grid):
    """MAE's pos_embed parameter (its numpy table, `.float()`, a zero cls row): x + pos_embed, and the table."""
    pos_embed = torch.from_numpy(mae_get_2d_sincos_pos_embed(dim, grid, cls_token=True)).float()
    inv_freq, pair_axis, layout = grid_frequencies(dim, "mae")
    positions = PF.image_positions(grid, grid)
    x = randn(2, 1 + grid * grid, dim, seed=dim)
    x[0, 0, :3] = torch.tensor([-0.0, 0.0, -0.0])
    out = OPS.add_sinusoidal(x, positions, inv_freq, layout=layout, pair_axis=pair_axis, num_prefix_tokens=1)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert_same_bits(out[:, :1], x[:, :1], "cls token")
    assert_within_rounding(out[:, 1:], x[:, 1:] + pos_embed[1:], "patches")
    table = OPS.sinusoidal(positions, inv_freq, layout, pair_axis=pair_axis)
    assert_within_rounding(table, pos_embed[1:], "table")
    module = posenc.nn.SinusoidalGridEncoding(dim, "mae", num_prefix_tokens=1)
    assert_same_bits(module(x, (grid, grid)), out, "module")


# ---------------------------------------------------------------- diffusers

@pytest.mark.parametrize("dim, grid_size, base_size, interpolation_scale", [
    (64, (16, 16), 16, 1.0),  # the defaults
    (256, (64, 64), 64, 2.0),  # PixArt-alpha 1024: base 64, interpolation_scale 2
    (32, (48, 36), 64, 2.0),  # another resolution: non-integer ratios, non-square
    (48, (30, 20), 32, 0.5),
    (24, (7, 5), 3, 1.5),
])
def test_diffusers_2d_sincos_pos_embed_within_rounding(dim, grid_size, base_size, interpolation_scale):
    from diffusers.models.embeddings import get_2d_sincos_pos_embed
    h, w = grid_size
    expected = get_2d_sincos_pos_embed(dim, grid_size, base_size=base_size, interpolation_scale=interpolation_scale,
                                       output_type="pt").float()  # PatchEmbed's float32 buffer
    inv_freq, pair_axis, layout = grid_frequencies(dim, "mae")
    positions = OPS.grid_positions([h, w], None, [h / base_size, w / base_size], interpolation_scale)
    table = OPS.sinusoidal(positions, inv_freq, layout, pair_axis=pair_axis)
    assert table.dtype == torch.float32
    assert_within_rounding(table, expected, "table")
    x = randn(2, h * w, dim, seed=3)
    module = posenc.nn.SinusoidalGridEncoding(dim, "mae", base_size=base_size, interpolation_scale=interpolation_scale)
    assert_within_rounding(module(x, (h, w)), x + expected, "module")


SD3_CASES = [
    # dim, patch, sample size (base_size = sample // patch), pos_embed_max_size M, latent height, width, interp
    (64, 2, 32, 24, 32, 32, 1),  # base 16: a centred 16 x 16 crop of 24 x 24
    (48, 2, 32, 24, 30, 18, 1),  # 15 x 9: odd offsets, non-square
    (32, 2, 40, 20, 40, 14, 2.0),  # the whole height, interpolation_scale 2
]


@pytest.mark.parametrize("dim, patch, sample, max_size, height, width, interpolation_scale", SD3_CASES)
def test_sd3_cropped_pos_embed_within_rounding(dim, patch, sample, max_size, height, width, interpolation_scale):
    """diffusers' PatchEmbed with pos_embed_max_size (SD3): its cropped_pos_embed table, and its forward
    (projected latent + cropped table) in float32."""
    from diffusers.models.embeddings import PatchEmbed
    torch.manual_seed(0)
    embed = PatchEmbed(height=sample, width=sample, patch_size=patch, in_channels=4, embed_dim=dim,
                       interpolation_scale=interpolation_scale, pos_embed_type="sincos", pos_embed_max_size=max_size)
    h, w = height // patch, width // patch
    expected = embed.cropped_pos_embed(height, width)[0]
    assert expected.dtype == torch.float32 and expected.shape == (h * w, dim)
    inv_freq, pair_axis, layout = grid_frequencies(dim, "mae")
    positions = OPS.grid_positions([h, w], [max_size, max_size], [max_size / embed.base_size] * 2,
                                   float(interpolation_scale))
    assert_within_rounding(OPS.sinusoidal(positions, inv_freq, layout, pair_axis=pair_axis), expected, "table")

    latent = randn(2, 4, height, width, seed=5)
    with torch.no_grad():
        tokens = embed.proj(latent).flatten(2).transpose(1, 2)  # [B, h * w, dim], a transposed view
        reference = embed(latent)
    out = OPS.add_sinusoidal(tokens, positions, inv_freq, layout=layout, pair_axis=pair_axis)
    assert_within_rounding(out, reference, "forward")
    module = posenc.nn.SinusoidalGridEncoding(dim, "mae", base_size=embed.base_size,
                                             interpolation_scale=float(interpolation_scale), max_size=max_size)
    assert_same_bits(module(tokens, (h, w)), out, "module")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sd3_latent_plus_float32_table_in_half_dtypes(dtype):
    """PatchEmbed adds its float32 table to a bf16 / fp16 latent and casts back: (x.float() + table).to(dtype)."""
    from diffusers.models.embeddings import PatchEmbed
    dim, max_size, h, w = 64, 24, 11, 17
    embed = PatchEmbed(height=32, width=32, patch_size=2, in_channels=4, embed_dim=dim, pos_embed_type="sincos",
                       pos_embed_max_size=max_size)
    table = embed.cropped_pos_embed(2 * h, 2 * w)[0]
    x = randn(3, h * w, dim, dtype=dtype, seed=7)
    inv_freq, pair_axis, layout = grid_frequencies(dim, "mae")
    positions = OPS.grid_positions([h, w], [max_size] * 2, [max_size / embed.base_size] * 2)
    out = OPS.add_sinusoidal(x, positions, inv_freq, layout=layout, pair_axis=pair_axis)
    assert out.dtype == dtype
    assert_within_rounding(out, (x.float() + table).to(dtype), str(dtype))


COGVIDEOX_CASES = [
    # dim, frames, height, width, spatial_interpolation_scale, temporal_interpolation_scale
    (64, 3, 6, 9, 1.875, 1.0),  # CogVideoX's scales; W != H
    (96, 13, 5, 4, 1.875, 1.0),
    (32, 4, 3, 7, 0.75, 2.5),
]


@pytest.mark.parametrize("dim, frames, height, width, spatial_scale, temporal_scale", COGVIDEOX_CASES)
def test_diffusers_3d_sincos_pos_embed_within_rounding(dim, frames, height, width, spatial_scale, temporal_scale):
    from diffusers.models.embeddings import get_3d_sincos_pos_embed
    expected = get_3d_sincos_pos_embed(dim, (width, height), frames, spatial_scale, temporal_scale,
                                       output_type="pt")  # spatial_size is (W, H)
    expected = expected.flatten(0, 1).float()
    inv_freq, pair_axis, layout = grid_frequencies(dim, "cogvideox")
    positions = OPS.grid_positions([frames, height, width], None, [temporal_scale, spatial_scale, spatial_scale])
    table = OPS.sinusoidal(positions, inv_freq, layout, pair_axis=pair_axis)
    assert table.shape == (frames * height * width, dim)
    assert_within_rounding(table, expected, "table")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = randn(2, frames * height * width, dim, dtype=dtype, seed=11)
        out = OPS.add_sinusoidal(x, positions, inv_freq, layout=layout, pair_axis=pair_axis)
        assert_within_rounding(out, (x.float() + expected).to(dtype), str(dtype))


def test_cogvideox_patch_embed_text_tokens_are_prefix_tokens():
    """CogVideoXPatchEmbed's joint table: zero rows for the text tokens, then the video's 3-D table; in float32
    embeds + table is our add_sinusoidal with the text tokens as prefix tokens."""
    from diffusers.models.embeddings import CogVideoXPatchEmbed
    text, dim = 5, 64
    embed = CogVideoXPatchEmbed(patch_size=2, in_channels=4, embed_dim=dim, text_embed_dim=8, sample_width=18,
                                sample_height=12, sample_frames=9, temporal_compression_ratio=4,
                                max_text_seq_length=text, spatial_interpolation_scale=1.875,
                                temporal_interpolation_scale=1.0, use_positional_embeddings=True,
                                use_learned_positional_embeddings=False)
    grid = (3, 6, 9)  # (9 - 1) // 4 + 1 frames, 12 // 2 rows, 18 // 2 columns
    table = embed.pos_embedding.to(torch.float32)  # what its forward adds to float32 embeds
    assert table.shape == (1, text + math.prod(grid), dim)
    x = randn(2, text + math.prod(grid), dim, seed=13)
    inv_freq, pair_axis, layout = grid_frequencies(dim, "cogvideox")
    positions = OPS.grid_positions(list(grid), None, [1.0, 1.875, 1.875])
    out = OPS.add_sinusoidal(x, positions, inv_freq, layout=layout, pair_axis=pair_axis, num_prefix_tokens=text)
    assert_within_rounding(out, x + table, "embeds + pos_embedding")
    module = posenc.nn.SinusoidalGridEncoding(dim, "cogvideox", num_prefix_tokens=text,
                                             interpolation_scale=(1.0, 1.875))
    assert_same_bits(module(x, grid), out, "module")


# ---------------------------------------------------------------- timm

@pytest.mark.parametrize("convention", ["timm", "timm_interleaved"])
@pytest.mark.parametrize("feat_shape, dim, temperature", [((6, 9), 32, 10000.0), ((14, 14), 768, 10000.0),
                                                          ((5, 3), 64, 100.0)])
def test_timm_build_sincos2d_pos_embed(convention, feat_shape, dim, temperature):
    interleave = convention == "timm_interleaved"
    expected = timm_build_sincos2d_pos_embed(feat_shape, dim, temperature, interleave)
    inv_freq, pair_axis, layout = grid_frequencies(dim, convention, temperature)
    positions = PF.image_positions(*feat_shape)
    table = OPS.sinusoidal(positions, inv_freq, layout, pair_axis=pair_axis)
    assert table.dtype == torch.float32
    assert_close(table.double(), expected, atol=1e-6, rtol=0)
    x = randn(2, math.prod(feat_shape), dim, seed=17)
    module = posenc.nn.SinusoidalGridEncoding(dim, convention, base=temperature)
    assert_close(module(x, feat_shape).double(), x.double() + expected, atol=2e-6, rtol=0)
    try:  # timm's own function (it computes in float32), where timm is installed
        from timm.layers import build_sincos2d_pos_embed
    except ImportError:
        return
    timm_table = build_sincos2d_pos_embed(list(feat_shape), dim, temperature, interleave_sin_cos=interleave)
    assert_close(table, timm_table, atol=5e-6, rtol=0)


# ---------------------------------------------------------------- values: every layout, float64, golden

def test_half_per_axis_channel_order_golden():
    """pair_axis [0, 0, 1], positions (1, 2), inv_freq (1, 0.5, 0.25): runs [pairs 0-1 on axis 0], [pair 2 on
    axis 1] -> sin(1), sin(0.5), cos(1), cos(0.5), sin(0.5), cos(0.5)."""
    positions = torch.tensor([[1], [2]])
    inv_freq = torch.tensor([1.0, 0.5, 0.25], dtype=F64)
    pair_axis = torch.tensor([0, 0, 1])
    out = OPS.sinusoidal(positions, inv_freq, "half_per_axis", F64, pair_axis=pair_axis)
    expected = torch.tensor([[math.sin(1), math.sin(0.5), math.cos(1), math.cos(0.5), math.sin(0.5),
                              math.cos(0.5)]], dtype=F64)
    assert_close(out, expected, atol=1e-15, rtol=0)
    # Interleaved axes: runs of one pair, the same channels as "interleaved".
    alternating = torch.tensor([0, 1, 0, 1])
    w = torch.tensor([1.0, 0.5, 0.25, 0.125], dtype=F64)
    assert_same_bits(OPS.sinusoidal(positions, w, "half_per_axis", F64, pair_axis=alternating),
                     OPS.sinusoidal(positions, w, "interleaved", F64, pair_axis=alternating))


PAIR_AXES = {
    "blocks": [1] * 3 + [0] * 4,  # MAE-like, odd sizes
    "alternating": [0, 1] * 3 + [0],  # runs of length 1
    "three_axes": [0, 0, 2, 1, 1, 1, 2],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("axes", list(PAIR_AXES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("position_dtype", [torch.int64, torch.int32, torch.float32, torch.float64])
def test_sinusoidal_table_every_layout_with_pair_axis(layout, axes, dtype, position_dtype):
    pair_axis = torch.tensor(PAIR_AXES[axes], dtype=torch.int32 if position_dtype == torch.int32 else torch.int64)
    n_axes = int(pair_axis.max()) + 1
    inv_freq = posenc.frequencies.sinusoidal(14, base=500.0)
    positions = (torch.randint(-50, 3000, (n_axes, 2, 5)) + torch.rand(n_axes, 2, 5) * 0.75).to(position_dtype)
    out = OPS.sinusoidal(positions, inv_freq, layout, dtype, 3, pair_axis)
    assert out.dtype == dtype and out.shape == (2, 5, 14)
    assert_close(out.double(), reference_pe(positions, inv_freq, layout, pair_axis, 3), **tolerance(dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shared", [True, False])
def test_add_sinusoidal_float64_every_layout(layout, shared):
    """float64 x, float positions per axis, a prefix token: x * x_scale + PE from the float64 formula."""
    pair_axis = torch.tensor(PAIR_AXES["three_axes"])
    inv_freq = posenc.frequencies.sinusoidal(15)  # 7 pairs in 15 channels: the last one gets no encoding
    x = torch.randn(3, 1 + 6, 15, dtype=F64)
    positions = torch.rand(3, 6, dtype=F64) * 100 if shared else torch.rand(3, 3, 6, dtype=F64) * 100
    out = OPS.add_sinusoidal(x, positions, inv_freq, 0.5, layout, 2, pair_axis, 1)
    pe = reference_pe(positions, inv_freq, layout, pair_axis, 2)
    expected = x * 0.5
    expected[:, 1:, :14] += pe
    assert out.dtype == F64
    assert_close(out, expected, atol=1e-13, rtol=1e-13)
    assert_same_bits(out[:, 0], x[:, 0] * 0.5, "prefix")


def test_half_per_axis_without_pair_axis_is_half():
    inv_freq = posenc.frequencies.sinusoidal(16)
    positions = torch.randint(0, 5000, (3, 7))
    assert_same_bits(OPS.sinusoidal(positions, inv_freq, "half_per_axis"), OPS.sinusoidal(positions, inv_freq, "half"))
    x = torch.randn(3, 7, 17)
    assert_same_bits(OPS.add_sinusoidal(x, positions, inv_freq, 2.0, "half_per_axis", 3),
                     OPS.add_sinusoidal(x, positions, inv_freq, 2.0, "half", 3))


@pytest.mark.parametrize("layout", ["interleaved", "half", "half_cos_first"])
def test_equal_axes_give_the_bits_of_one_axis(layout):
    """Every axis at the same position: the bits of the call without pair_axis."""
    inv_freq = posenc.frequencies.sinusoidal(24)
    pair_axis = torch.tensor([0, 1, 2] * 4)
    positions = torch.randint(0, 2 ** 30, (2, 9))  # far positions too
    assert_same_bits(OPS.sinusoidal(positions.expand(3, 2, 9), inv_freq, layout, pair_axis=pair_axis),
                     OPS.sinusoidal(positions, inv_freq, layout))
    x = torch.randn(2, 10, 24, dtype=torch.bfloat16)
    assert_same_bits(OPS.add_sinusoidal(x, positions.expand(3, 2, 9), inv_freq, 1.0, layout, 0, pair_axis, 1)[:, 1:],
                     OPS.add_sinusoidal(x[:, 1:], positions, inv_freq, 1.0, layout))


# ---------------------------------------------------------------- num_prefix_tokens

@pytest.mark.parametrize("prefix", [0, 1, 5])
@pytest.mark.parametrize("kind", ["shared", "per_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("x_scale", [1.0, 0.5])
def test_num_prefix_tokens_with_pair_axis(prefix, kind, dtype, x_scale):
    """cls token (1), cls + 4 registers (5): prefix rows are x * x_scale, bits and -0.0 included; the others get
    PE(position of token s - prefix), rounded to float32, added, then rounded to x's dtype."""
    batch, n, dim = 3, 12, 32
    inv_freq, pair_axis, layout = grid_frequencies(dim, "mae")
    x = randn(batch, prefix + n, dim, dtype=dtype, seed=prefix)
    x[:, :prefix, ::3] = -0.0
    grid = PF.image_positions(3, 4)
    positions = grid if kind == "shared" else torch.stack([grid.roll(b, 1) for b in range(batch)], 1)  # [2, B, N]
    out = OPS.add_sinusoidal(x, positions, inv_freq, x_scale, layout, 0, pair_axis, prefix)
    assert out.dtype == dtype and out.shape == x.shape
    assert_same_bits(out[:, :prefix], x[:, :prefix] * x_scale, "prefix tokens")
    assert torch.signbit(out[:, :prefix, ::3]).all()  # -0.0 stays -0.0
    pe = reference_pe(positions, inv_freq, layout, pair_axis)
    assert_close(out[:, prefix:].double(), x[:, prefix:].double() * x_scale + pe, **tolerance(dtype))
    if dtype != F64:
        pe32 = OPS.sinusoidal(positions, inv_freq, layout, torch.float32, 0, pair_axis)
        assert_same_bits(out[:, prefix:], (x[:, prefix:].float() * x_scale + pe32).to(dtype), "rounded once")


@pytest.mark.parametrize("prefix", [0, 1, 5])
@pytest.mark.parametrize("kind", ["none", "shared", "per_row"])
def test_num_prefix_tokens_without_pair_axis(prefix, kind):
    batch, n, dim = 2, 7, 18
    inv_freq = posenc.frequencies.sinusoidal(dim)
    x = torch.randn(batch, prefix + n, dim)
    positions = {"none": None, "shared": torch.randint(0, 5000, (n,)),
                 "per_row": torch.randint(0, 5000, (batch, n))}[kind]
    out = OPS.add_sinusoidal(x, positions, inv_freq, 1.5, "half", 4, None, prefix)
    assert_same_bits(out[:, :prefix], x[:, :prefix] * 1.5, "prefix tokens")
    reference_positions = torch.arange(n) if positions is None else positions
    expected = x[:, prefix:].double() * 1.5 + reference_pe(reference_positions, inv_freq, "half", offset=4)
    assert_close(out[:, prefix:].double(), expected, **tolerance(torch.float32))


def test_every_token_a_prefix_token():
    x = torch.randn(2, 4, 8)
    inv_freq, pair_axis, layout = grid_frequencies(8, "mae")
    out = OPS.add_sinusoidal(x, torch.zeros(2, 0), inv_freq, 3.0, layout, 0, pair_axis, 4)
    assert_same_bits(out, x * 3.0)
    assert_same_bits(OPS.add_sinusoidal(x, None, inv_freq, 3.0, "half", 0, None, 4), x * 3.0)


def test_prefix_tokens_of_a_strided_x():
    base = torch.randn(7, 2, 40)
    x = base.transpose(0, 1)[:, :, ::2]  # [2, 7, 20], not contiguous
    inv_freq, pair_axis, layout = grid_frequencies(20, "timm_interleaved")
    positions = PF.image_positions(2, 3)
    out = OPS.add_sinusoidal(x, positions, inv_freq, 1.0, layout, 0, pair_axis, 1)
    assert_same_bits(out, OPS.add_sinusoidal(x.contiguous(), positions, inv_freq, 1.0, layout, 0, pair_axis, 1))
    assert_same_bits(out[:, 0], x[:, 0])
    assert_close(out[:, 1:].double(), x[:, 1:].double() + reference_pe(positions, inv_freq, layout, pair_axis),
                 **tolerance(torch.float32))


def test_threads_split_grid_rows_alike(same_bits_for_any_thread_count):
    """A model-sized call (ViT-L, 3 x 257 tokens x 1024): the same bits for 1, 2 and 3 threads, and the formula."""
    inv_freq, pair_axis, layout = grid_frequencies(1024, "mae")
    x = torch.randn(3, 257, 1024)
    positions = OPS.grid_positions([16, 16], None, [0.5, 0.5], 1.0)
    out = same_bits_for_any_thread_count(
        lambda: OPS.add_sinusoidal(x, positions, inv_freq, 1.0, layout, 0, pair_axis, 1))
    assert_same_bits(out[:, 0], x[:, 0])
    assert_close(out[:, 1:].double(), x[:, 1:].double() + reference_pe(positions, inv_freq, layout, pair_axis),
                 **tolerance(torch.float32))


def test_axis_values_kept_between_calls_follow_frequencies_and_positions():
    """Each thread keeps an axis's sin and cos from call to call, keyed by the axis's frequencies bit for bit: calls
    that change the grid, overflow what an axis keeps (256 values at 1024 channels), meet more frequency sets than
    a thread keeps, or differ in a frequency's last bit each get their own values, against the formula."""
    inv_freq, pair_axis, layout = grid_frequencies(1024, "mae")

    def check(freq, grid, what):
        positions = OPS.grid_positions(grid, None, None, 1.0)
        x = torch.randn(2, positions.shape[1], 1024)
        out = OPS.add_sinusoidal(x, positions, freq, 1.0, layout, 0, pair_axis, 0)
        assert_close(out.double(), x.double() + reference_pe(positions, freq, layout, pair_axis),
                     **tolerance(torch.float32), msg=what)

    check(inv_freq, [16, 16], "first grid")
    check(inv_freq, [300, 2], "300 rows: past what an axis keeps")
    check(inv_freq, [16, 16], "first grid again")
    for k in range(8):  # more frequency sets than a thread keeps
        check(inv_freq * (1.5 + k), [9, 7], f"frequencies x {1.5 + k}")
    check(inv_freq, [16, 16], "first grid after eight others")
    # runs of one channel (each token's encoding copied together) on two axes of equal frequencies, which share what
    # they keep: every entry a token needs made before any is read
    w = posenc.frequencies.sinusoidal(8).repeat_interleave(2).to(F64)
    axes = torch.tensor([0, 1] * 4)
    for scale in (1.5, 2.5, 3.5, 4.5, 5.5):  # new positions each time, none 0 (whose sin is as small as a bad read)
        positions = OPS.grid_positions([40, 40], None, None, 1.0).double() * scale + 1.0
        assert_close(OPS.sinusoidal(positions, w, "interleaved", F64, 0, axes),
                     reference_pe(positions, w, "interleaved", axes), **tolerance(F64), msg=f"scale {scale}")
    pairs = torch.tensor([0, 1, 0, 1])
    positions = OPS.grid_positions([3, 3], None, None, 1.0) + 1e6  # a last-bit change of a frequency shows
    for first in (0.5, math.nextafter(0.5, 1.0), 0.5):
        freq = torch.tensor([first, 0.5, 0.125, 0.25], dtype=F64)
        table = OPS.sinusoidal(positions, freq, "half", torch.float32, 0, pairs)
        assert_close(table.double(), reference_pe(positions, freq, "half", pairs), **tolerance(torch.float32),
                     msg=f"first frequency {first!r}")


# ---------------------------------------------------------------- backward, opcheck, compile, export, script

@pytest.mark.parametrize("x_scale", [1.0, 2.5])
def test_gradcheck_through_x(x_scale):
    inv_freq, pair_axis, layout = grid_frequencies(8, "mae")
    positions = torch.randint(0, 20, (2, 2, 6))
    x = torch.randn(2, 1 + 6, 8, dtype=F64, requires_grad=True)

    def fn(t):
        return OPS.add_sinusoidal(t, positions, inv_freq, x_scale, layout, 1, pair_axis, 1)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))
    x32 = torch.randn(2, 7, 8, requires_grad=True)
    grad = torch.randn(2, 7, 8)
    OPS.add_sinusoidal(x32, positions, inv_freq, x_scale, layout, 1, pair_axis, 1).backward(grad)
    assert_same_bits(x32.grad, grad * x_scale, "d/dx = x_scale")


def opcheck_samples():
    inv_freq, pair_axis, layout = grid_frequencies(16, "cogvideox")
    positions = OPS.grid_positions([2, 2, 3], None, [1.0, 1.875, 1.875])
    yield "sinusoidal", OPS.sinusoidal.default, (positions, inv_freq, layout, None, 0, pair_axis)
    yield "sinusoidal_int32", OPS.sinusoidal.default, (positions.int(), inv_freq, "half", torch.float64, 2,
                                                       pair_axis.int())
    x = torch.randn(2, 13, 17, requires_grad=True)
    yield "add_sinusoidal", OPS.add_sinusoidal.default, (x, positions, inv_freq, 2.0, layout, 0, pair_axis, 1)
    rows = torch.randint(0, 9, (3, 2, 12))
    yield "add_sinusoidal_rows", OPS.add_sinusoidal.default, (x, rows, inv_freq, 1.0, "interleaved", 3, pair_axis, 1)
    yield "add_sinusoidal_no_axes", OPS.add_sinusoidal.default, (x, None, inv_freq, 1.0, "half", 0, None, 5)


@pytest.mark.parametrize("sample", list(opcheck_samples()), ids=lambda s: s[0])
def test_opcheck(sample):
    _, op, args = sample
    torch.library.opcheck(op, args)


def test_compile_fullgraph_forward_and_backward(compiled_matches_eager):
    inv_freq, pair_axis, layout = grid_frequencies(32, "mae")
    positions = PF.image_positions(3, 4)

    def fn(x):
        return OPS.add_sinusoidal(x * 2, positions, inv_freq, 2.5, layout, 0, pair_axis, 1).tanh()

    x = torch.randn(2, 13, 32, requires_grad=True)
    compiled_matches_eager(fn, [x], [x])
    module = posenc.nn.SinusoidalGridEncoding(32, "timm", num_prefix_tokens=1)
    compiled_matches_eager(lambda x: module(x, (3, 4)), [x], [x])


@pytest.mark.parametrize("dim, convention, grid, prefix, base_size, interpolation_scale", [
    (32, "mae", (3, 4), 1, None, 1.0),
    (32, "timm", (5, 2), 0, None, 1.0),
    (32, "timm_interleaved", (2, 2), 5, None, 1.0),
    (48, "cogvideox", (2, 3, 4), 2, None, (1.0, 1.875)),
    (32, "mae", (12, 20), 0, 16, 2.0),
])
def test_module_equals_the_functional_call(dim, convention, grid, prefix, base_size, interpolation_scale):
    module = posenc.nn.SinusoidalGridEncoding(dim, convention, num_prefix_tokens=prefix, base_size=base_size,
                                             interpolation_scale=interpolation_scale)
    inv_freq, pair_axis, layout = grid_frequencies(dim, convention)
    if len(grid) == 3:
        temporal, spatial = interpolation_scale
        positions = OPS.grid_positions(list(grid), None, [temporal, spatial, spatial])
    elif base_size is not None:
        positions = OPS.grid_positions(list(grid), None, [n / base_size for n in grid], interpolation_scale)
    else:
        positions = OPS.grid_positions(list(grid), None, None, interpolation_scale)
    x = torch.randn(2, prefix + math.prod(grid), dim)
    expected = OPS.add_sinusoidal(x, positions, inv_freq, 1.0, layout, 0, pair_axis, prefix)
    assert_same_bits(module(x, grid), expected, "module")
    assert_same_bits(torch.jit.script(module)(x, grid), expected, "scripted module")
    pe = reference_pe(positions, inv_freq, layout, pair_axis)
    assert_close(expected[:, prefix:].double(), x[:, prefix:].double() + pe, **tolerance(torch.float32))


def test_export_with_a_dynamic_batch():
    module = posenc.nn.SinusoidalGridEncoding(64, "mae", num_prefix_tokens=1, base_size=4, interpolation_scale=2.0)
    x = torch.randn(2, 1 + 20, 64)
    batch = torch.export.Dim("batch")
    exported = torch.export.export(module, (x, (4, 5)), dynamic_shapes={"x": {0: batch}, "grid": (None, None)})
    assert "posenc.add_sinusoidal" in str(exported.graph)
    for b in (2, 3, 7):
        y = torch.randn(b, 1 + 20, 64)
        assert_same_bits(exported.module()(y, (4, 5)), module(y, (4, 5)), f"batch {b}")


def test_script_3d_module_and_dtypes():
    module = posenc.nn.SinusoidalGridEncoding(32, "cogvideox", num_prefix_tokens=3)
    scripted = torch.jit.script(module)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3 + 2 * 3 * 5, 32).to(dtype)
        out = module(x, (2, 3, 5))
        assert out.dtype == dtype
        assert_same_bits(scripted(x, (2, 3, 5)), out, str(dtype))
        positions = OPS.grid_positions([2, 3, 5])
        inv_freq, pair_axis, layout = grid_frequencies(32, "cogvideox")
        assert_close(out[:, 3:].double(), x[:, 3:].double() + reference_pe(positions, inv_freq, layout, pair_axis),
                     **tolerance(dtype))
        assert_same_bits(out[:, :3], x[:, :3])


# ---------------------------------------------------------------- bad input

X = torch.randn(2, 6, 8)
INV = posenc.frequencies.sinusoidal(8)  # 4 pairs
AXIS = torch.tensor([1, 1, 0, 0])
POS = torch.zeros(2, 6, dtype=torch.long)


def assert_error_names(call, op, argument, value):
    """call() raises an error whose message names posenc.<op>, the argument and its value (a regex)."""
    # the configuration ops raise ValueError (as posenc.frequencies does), the others RuntimeError
    with pytest.raises(ValueError if op.startswith("grid_") else RuntimeError) as error:
        call()
    message = str(error.value)
    assert re.search(rf"posenc\.{op}(?![A-Za-z0-9_])", message), message
    assert re.search(rf"(?<![A-Za-z0-9_]){argument}(?![A-Za-z0-9_])", message), message
    assert re.search(value, message), message


BAD_CASES = [
    # pair_axis of the wrong length
    (lambda: OPS.add_sinusoidal(X, POS, INV, pair_axis=AXIS[:3]), "add_sinusoidal", "pair_axis", r"\[3\]"),
    (lambda: OPS.sinusoidal(POS, INV, pair_axis=torch.zeros(5, dtype=torch.long)), "sinusoidal", "pair_axis",
     r"\[5\]"),
    # positions without the axis dimension, or whose shape is not [n_axes, (B,) S]
    (lambda: OPS.add_sinusoidal(X, torch.arange(6), INV, pair_axis=AXIS), "add_sinusoidal", "positions", r"\[6\]"),
    (lambda: OPS.add_sinusoidal(X, torch.zeros(2, 2, 5), INV, pair_axis=AXIS), "add_sinusoidal", "positions",
     r"\[2, 2, 5\]"),
    (lambda: OPS.sinusoidal(torch.tensor(3), INV, pair_axis=AXIS), "sinusoidal", "positions",
     r"\[\]|0-[dD]|scalar|dimension"),
    # a pair_axis value outside the axes of positions
    (lambda: OPS.add_sinusoidal(X, POS, INV, pair_axis=torch.tensor([0, 1, 7, 0])), "add_sinusoidal", "pair_axis",
     r"\b7\b"),
    (lambda: OPS.add_sinusoidal(X, POS, INV, pair_axis=torch.tensor([0, -1, 1, 0])), "add_sinusoidal", "pair_axis",
     r"-1\b"),
    (lambda: OPS.sinusoidal(torch.zeros(3, 5), INV, pair_axis=torch.tensor([0, 2, 9, 1])), "sinusoidal",
     "pair_axis", r"\b9\b"),
    (lambda: OPS.add_sinusoidal(X, POS, INV, pair_axis=AXIS.double()), "add_sinusoidal", "pair_axis", "Double"),
    # pair_axis without positions
    (lambda: OPS.add_sinusoidal(X, None, INV, pair_axis=AXIS), "add_sinusoidal", "pair_axis", "positions"),
    # num_prefix_tokens outside [0, S]
    (lambda: OPS.add_sinusoidal(X, None, INV, num_prefix_tokens=-1), "add_sinusoidal", "num_prefix_tokens",
     r"-1\b"),
    (lambda: OPS.add_sinusoidal(X, None, INV, num_prefix_tokens=7), "add_sinusoidal", "num_prefix_tokens", r"\b7\b"),
    (lambda: OPS.add_sinusoidal(X, POS[:, :0], INV, pair_axis=AXIS, num_prefix_tokens=2 ** 62), "add_sinusoidal",
     "num_prefix_tokens", str(2 ** 62)),
    # positions whose length is not S - num_prefix_tokens
    (lambda: OPS.add_sinusoidal(X, torch.arange(6), INV, num_prefix_tokens=1), "add_sinusoidal", "positions",
     r"\[6\]"),
    (lambda: OPS.add_sinusoidal(X, torch.zeros(2, 2, 6), INV, pair_axis=AXIS, num_prefix_tokens=2),
     "add_sinusoidal", "positions", r"\[2, 2, 6\]"),
    (lambda: OPS.add_sinusoidal(X, POS, INV, pair_axis=AXIS, num_prefix_tokens=1), "add_sinusoidal", "positions",
     r"\[2, 6\]"),
    # the layout names the new layout among the valid ones
    (lambda: OPS.add_sinusoidal(X, None, INV, layout="half_per_axes"), "add_sinusoidal", "layout",
     "half_per_axes"),
    # grid_sinusoidal_inv_freq
    (lambda: OPS.grid_sinusoidal_inv_freq(64, "vit"), "grid_sinusoidal_inv_freq", "convention", "vit"),
    (lambda: OPS.grid_sinusoidal_inv_freq(30, "mae"), "grid_sinusoidal_inv_freq", "dim", r"\b30\b"),
    (lambda: OPS.grid_sinusoidal_inv_freq(34, "timm"), "grid_sinusoidal_inv_freq", "dim", r"\b34\b"),
    (lambda: OPS.grid_sinusoidal_inv_freq(40, "cogvideox"), "grid_sinusoidal_inv_freq", "dim", r"\b40\b"),
    (lambda: OPS.grid_sinusoidal_inv_freq(0, "mae"), "grid_sinusoidal_inv_freq", "dim", r"\b0\b"),
    (lambda: OPS.grid_sinusoidal_inv_freq(-8, "timm_interleaved"), "grid_sinusoidal_inv_freq", "dim", r"-8\b"),
    # grid_positions
    (lambda: OPS.grid_positions([10, 12], [16, 11]), "grid_positions", "crop_from", r"\b11\b"),
    (lambda: OPS.grid_positions([10, 12], [16]), "grid_positions", "crop_from", r"\[16\]|\b1\b"),
    (lambda: OPS.grid_positions([4, 5], None, [2.5]), "grid_positions", "scale", r"\b1\b|2\.5"),
    (lambda: OPS.grid_positions([4, 5], None, [2.5, 3.5, 4.5]), "grid_positions", "scale", r"\b3\b|4\.5"),
    (lambda: OPS.grid_positions([4, 5], None, [1.0, 0.0]), "grid_positions", "scale", r"\b0(\.0*)?\b"),
    (lambda: OPS.grid_positions([4, 5], None, [-2.5, 1.0]), "grid_positions", "scale", r"-2\.5"),
    (lambda: OPS.grid_positions([-1, 5]), "grid_positions", "grid", r"-1\b"),
]


@pytest.mark.parametrize("call, op, argument, value", BAD_CASES,
                         ids=[f"{op}-{argument}-{i}" for i, (_, op, argument, _) in enumerate(BAD_CASES)])
def test_bad_input_messages(call, op, argument, value):
    assert_error_names(call, op, argument, value)


def test_bad_input_meta_matches_cpu():
    with pytest.raises(RuntimeError, match=r"posenc\.add_sinusoidal.*pair_axis"):
        OPS.add_sinusoidal(X.to("meta"), POS.to("meta"), INV.to("meta"), pair_axis=AXIS[:3].to("meta"))
    with pytest.raises(RuntimeError, match=r"posenc\.add_sinusoidal.*num_prefix_tokens"):
        OPS.add_sinusoidal(X.to("meta"), None, INV.to("meta"), num_prefix_tokens=7)
    out = OPS.add_sinusoidal(X.to("meta"), POS[:, :5].to("meta"), INV.to("meta"), pair_axis=AXIS.to("meta"),
                             num_prefix_tokens=1)
    assert out.shape == X.shape and out.device.type == "meta"


# ---------------------------------------------------------------- CUDA: the CPU's bits

@cuda_only
def test_cuda_equals_cpu():
    inv_freq, pair_axis, layout = grid_frequencies(96, "cogvideox")
    positions = OPS.grid_positions([3, 5, 4], None, [1.0, 1.875, 1.875])
    assert_same_bits(OPS.grid_positions([3, 5, 4], None, [1.0, 1.875, 1.875], 1.0, "cuda").cpu(), positions)
    assert_same_bits(OPS.sinusoidal(positions.cuda(), inv_freq.cuda(), layout, None, 0, pair_axis.cuda()).cpu(),
                     OPS.sinusoidal(positions, inv_freq, layout, None, 0, pair_axis))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(2, 3 + 60, 96).to(dtype)
        expected = OPS.add_sinusoidal(x, positions, inv_freq, 1.5, layout, 0, pair_axis, 3)
        got = OPS.add_sinusoidal(x.cuda(), positions.cuda(), inv_freq.cuda(), 1.5, layout, 0, pair_axis.cuda(), 3)
        assert_same_bits(got.cpu(), expected, str(dtype))
