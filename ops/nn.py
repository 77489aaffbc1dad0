"""Scriptable modules built on the posenc ops."""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import frequencies

__all__ = ["SinusoidalPositionalEncoding", "SinusoidalGridEncoding", "SinusoidalEmbedding"]


class _ExactFrequencies(torch.nn.Module):
    """Keeps float64 frequencies (and ALiBi's fixed slopes) exact: they are plain tensor attributes, not buffers.

    ``.to(dtype)``, ``.half()`` and ``.bfloat16()`` convert parameters and buffers only, in eager mode, in
    TorchScript and in C++ (``torch::jit::Module::to``), so plain attributes are never rounded, and they stay out
    of the state dict. Device moves: in eager mode ``_apply`` puts the tensors ``_make_frequencies`` gives
    (computed from the configuration, or the attributes themselves) on the module's new device (``.to(device)``,
    ``.cuda()``, ``to_empty``); a scripted module's ``.to`` runs no Python, so ``forward`` moves them to its
    input's device where that differs (once: the moved copy is kept).
    """

    def _make_frequencies(self) -> Dict[str, Tensor]:
        """The exact tensors of the module's plain attributes, by attribute name."""
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        exact = self._make_frequencies()
        if exact:
            # Where fn sends a tensor of ours: the target of a move, the same device for a dtype conversion.
            current = getattr(self, next(iter(exact)))
            device = fn(torch.empty(0, dtype=torch.float64, device=current.device)).device
            for name, value in exact.items():
                setattr(self, name, value.to(device))
        return self


class SinusoidalPositionalEncoding(_ExactFrequencies):
    """``x * x_scale + PE`` for x ``[..., S, dim]``; odd ``dim`` gets a zero last column.

    ``shift=1`` with ``layout="half"`` is the fairseq / Whisper convention; the defaults are the paper's.
    """

    def __init__(self, dim: int, base: float = 10000.0, shift: int = 0, layout: str = "interleaved",
                 x_scale: float = 1.0):
        super().__init__()
        self.dim, self.base, self.shift = dim, base, shift
        self.layout = layout
        self.x_scale = x_scale
        self.inv_freq = frequencies.sinusoidal(dim, base, shift)

    def _make_frequencies(self) -> Dict[str, Tensor]:
        return {"inv_freq": frequencies.sinusoidal(self.dim, self.base, self.shift)}

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, offset: int = 0) -> Tensor:
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        return torch.ops.posenc.add_sinusoidal(x, positions, self.inv_freq, self.x_scale, self.layout, offset)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, shift={self.shift}, layout={self.layout!r}, x_scale={self.x_scale}"


class SinusoidalGridEncoding(_ExactFrequencies):
    """``x * x_scale + PE`` for the patch tokens of an image or a video: the fixed 2-D / 3-D sincos tables of MAE,
    DiT, PixArt, SD3, CogVideoX and timm, added in one pass.

    ``forward(x, grid)`` with x ``[B, num_prefix_tokens + prod(grid), dim]`` and ``grid`` ``[h, w]`` (2-D
    conventions) or ``[t, h, w]`` (``"cogvideox"``); the prefix tokens (cls, registers) get no encoding. The channel
    order is the convention's (:func:`posenc.frequencies.grid_sinusoidal`). The coordinates are diffusers'
    (:func:`posenc.functional.grid_positions`): index / (grid / base_size) / interpolation_scale on each spatial axis
    when ``base_size`` is set (PixArt, SD3), index / interpolation_scale otherwise; ``interpolation_scale`` may be
    one value per axis, or for video (temporal, spatial) as diffusers' CogVideoX takes them. ``max_size``: the table is that of a
    ``max_size`` square grid, centre-cropped to ``grid`` (SD3's ``pos_embed_max_size``).
    """

    def __init__(self, dim: int, convention: str = "mae", base: float = 10000.0, num_prefix_tokens: int = 0,
                 base_size: Optional[int] = None, interpolation_scale: Any = 1.0, max_size: Optional[int] = None,
                 x_scale: float = 1.0):
        super().__init__()
        op = "posenc.nn.SinusoidalGridEncoding"
        self.dim, self.convention, self.base = dim, convention, float(base)
        inv_freq, pair_axis, layout = frequencies.grid_sinusoidal(dim, convention, self.base)  # checks them
        self.n_axes = 3 if convention == "cogvideox" else 2
        scales = [float(interpolation_scale)] if isinstance(interpolation_scale, (int, float)) else \
            [float(v) for v in interpolation_scale]
        if self.n_axes == 3 and len(scales) == 2:  # diffusers' (temporal, spatial)
            scales = [scales[0], scales[1], scales[1]]
        if len(scales) not in (1, self.n_axes):
            raise ValueError(f"{op}: interpolation_scale has {len(scales)} values; give one, one per axis "
                             f"({self.n_axes}){' or (temporal, spatial)' if self.n_axes == 3 else ''}")
        if len(scales) > 1 and base_size is not None:
            raise ValueError(f"{op}: base_size takes one interpolation_scale, got {scales}")
        if num_prefix_tokens < 0:
            raise ValueError(f"{op}: num_prefix_tokens must not be negative, got {num_prefix_tokens}")
        self.interpolation_scale: List[float] = scales
        self.base_size: Optional[int] = base_size
        self.max_size: Optional[int] = max_size
        self.num_prefix_tokens, self.x_scale, self.layout = num_prefix_tokens, float(x_scale), layout
        self.inv_freq, self.pair_axis = inv_freq, pair_axis

    def _make_frequencies(self) -> Dict[str, Tensor]:
        inv_freq, pair_axis, _ = frequencies.grid_sinusoidal(self.dim, self.convention, self.base)
        return {"inv_freq": inv_freq, "pair_axis": pair_axis}

    def positions(self, grid: List[int]) -> Tensor:
        """The coordinates ``[n_axes, prod(grid)]`` (float32) of the grid's tokens."""
        spatial = len(grid) - 2  # the first spatial axis
        crop_from: Optional[List[int]] = None
        if self.max_size is not None:
            crop_from = [grid[a] if a < spatial else self.max_size for a in range(len(grid))]
        base_size = self.base_size
        if base_size is not None:
            # diffusers: index / (size / base_size) / interpolation_scale, size that of the grid the table is made for
            sizes = grid if crop_from is None else crop_from
            scale = [1.0 if a < spatial else sizes[a] / base_size for a in range(len(grid))]
            return torch.ops.posenc.grid_positions(grid, crop_from, scale, self.interpolation_scale[0], None)
        if len(self.interpolation_scale) > 1:
            return torch.ops.posenc.grid_positions(grid, crop_from, self.interpolation_scale, 1.0, None)
        return torch.ops.posenc.grid_positions(grid, crop_from, None, self.interpolation_scale[0], None)

    def forward(self, x: Tensor, grid: List[int]) -> Tensor:
        if len(grid) != self.n_axes:
            raise ValueError(f"posenc.nn.SinusoidalGridEncoding: grid {grid} needs {self.n_axes} axes for convention "
                             f"{self.convention}")
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
            self.pair_axis = self.pair_axis.to(x.device)
        positions = self.positions(grid).to(x.device)
        return torch.ops.posenc.add_sinusoidal(x, positions, self.inv_freq, self.x_scale, self.layout, 0,
                                               self.pair_axis, self.num_prefix_tokens)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, convention={self.convention!r}, base={self.base}, "
                f"num_prefix_tokens={self.num_prefix_tokens}, base_size={self.base_size}, "
                f"interpolation_scale={self.interpolation_scale}, max_size={self.max_size}")


class SinusoidalEmbedding(_ExactFrequencies):
    """Token embedding plus sinusoidal encoding in one op: ``weight[tokens] * token_scale + PE``.

    ``token_scale`` defaults to ``sqrt(dim)`` (the paper's scaling of embeddings). The weight is
    initialised N(0, dim ** -0.5) with a zero ``padding_idx`` row, as in fairseq.
    """

    def __init__(self, num_embeddings: int, dim: int, padding_idx: Optional[int] = None,
                 token_scale: Optional[float] = None, base: float = 10000.0, shift: int = 0,
                 layout: str = "interleaved"):
        super().__init__()
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.dim, self.base, self.shift = dim, base, shift
        self.padding_idx = padding_idx
        self.token_scale = math.sqrt(dim) if token_scale is None else token_scale
        self.layout = layout
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, dim))
        self.inv_freq = frequencies.sinusoidal(dim, base, shift)
        self.reset_parameters()

    def _make_frequencies(self) -> Dict[str, Tensor]:
        return {"inv_freq": frequencies.sinusoidal(self.dim, self.base, self.shift)}

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.weight, std=self.dim ** -0.5)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].zero_()

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None, offset: int = 0) -> Tensor:
        if self.inv_freq.device != tokens.device:
            self.inv_freq = self.inv_freq.to(tokens.device)
        return torch.ops.posenc.embed_sinusoidal(tokens, self.weight, positions, self.inv_freq, self.token_scale,
                                                 self.padding_idx, self.layout, offset)


def _table_row(module: str, padding_idx: Optional[int], rows: int) -> Optional[int]:
    # nn.Embedding accepts a negative padding_idx counted from the end; the ops take the row itself.
    if padding_idx is None:
        return None
    if not -rows <= padding_idx < rows:
        raise ValueError(f"posenc.nn.{module}: padding_idx {padding_idx} is outside [-{rows}, {rows})")
    return padding_idx + rows if padding_idx < 0 else padding_idx


def _init_table(table: Tensor, std: float, padding_idx: Optional[int]) -> None:
    torch.nn.init.normal_(table, std=std)
    if padding_idx is not None:
        with torch.no_grad():
            table[padding_idx].zero_()


class LearnedPositionalEmbedding(torch.nn.Module):
    """``x + weight[positions + offset]`` for x ``[..., S, dim]``, a trainable position table.

    ``weight`` is ``[max_positions + offset, dim]``: the first ``offset`` rows hold no position of their
    own (OPT: ``offset=2``). Initialisation: N(0, ``init_std ** 2``), 0.02 as in GPT-2, BERT and OPT,
    with the ``padding_idx`` row zero; that row never receives a gradient. ``forward``'s ``offset`` (the
    length of a key/value cache) adds to the module's. Recipes:

    - GPT-2 / BERT: ``LearnedPositionalEmbedding(n_positions, dim)``, ``forward(x, offset=past_length)``;
    - OPT: ``offset=2``, ``forward(x, positions_from_mask(mask, pad_position=-1))``;
    - fairseq: ``LearnedPositionalEmbedding(max_positions + pad + 1, dim, padding_idx=pad)``,
      ``forward(x, make_positions(tokens, pad))``.
    """

    def __init__(self, max_positions: int, dim: int, padding_idx: Optional[int] = None, offset: int = 0,
                 init_std: float = 0.02):
        super().__init__()
        if max_positions < 0 or dim < 0 or offset < 0:
            raise ValueError(f"posenc.nn.LearnedPositionalEmbedding: max_positions {max_positions}, dim {dim} and "
                             f"offset {offset} must be non-negative")
        self.max_positions, self.dim, self.offset, self.init_std = max_positions, dim, offset, init_std
        self.padding_idx = _table_row("LearnedPositionalEmbedding", padding_idx, max_positions + offset)
        self.weight = torch.nn.Parameter(torch.empty(max_positions + offset, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_table(self.weight, self.init_std, self.padding_idx)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, offset: int = 0) -> Tensor:
        return torch.ops.posenc.add_learned(x, self.weight, positions, self.offset + offset, self.padding_idx)

    def extra_repr(self) -> str:
        return (f"max_positions={self.max_positions}, dim={self.dim}, padding_idx={self.padding_idx}, "
                f"offset={self.offset}")


class LearnedEmbedding(torch.nn.Module):
    """Token and learned position embeddings in one op (GPT-2's ``wte(tokens) + wpe(positions)``):
    ``token_weight[tokens] * token_scale + pos_weight[positions + offset]``.

    Tables as in :class:`LearnedPositionalEmbedding`: N(0, ``init_std ** 2``), the ``padding_idx``
    row of ``token_weight`` zero and without gradient; ``pos_weight`` is ``[max_positions + offset, dim]``.
    """

    def __init__(self, num_embeddings: int, max_positions: int, dim: int, padding_idx: Optional[int] = None,
                 token_scale: float = 1.0, offset: int = 0, init_std: float = 0.02):
        super().__init__()
        if num_embeddings < 0 or max_positions < 0 or dim < 0 or offset < 0:
            raise ValueError(f"posenc.nn.LearnedEmbedding: num_embeddings {num_embeddings}, max_positions "
                             f"{max_positions}, dim {dim} and offset {offset} must be non-negative")
        self.num_embeddings, self.max_positions, self.dim = num_embeddings, max_positions, dim
        self.token_scale, self.offset, self.init_std = token_scale, offset, init_std
        self.padding_idx = _table_row("LearnedEmbedding", padding_idx, num_embeddings)
        self.token_weight = torch.nn.Parameter(torch.empty(num_embeddings, dim))
        self.pos_weight = torch.nn.Parameter(torch.empty(max_positions + offset, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_table(self.token_weight, self.init_std, self.padding_idx)
        _init_table(self.pos_weight, self.init_std, None)

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None, offset: int = 0) -> Tensor:
        return torch.ops.posenc.embed_learned(tokens, self.token_weight, self.pos_weight, positions,
                                              self.token_scale, self.padding_idx, self.offset + offset)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, max_positions={self.max_positions}, dim={self.dim}, "
                f"padding_idx={self.padding_idx}, token_scale={self.token_scale}, offset={self.offset}")


__all__ += ["LearnedPositionalEmbedding", "LearnedEmbedding"]


# ---------------------------------------------------------------- ALiBi and T5 relative bias

from .functional import alibi_slopes  # noqa: E402

__all__ += ["ALiBi", "T5RelativeBias"]


class ALiBi(_ExactFrequencies):
    """Adds ALiBi to attention scores ``[B, num_local_heads, Q, K]``; scriptable.

    The slopes cover all ``num_heads`` heads of the model; this module's heads are ``head_offset ..
    head_offset + num_local_heads - 1`` (a tensor-parallel shard; by default every head from ``head_offset``
    on). Fixed slopes are a plain float32 tensor attribute, so ``.half()`` / ``.to(dtype)`` never round them, in
    eager mode or TorchScript (rounded slopes shift the bias by up to 5e-4 * m * distance), and they stay out of
    the state dict; ``learnable=True`` makes them a parameter ``slopes`` (all heads, so a checkpoint is the same on
    every shard).
    """

    def __init__(self, num_heads: int, mode: str = "causal", learnable: bool = False, head_offset: int = 0,
                 num_local_heads: Optional[int] = None):
        super().__init__()
        if mode not in ("causal", "symmetric"):
            raise ValueError(f'posenc.nn.ALiBi: mode must be "causal" or "symmetric", got "{mode}"')
        local = num_heads - head_offset if num_local_heads is None else num_local_heads
        if head_offset < 0 or local <= 0 or head_offset + local > num_heads:
            raise ValueError(f"posenc.nn.ALiBi: heads [{head_offset}, {head_offset + local}) are not a "
                             f"non-empty part of the {num_heads} heads")
        self.num_heads, self.mode, self.learnable = num_heads, mode, learnable
        self.head_offset, self.num_local_heads = head_offset, local
        if learnable:
            self.slopes = torch.nn.Parameter(alibi_slopes(num_heads))
        else:
            self.slopes = alibi_slopes(num_heads)

    def _make_frequencies(self) -> Dict[str, Tensor]:
        return {} if self.learnable else {"slopes": alibi_slopes(self.num_heads)}

    def forward(self, scores: Tensor) -> Tensor:
        if scores.dim() != 4 or scores.size(1) != self.num_local_heads:
            raise ValueError("posenc.nn.ALiBi: scores must be [B, " + str(self.num_local_heads) + ", Q, K], got shape "
                             + str(list(scores.shape)))
        if not self.learnable and self.slopes.device != scores.device:
            self.slopes = self.slopes.to(scores.device)
        return torch.ops.posenc.add_alibi(scores, self.slopes, self.mode, self.head_offset)

    @torch.jit.export
    def bias(self, q_len: int, k_len: int, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The bias alone, ``[1, num_local_heads, q_len, k_len]``, in ``dtype`` (default: that of the slopes)."""
        return torch.ops.posenc.alibi_bias(self.slopes, q_len, k_len, self.mode, self.head_offset,
                                           self.num_local_heads, dtype)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, mode={self.mode!r}, learnable={self.learnable}, "
                f"head_offset={self.head_offset}, num_local_heads={self.num_local_heads}")


class T5RelativeBias(torch.nn.Module):
    """The learned bucket table of a T5 attention layer; scriptable.

    ``weight [num_buckets, num_heads]`` has the layout of Hugging Face's ``relative_attention_bias.weight`` (a
    state dict loads as is) and is initialised N(0, 1) like the ``nn.Embedding`` it replaces. ``forward(q_len,
    k_len, q_offset)`` gives the bias ``[1, num_heads, q_len, k_len]`` to add to the scores; encoders are
    bidirectional, decoders causal, and ``q_offset`` is the cache length when decoding.
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional = bidirectional
        self.weight = torch.nn.Parameter(torch.empty(num_buckets, num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.weight)

    def forward(self, q_len: int, k_len: int, q_offset: int = 0) -> Tensor:
        return torch.ops.posenc.t5_bias(self.weight, q_len, k_len, self.bidirectional, self.num_buckets,
                                        self.max_distance, q_offset)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")


_SEQ_DIM = {"bshd": 1, "bhsd": 2, "sbhd": 0, "thd": 0}


class RotaryEmbedding(_ExactFrequencies):
    """Rotates q and k (``rope_qk``): ``forward(q, k, positions=None, offset=0, cu_seqlens=None) -> (q, k)``.

    ``scaling`` is a Hugging Face style dict (see :func:`posenc.frequencies.rope`); invalid values raise
    ``ValueError`` here, at construction. The float64 frequencies ``inv_freq`` (and ``long_inv_freq``, LongRoPE's
    beyond the original context) are plain tensor attributes that survive ``.to(torch.bfloat16)`` / ``.half()``,
    scripted or not. "dynamic" and "longrope" choose their frequencies per call from the sequence length L = max
    position + 1 (positions + offset; offset + S without positions; the longest packed sequence + offset with
    cu_seqlens): dynamic NTK rescales the base beyond max_position_embeddings, LongRoPE takes its long factors
    beyond original_max_position_embeddings. L stays a tensor and the frequencies come from the op
    ``rope_inv_freq_for_length``, so torch.compile traces one graph for every sequence length.
    """

    __jit_ignored_attributes__ = ["scaling", "_keywords"]

    def __init__(self, head_dim: int, rotary_dim: Optional[int] = None, base: float = 10000.0,
                 layout: str = "neox", scaling: Optional[Dict[str, Any]] = None, format: str = "bshd"):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim > head_dim:
            raise ValueError(f"posenc.nn.RotaryEmbedding: rotary_dim {rotary_dim} exceeds head_dim {head_dim}")
        if layout not in ("neox", "gptj"):
            raise ValueError(f'posenc.nn.RotaryEmbedding: layout must be "neox" or "gptj", got "{layout}"')
        if format not in _SEQ_DIM:
            raise ValueError(f"posenc.nn.RotaryEmbedding: format must be one of {list(_SEQ_DIM)}, got \"{format}\"")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, float(base)
        self.layout, self.format = layout, format
        self.seq_dim = _SEQ_DIM[format]
        self.scaling = dict(scaling or {})
        self.rope_type, keywords = frequencies.rope_arguments(self.scaling)
        self._keywords = keywords
        # The keywords of rope_inv_freq_for_length, one attribute each so that a scripted forward can pass them.
        self.rope_theta: Optional[float] = keywords.get("rope_theta")
        self.factor: Optional[float] = keywords.get("factor")
        self.alpha: Optional[float] = keywords.get("alpha")
        self.original_max_position_embeddings: Optional[float] = keywords.get("original_max_position_embeddings")
        self.max_position_embeddings: Optional[float] = keywords.get("max_position_embeddings")
        self.attention_factor: Optional[float] = keywords.get("attention_factor")
        self.beta_fast: Optional[float] = keywords.get("beta_fast")
        self.beta_slow: Optional[float] = keywords.get("beta_slow")
        self.mscale: Optional[float] = keywords.get("mscale")
        self.mscale_all_dim: Optional[float] = keywords.get("mscale_all_dim")
        self.truncate: bool = keywords.get("truncate", True)
        self.low_freq_factor: Optional[float] = keywords.get("low_freq_factor")
        self.high_freq_factor: Optional[float] = keywords.get("high_freq_factor")
        self.short_factor: Optional[List[float]] = keywords.get("short_factor")
        self.long_factor: Optional[List[float]] = keywords.get("long_factor")
        self.partial_rotary_factor: Optional[float] = keywords.get("partial_rotary_factor")
        # The types whose frequencies may depend on the length (the op decides: "dynamic" with an alpha is fixed).
        self.length_dependent = self.rope_type in ("dynamic", "longrope")
        inv_freq, self.attention_scale = frequencies.rope(rotary_dim, base, self.scaling)
        self.inv_freq = inv_freq
        self.long_inv_freq = self._long_inv_freq()

    def _long_inv_freq(self) -> Tensor:
        # The frequencies of the longest sequence: LongRoPE's long factors, else inv_freq.
        seq_len = torch.iinfo(torch.int64).max if self.rope_type == "longrope" else None
        return frequencies.rope(self.rotary_dim, self.base, self.scaling, seq_len)[0]

    def _make_frequencies(self) -> Dict[str, Tensor]:
        return {"inv_freq": frequencies.rope(self.rotary_dim, self.base, self.scaling)[0],
                "long_inv_freq": self._long_inv_freq()}

    @classmethod
    def from_hf_config(cls, config: Any, layout: str = "neox", format: str = "bshd",
                       layer_type: Optional[str] = None) -> "RotaryEmbedding":
        """The rotary embedding of a Hugging Face config (a ``PretrainedConfig`` or its dict).

        Reads head_dim (else hidden_size // num_attention_heads), partial_rotary_factor, rope_theta and
        ``rope_parameters`` (or the older ``rope_scaling``), and fills in max_position_embeddings and, for
        llama3 / yarn / longrope, original_max_position_embeddings as transformers does. ``layer_type`` picks
        one entry of per-layer-type parameters (e.g. Gemma 3's "full_attention"), and with it the layer type's
        own config where the config holds one per type (``per_layer_config``: Gemma 4's full-attention layers have
        heads of ``global_head_dim``). Hugging Face's weights expect ``layout="neox"``.
        """
        def get(key: str, default: Any = None) -> Any:
            value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
            return default if value is None else value

        params = get("rope_parameters") or get("rope_scaling") or {}
        if layer_type is not None:
            params = params[layer_type]
            per_layer = get("per_layer_config")
            if per_layer is not None:
                try:  # transformers' view takes a layer type or index; a dict, the types it holds
                    config = per_layer[layer_type]
                except (KeyError, IndexError, TypeError, ValueError):
                    pass
        elif params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"posenc.nn.RotaryEmbedding.from_hf_config: rope parameters are per layer type "
                             f"({list(params)}); pass layer_type")
        params = dict(params)
        # A value given as 0 is used (and refused where invalid), never replaced by a default.
        head_dim = get("head_dim")
        if head_dim is None:
            head_dim = get("hidden_size") // get("num_attention_heads")
        partial = params.get("partial_rotary_factor")
        if partial is None:
            partial = get("partial_rotary_factor", 1.0)
        base = params.get("rope_theta")
        if base is None:
            base = get("rope_theta", 10000.0)
        rope_type, _ = frequencies.rope_arguments(params)
        if rope_type == "proportional":
            # Gemma 4: the whole head, whose rotated share partial_rotary_factor (of the rope parameters, as
            # transformers reads it) the frequencies carry.
            partial = 1.0
        if get("max_position_embeddings") is not None:
            params.setdefault("max_position_embeddings", get("max_position_embeddings"))
        if rope_type in ("llama3", "yarn", "longrope"):
            # Phi-3 keeps the pretraining length beside rope_scaling; transformers lets that one win.
            original = get("original_max_position_embeddings")
            if original is not None:
                params["original_max_position_embeddings"] = original
            elif params.get("max_position_embeddings") is not None:
                params.setdefault("original_max_position_embeddings", params["max_position_embeddings"])
        return cls(head_dim, int(head_dim * partial), float(base), layout, params, format)

    def _seq_len(self, q: Tensor, positions: Optional[Tensor], offset: int, cu_seqlens: Optional[Tensor]) -> Tensor:
        if positions is not None and positions.numel() > 0:
            return positions.max().to(torch.float64) + (offset + 1)
        if cu_seqlens is not None and cu_seqlens.numel() > 1:
            return (cu_seqlens[1:] - cu_seqlens[:-1]).max().to(torch.float64) + offset
        length = offset if positions is not None else q.size(self.seq_dim) + offset
        return torch.full((), length, dtype=torch.float64, device=q.device)

    def inv_freq_for(self, q: Tensor, positions: Optional[Tensor] = None, offset: int = 0,
                     cu_seqlens: Optional[Tensor] = None) -> Tensor:
        """The frequencies this call uses (those of ``frequencies.rope(..., seq_len=L)``), on q's device."""
        if not self.length_dependent:
            if self.inv_freq.device != q.device:
                self.inv_freq = self.inv_freq.to(q.device)
            return self.inv_freq
        seq_len = self._seq_len(q, positions, offset, cu_seqlens).to(q.device)
        if not torch.jit.is_scripting():
            return self._inv_freq_for_length(seq_len)
        return torch.ops.posenc.rope_inv_freq_for_length(
            seq_len, self.rotary_dim, self.base, self.rope_type, rope_theta=self.rope_theta, factor=self.factor,
            alpha=self.alpha, original_max_position_embeddings=self.original_max_position_embeddings,
            max_position_embeddings=self.max_position_embeddings, attention_factor=self.attention_factor,
            beta_fast=self.beta_fast, beta_slow=self.beta_slow, mscale=self.mscale,
            mscale_all_dim=self.mscale_all_dim, truncate=self.truncate, low_freq_factor=self.low_freq_factor,
            high_freq_factor=self.high_freq_factor, short_factor=self.short_factor, long_factor=self.long_factor,
            partial_rotary_factor=self.partial_rotary_factor)

    @torch.jit.unused
    def _inv_freq_for_length(self, seq_len: Tensor) -> Tensor:
        # Eager: only the keys given, since Python parses every keyword of every call (about 18 us for all 15).
        return torch.ops.posenc.rope_inv_freq_for_length.default(seq_len, self.rotary_dim, self.base, self.rope_type,
                                                                 **self._keywords)

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None, offset: int = 0,
                cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq_for(q, positions, offset, cu_seqlens)
        return torch.ops.posenc.rope_qk(q, k, positions, inv_freq, self.attention_scale, self.layout, self.format,
                                        offset, cu_seqlens)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, layout={self.layout!r}, "
                f"format={self.format!r}, scaling={self.scaling}")


__all__ += ["RotaryEmbedding"]


# ---------------------------------------------------------------- QK-norm + rotary

_QK_NORMS = ("llama", "gemma", "olmo2", "fused")


class QKNormRotaryEmbedding(torch.nn.Module):
    """RMS-normalizes q and k, scales them by their weights and rotates them, in one op (``qk_norm_rope``): the
    attention prologue of Qwen3, Gemma 3 and OLMo 2. ``forward(q, k, positions=None, offset=0, cu_seqlens=None) ->
    (q, k)``; scriptable.

    The weights are parameters ``q_weight [q_norm_dim]`` and ``k_weight [k_norm_dim]`` (Hugging Face's
    ``q_norm.weight`` and ``k_norm.weight``): a width of ``head_dim`` (the default) normalizes each head (Qwen3,
    Gemma 3), one of ``heads * head_dim`` all heads of a token together (OLMo 2's norms over the projections). They
    start at one, or at zero for ``norm="gemma"``, whose scale is ``1 + w``: a new module normalizes and rotates.
    ``norm`` is the model's rounding convention (:func:`posenc.functional.qk_norm_rope`): ``"llama"`` (Qwen3),
    ``"gemma"``, ``"olmo2"`` or ``"fused"``; ``eps`` is added to the mean square. The rotary arguments are those of
    :class:`RotaryEmbedding`, which the module holds as ``rotary`` (frequencies, scaling types, per-call lengths).
    """

    def __init__(self, head_dim: int, rotary_dim: Optional[int] = None, base: float = 10000.0,
                 layout: str = "neox", scaling: Optional[Dict[str, Any]] = None, format: str = "bshd",
                 eps: float = 1e-6, norm: str = "llama", q_norm_dim: Optional[int] = None,
                 k_norm_dim: Optional[int] = None):
        super().__init__()
        op = "posenc.nn.QKNormRotaryEmbedding"
        if norm not in _QK_NORMS:
            raise ValueError(f"{op}: norm must be one of {list(_QK_NORMS)}, got \"{norm}\"")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
        q_norm_dim = head_dim if q_norm_dim is None else q_norm_dim
        k_norm_dim = head_dim if k_norm_dim is None else k_norm_dim
        for name, width in (("q_norm_dim", q_norm_dim), ("k_norm_dim", k_norm_dim)):
            if head_dim <= 0 or width <= 0 or width % head_dim != 0:
                raise ValueError(f"{op}: {name} {width} must be head_dim {head_dim} (each head) or heads * head_dim "
                                 f"(all heads of a token)")
        self.rotary = RotaryEmbedding(head_dim, rotary_dim, base, layout, scaling, format)
        self.head_dim, self.eps, self.norm = head_dim, float(eps), norm
        self.q_norm_dim, self.k_norm_dim = q_norm_dim, k_norm_dim
        self.q_weight = torch.nn.Parameter(torch.empty(q_norm_dim))
        self.k_weight = torch.nn.Parameter(torch.empty(k_norm_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The identity scale: w = 1, or w = 0 where the scale is 1 + w (Gemma).
        value = 0.0 if self.norm == "gemma" else 1.0
        torch.nn.init.constant_(self.q_weight, value)
        torch.nn.init.constant_(self.k_weight, value)

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None, offset: int = 0,
                cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        rotary = self.rotary
        inv_freq = rotary.inv_freq_for(q, positions, offset, cu_seqlens)
        return torch.ops.posenc.qk_norm_rope(q, k, self.q_weight, self.k_weight, positions, inv_freq, self.eps,
                                             self.norm, rotary.attention_scale, rotary.layout, rotary.format, offset,
                                             cu_seqlens)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, norm={self.norm!r}, eps={self.eps}, q_norm_dim={self.q_norm_dim}, "
                f"k_norm_dim={self.k_norm_dim}")


__all__ += ["QKNormRotaryEmbedding"]


# ---------------------------------------------------------------- Multi-axis rotary (images, video, multimodal text)

__all__ += ["MultimodalRotaryEmbedding", "AxialRotaryEmbedding"]


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return default if value is None else value


class MultimodalRotaryEmbedding(_ExactFrequencies):
    """M-RoPE of multimodal text (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): rotates q and k (``rope_qk``) by three position
    axes (time, height, width), each driving the frequency pairs of its section.

    ``forward(q, k, positions=None, offset=0, cu_seqlens=None) -> (q, k)``: positions ``[3, S]``, ``[3, B, S]``
    (Hugging Face's position_ids of these models) or ``[3, T]`` (thd), e.g. from
    :func:`posenc.functional.mrope_positions`; any positions of two or more dimensions lead with their axis. For
    text alone, positions ``[S]`` (``[T]``) or None put every axis at the same position, which is the one-axis
    rotation. ``mrope_section`` holds the pairs per axis (summing to head_dim // 2), consecutive or
    ``interleaved`` (Qwen3-VL), see :func:`posenc.frequencies.mrope_pair_axis`; ``scaling`` is a Hugging Face
    rope dict of a fixed type (types that pick frequencies per call, dynamic and longrope, are refused).
    """

    __jit_ignored_attributes__ = ["scaling"]

    def __init__(self, head_dim: int, mrope_section: List[int], base: float = 10000.0, interleaved: bool = False,
                 layout: str = "neox", scaling: Optional[Dict[str, Any]] = None, format: str = "bshd"):
        super().__init__()
        op = "posenc.nn.MultimodalRotaryEmbedding"
        if layout not in ("neox", "gptj"):
            raise ValueError(f'{op}: layout must be "neox" or "gptj", got "{layout}"')
        if format not in _SEQ_DIM:
            raise ValueError(f'{op}: format must be one of {list(_SEQ_DIM)}, got "{format}"')
        self.scaling = dict(scaling or {})
        rope_type = self.scaling.get("rope_type", self.scaling.get("type")) or "default"
        if rope_type in ("dynamic", "longrope") and not self.scaling.get("alpha"):
            raise ValueError(f'{op}: rope_type "{rope_type}" picks its frequencies per call, which M-RoPE does not do; '
                             f"use a fixed scaling type")
        pair_axis = frequencies.mrope_pair_axis(mrope_section, interleaved)
        if 2 * pair_axis.numel() != head_dim:
            raise ValueError(f"{op}: mrope_section {list(mrope_section)} holds {pair_axis.numel()} frequency pairs but "
                             f"head_dim {head_dim} has {head_dim // 2}")
        self.head_dim, self.base, self.interleaved = head_dim, float(base), interleaved
        self.mrope_section: List[int] = [int(s) for s in mrope_section]
        self.layout, self.format = layout, format
        inv_freq, attention_scale = frequencies.rope(head_dim, base, self.scaling)
        self.inv_freq = inv_freq
        self.pair_axis = pair_axis
        self.attention_scale = float(attention_scale)

    def _make_frequencies(self) -> Dict[str, Tensor]:
        # Recomputed, not moved: after .to("meta") the attributes hold no values for to_empty to copy.
        return {"inv_freq": frequencies.rope(self.head_dim, self.base, self.scaling)[0],
                "pair_axis": frequencies.mrope_pair_axis(self.mrope_section, self.interleaved)}

    @classmethod
    def from_hf_config(cls, config: Any, layout: str = "neox", format: str = "bshd") -> "MultimodalRotaryEmbedding":
        """The text rotary embedding of a Hugging Face Qwen2-VL, Qwen2.5-VL or Qwen3-VL config (the model's config,
        its ``text_config``, or a dict of either).

        Reads head_dim (else hidden_size // num_attention_heads), rope_theta and ``rope_parameters`` (or
        ``rope_scaling``): ``mrope_section`` (transformers' defaults when absent: [16, 24, 24] for Qwen2-VL and
        Qwen2.5-VL, [24, 20, 20] for Qwen3-VL), ``mrope_interleaved`` (Qwen3-VL interleaves always, as
        transformers does), and the scaling type (``"mrope"`` means the default frequencies).
        """
        text = _config_get(config, "text_config")
        if text is not None:
            config = text
        model_type = str(_config_get(config, "model_type", ""))
        params = dict(_config_get(config, "rope_parameters") or _config_get(config, "rope_scaling") or {})
        qwen3 = model_type.startswith("qwen3_vl")
        section = params.pop("mrope_section", None)
        if section is None:
            if not (qwen3 or model_type.startswith(("qwen2_vl", "qwen2_5_vl"))):
                raise ValueError(f"posenc.nn.MultimodalRotaryEmbedding.from_hf_config: the rope parameters of model "
                                 f'type "{model_type}" hold no mrope_section')
            section = [24, 20, 20] if qwen3 else [16, 24, 24]
        interleaved = bool(params.pop("mrope_interleaved", False)) or qwen3
        if params.get("rope_type", params.get("type")) == "mrope":
            params["rope_type"] = "default"
            params.pop("type", None)
        head_dim = _config_get(config, "head_dim")
        if head_dim is None:
            head_dim = _config_get(config, "hidden_size") // _config_get(config, "num_attention_heads")
        base = params.get("rope_theta")
        if base is None:
            base = _config_get(config, "rope_theta", 10000.0)
        if _config_get(config, "max_position_embeddings") is not None:
            params.setdefault("max_position_embeddings", _config_get(config, "max_position_embeddings"))
        if params.get("rope_type", params.get("type")) in ("llama3", "yarn", "longrope"):
            params.setdefault("original_max_position_embeddings", params.get("max_position_embeddings"))
        return cls(int(head_dim), list(section), float(base), interleaved, layout, params, format)

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None, offset: int = 0,
                cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        if self.inv_freq.device != q.device:
            self.inv_freq = self.inv_freq.to(q.device)
            self.pair_axis = self.pair_axis.to(q.device)
        pair_axis: Optional[Tensor] = None
        if positions is not None and positions.dim() >= 2:
            pair_axis = self.pair_axis
        return torch.ops.posenc.rope_qk(q, k, positions, self.inv_freq, self.attention_scale, self.layout,
                                        self.format, offset, cu_seqlens, pair_axis)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, mrope_section={self.mrope_section}, base={self.base}, "
                f"interleaved={self.interleaved}, layout={self.layout!r}, format={self.format!r}, "
                f"scaling={self.scaling}")


class AxialRotaryEmbedding(_ExactFrequencies):
    """Rotary embedding over several position axes: the axial RoPE of vision transformers and Flux's axes.

    ``forward(q, k, positions, offset=0, cu_seqlens=None) -> (q, k)`` with positions ``[n_axes, S]``,
    ``[n_axes, B, S]`` or ``[n_axes, T]`` (thd), e.g. :func:`posenc.functional.image_positions` (row, column) or
    :func:`posenc.functional.video_positions`. Without ``axes_dim`` the head's channels are split evenly among
    ``n_axes`` axes (:func:`posenc.frequencies.axial`); with it, axis a rotates ``axes_dim[a]`` channels with
    its own frequencies (:func:`posenc.frequencies.multiaxis`; their sum may stay below head_dim, the rest
    passes through). Flux: ``AxialRotaryEmbedding(128, axes_dim=[16, 56, 56], layout="gptj", format="bhsd")``
    with positions ``img_ids.T.long()``. ``learned_freq=True`` makes the frequencies a float64 parameter, trained
    through rope_qk's gradient with respect to inv_freq (timm's mixed 2-D RoPE); dtype conversions of the module
    leave it float64.
    """

    def __init__(self, head_dim: int, n_axes: int = 2, base: float = 10000.0, layout: str = "neox",
                 format: str = "bshd", axes_dim: Optional[List[int]] = None, learned_freq: bool = False):
        super().__init__()
        op = "posenc.nn.AxialRotaryEmbedding"
        if layout not in ("neox", "gptj"):
            raise ValueError(f'{op}: layout must be "neox" or "gptj", got "{layout}"')
        if format not in _SEQ_DIM:
            raise ValueError(f'{op}: format must be one of {list(_SEQ_DIM)}, got "{format}"')
        self.head_dim, self.base = head_dim, float(base)
        self.even_split = axes_dim is None  # frequencies.axial's scheme, else frequencies.multiaxis
        self.n_axes = n_axes if axes_dim is None else len(axes_dim)
        self.axes_dim: List[int] = [int(d) for d in axes_dim] if axes_dim is not None else []
        inv_freq, pair_axis = self._frequencies()  # checks the arguments
        if axes_dim is None:
            self.axes_dim = [head_dim // n_axes] * n_axes
        if 2 * inv_freq.numel() > head_dim:
            raise ValueError(f"{op}: axes_dim {self.axes_dim} rotate {2 * inv_freq.numel()} channels, more than "
                             f"head_dim {head_dim}")
        self.layout, self.format = layout, format
        self.learned_freq = learned_freq
        # learned: a float64 parameter that dtype conversions leave in float64 (_apply)
        self.inv_freq = torch.nn.Parameter(inv_freq) if learned_freq else inv_freq
        self.pair_axis = pair_axis

    def _apply(self, fn, recurse=True):
        if not self.learned_freq:
            return super()._apply(fn, recurse)
        value = self.inv_freq.data
        super()._apply(fn, recurse)
        # the parameter where fn sent it, still float64: a rounded frequency shifts every angle
        self.inv_freq.data = value.to(fn(torch.empty(0, dtype=value.dtype, device=value.device)).device)
        return self

    def _frequencies(self) -> Tuple[Tensor, Tensor]:
        if self.even_split:
            return frequencies.axial(self.head_dim, self.n_axes, self.base)
        return frequencies.multiaxis(self.axes_dim, self.base)

    def _make_frequencies(self) -> Dict[str, Tensor]:
        # Recomputed, not moved: after .to("meta") the attributes hold no values for to_empty to copy. Learned
        # frequencies are a parameter, which moves as parameters do.
        inv_freq, pair_axis = self._frequencies()
        return {"pair_axis": pair_axis} if self.learned_freq else {"inv_freq": inv_freq, "pair_axis": pair_axis}

    @classmethod
    def from_hf_config(cls, config: Any, layout: str = "neox", format: str = "thd") -> "AxialRotaryEmbedding":
        """The 2-D axial rotary embedding of a Hugging Face vision config whose rope type is ``"axial"`` (the
        vision tower of Qwen2-VL, Qwen2.5-VL, ...: the model's config, its ``vision_config``, or a dict of either).

        Reads head_dim (else embed_dim, else hidden_size, over num_heads) and ``rope_parameters``' rope_theta.
        Those towers rotate packed patches ([T, H, D]) by positions ``[2, T]`` (row, column): the default format is
        ``"thd"``.
        """
        vision = _config_get(config, "vision_config")
        if vision is not None:
            config = vision
        params = dict(_config_get(config, "rope_parameters") or _config_get(config, "rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type")) or "axial"
        if rope_type != "axial":
            raise ValueError(f'posenc.nn.AxialRotaryEmbedding.from_hf_config: rope_type must be "axial", got '
                             f'"{rope_type}"')
        heads = _config_get(config, "num_heads") or _config_get(config, "num_attention_heads")
        head_dim = _config_get(config, "head_dim")
        if head_dim is None:
            width = _config_get(config, "embed_dim") or _config_get(config, "hidden_size")
            head_dim = width // heads
        base = params.get("rope_theta")
        if base is None:
            base = _config_get(config, "rope_theta", 10000.0)
        return cls(int(head_dim), 2, float(base), layout, format)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor, offset: int = 0,
                cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        if self.pair_axis.device != q.device:
            self.pair_axis = self.pair_axis.to(q.device)
        inv_freq = self.inv_freq
        if inv_freq.device != q.device:
            inv_freq = inv_freq.to(q.device)
            if not self.learned_freq:
                self.inv_freq = inv_freq
        return torch.ops.posenc.rope_qk(q, k, positions, inv_freq, 1.0, self.layout, self.format, offset,
                                        cu_seqlens, self.pair_axis)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, axes_dim={self.axes_dim}, base={self.base}, layout={self.layout!r}, "
                f"format={self.format!r}, learned_freq={self.learned_freq}")
