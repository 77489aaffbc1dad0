"""Hugging Face transformers models with posenc's positional code: ``patch(model)`` and ``unpatch(model)``.

``patch`` switches one model instance to posenc and returns a :class:`Patch` that lists every change;
``unpatch`` undoes them and returns the same record. What is replaced, per family:

- **Rotary**: any model that follows Hugging Face's rotary contract, recognized on the instance and its
  modeling file rather than by model type (:func:`recognize_rotary`): ``*RotaryEmbedding`` submodules with a
  rope type posenc knows (default, linear, dynamic, YaRN, Llama 3, LongRoPE, proportional) whose ``(cos, sin)``
  tables, probed on a copy, are the neox (or GPT-J style) tables of posenc's frequencies for its config (full or
  partial rotary), and a modeling file whose ``apply_rotary_pos_emb(q, k, cos, sin, ...)`` gives, on random q
  and k, what ``rope_qk`` gives with layout "neox" (halves) or "gptj" (interleaved pairs: Cohere, GLM, ERNIE 4.5,
  Helium), the layout then used; rope parameters per layer type (Gemma 3) give one posenc rotary embedding per
  type; M-RoPE modules (``mrope_section``: Qwen2/2.5/3-VL, GLM-4V, ...) are probed for the axis of each
  frequency pair and rotated with ``rope_qk``'s ``pair_axis`` on positions [3, B, S]; the MLA models'
  ``apply_rotary_pos_emb_interleave`` (interleaved pairs in, halves out: DeepSeek V3, Mistral 4, ...) is probed
  and wrapped too. Anything else raises :class:`NotRecognized` (a ``ValueError``) naming the model type and the
  reason (multi-axis positions or sections it cannot read, dynamic NTK per layer type, no rotary module,
  non-standard apply_rotary_pos_emb, ...).
  ``ROTARY_MODEL_TYPES`` (Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3, GPT-NeoX, StableLM) are
  the types known to work with gradients and generation tested too (so are Cohere and GLM, interleaved pairs);
  tests/python/test_transformers_coverage.py sweeps every rotary modeling file of the installed transformers.
  The model's rotary module (``model.rotary_emb``), which builds cos/sin tables once per forward pass, is
  replaced by :class:`RotaryPositions`: it hands every layer the positions and posenc's float64 frequencies
  (:class:`RotaryAngles`) instead of tables, and each attention layer then rotates q and k with one
  ``posenc.rope_qk`` call: no cos/sin tensor is built at all, for any scaling (default, linear, dynamic,
  YaRN, Llama 3, LongRoPE). The layers call their modeling file's ``apply_rotary_pos_emb`` by its global
  name, so that function is wrapped while a patched model of that file exists: the wrapper sends
  :class:`RotaryAngles` to ``rope_qk`` and passes real cos/sin tables, those of every unpatched model, to the
  original function unchanged. Attention layers with a ``q_norm`` and a ``k_norm`` (Qwen3, Gemma 3, OLMo 2, ...)
  get them applied by the rotation: one ``posenc.qk_norm_rope`` call per layer instead of two norms and a
  rotation, in the norm convention found by probing the norm modules, and only where a probe call of the layer
  gives the unfused output (:func:`_fuse_qk_norms`; the record's ``notes`` say why a layer was left unfused).
- **BLOOM**: the model's ``build_alibi_tensor`` becomes posenc's slopes times ``positions_from_mask`` (one row
  per head, as BLOOM adds it inside ``baddbmm``), BLOOM's bias for padding anywhere in the mask; a call without
  an attention mask gets an all-ones mask, so that both of BLOOM's paths build the bias with posenc.
- **T5**: ``compute_bias`` of the attention layers that own a bucket table becomes ``posenc.t5_bias``
  (``posenc.relative_position_bucket`` when a static cache gives its length as a tensor).
- **GPT-2**: ``wte(input_ids) + wpe(position_ids)`` becomes one ``posenc.embed_learned`` call.
- **DINOv3** (any model holding a ``DINOv3ViTRopePositionEmbedding``): that module becomes
  :class:`PatchCenterAngles`, which hands the layers DINOv3's patch centres (its training augmentations included)
  and float64 frequencies as :class:`RotaryAngles`; the modeling file's ``apply_rotary_pos_emb`` is wrapped as for
  the rotary family, one ``rope_qk`` call with ``pair_axis``, the cls and register tokens at angle 0.
- **Learned tables resized to the image grid** (ViT, DINOv2, SigLIP, CLIP, ... and dual encoders holding them;
  models without a rotary module): an embeddings module with ``interpolate_pos_encoding(embeddings, height, width)``
  and a learned table, recognized by probing (:func:`recognize_resized_tables`), gets its forward's
  ``embeddings + self.interpolate_pos_encoding(...)`` done by one ``posenc.add_resampled_learned`` call: the
  shadowed method returns a :class:`ResampledTable`, which that ``+`` turns into the op.

Everything else is per instance: a swapped submodule, or an instance attribute that shadows its class's method
on that one object. No class is modified, and the state dict is unchanged.
"""
import copy
import dataclasses
import functools
import importlib
import inspect
import math
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import frequencies
from .. import functional as PF
from ..nn import RotaryEmbedding

__all__ = ["patch", "unpatch", "is_patched", "recognize_rotary", "recognize_resized_tables", "NotRecognized", "Patch",
           "Change", "RotaryAngles", "RotaryPositions", "PatchCenterAngles", "ResampledTable", "SUPPORTED_MODEL_TYPES",
           "ROTARY_MODEL_TYPES"]

# The types known to work (tested with gradients and generation); patch recognizes rotary models by contract.
ROTARY_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt_neox",
                      "stablelm")
SUPPORTED_MODEL_TYPES = ROTARY_MODEL_TYPES + ("bloom", "t5", "gpt2")

_NAME = "posenc.integrations.transformers"


@dataclass
class Change:
    """One replacement: ``kind`` is "module" (a submodule swapped), "method" (an attribute of one instance that
    shadows its class's method) or "function" (a modeling file's global function wrapped); ``target`` names it
    (``model.rotary_emb``, ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``), ``replacement``
    says what took its place."""

    kind: str
    target: str
    replacement: str

    def __str__(self) -> str:
        return f"{self.kind:<8} {self.target} -> {self.replacement}"


@dataclass
class Patch:
    """What :func:`patch` changed in one model (``changes``), and how to undo it.

    The undo steps are data (a submodule path and the module it held, an attribute to delete), applied to the
    model given to :func:`unpatch`: a ``copy.deepcopy`` of a patched model is a patched model of its own, whose
    ``unpatch`` restores the copy."""

    model_type: str
    family: str
    changes: List[Change] = field(default_factory=list)
    _undo: List[Tuple[str, str, Any]] = field(default_factory=list, repr=False)
    # What was left as Hugging Face has it, and why (q_norm/k_norm that could not be fused into the rotation).
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([f"posenc patch of a {self.model_type} model ({self.family}):"]
                         + [f"  {change}" for change in self.changes] + [f"  note     {note}" for note in self.notes])


def patch(model: torch.nn.Module) -> Patch:
    """Switches the positional code of a Hugging Face model to posenc, in place; returns the :class:`Patch`
    listing the changes.

    BLOOM, T5 and GPT-2 are recognized by ``config.model_type``, DINOv3 by its rotary module, a vision model
    without a rotary module by its embeddings' resized learned table (see :func:`recognize_resized_tables`); any
    other model is patched when it follows the rotary contract (see :func:`recognize_rotary`), whatever its type.
    Logits, gradients and greedy generation stay those of the unpatched model (up to the rounding of its float32
    cos/sin tables, which posenc forms in float64; of a resized table, which posenc resamples in float64).
    Raises ``ValueError`` naming the model type and the reason for a model it does not recognize,
    ``RuntimeError`` if the model is already patched.
    """
    model_type = _model_type(model)
    if is_patched(model):
        raise RuntimeError(f"{_NAME}.patch: this {model_type} model is already patched; call unpatch(model) first")
    if model_type == "bloom":
        record = _patch_bloom(model)
    elif model_type == "t5":
        record = _patch_t5(model)
    elif model_type == "gpt2":
        record = _patch_gpt2(model)
    elif _find(model, _is_dinov3_rope):
        record = _patch_dinov3(model, model_type)
    elif _find(model, _has_resized_table) and not _find(model, _is_rotary_module):
        record = _patch_resized_tables(model, model_type)
    else:
        record = _patch_rotary(model, model_type)
    model._posenc_patch = record
    return record


def unpatch(model: torch.nn.Module) -> Patch:
    """Undoes :func:`patch` (in reverse order) and returns its record; raises ``ValueError`` if the model is not
    patched."""
    record = getattr(model, "_posenc_patch", None)
    if record is None:
        raise ValueError(f"{_NAME}.unpatch: the model is not patched")
    for kind, path, value in reversed(record._undo):
        if kind == "module":
            replacement = model.get_submodule(path)
            if isinstance(replacement, _HoldsRotaryWrapper):
                replacement.release()
            _set_submodule(model, path, value)
        else:
            model.get_submodule(path).__dict__.pop(value, None)
    del model._posenc_patch
    return record


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch` has been applied to this model (and not undone)."""
    return getattr(model, "_posenc_patch", None) is not None


def _model_type(model: torch.nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type or not isinstance(model_type, str):
        raise ValueError(f"{_NAME}: got a {type(model).__name__} without a config.model_type; patch takes a Hugging "
                         f"Face model (known to work: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return model_type


def _find(model: torch.nn.Module, predicate: Callable[[torch.nn.Module], bool]) -> List[Tuple[str, torch.nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if predicate(module)]


def _set_submodule(model: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _swap_module(record: Patch, model: torch.nn.Module, path: str, module: torch.nn.Module, what: str) -> None:
    record._undo.append(("module", path, model.get_submodule(path)))
    _set_submodule(model, path, module)
    record.changes.append(Change("module", path, what))


def _shadow_method(record: Patch, owner: torch.nn.Module, path: str, method: str, fn: Callable, what: str) -> None:
    """Binds fn to one instance as ``owner.<method>``: an instance attribute shadows the class's method (and
    ``copy.deepcopy`` binds it to the copy). It carries the class method's name, docstring and signature, because
    code that inspects ``model.forward`` (generation, transformers' tests) decides from its parameters."""

    @functools.wraps(getattr(type(owner), method))
    def shadow(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    setattr(owner, method, types.MethodType(shadow, owner))
    record._undo.append(("attribute", path, method))
    record.changes.append(Change("method", f"{path or 'model'}.{method}", what))


def _class_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """The arguments of a call to ``module``'s class forward, all by name (its ``**kwargs`` flattened)."""
    signature = inspect.signature(type(module).forward)
    bound = signature.bind_partial(module, *args, **kwargs).arguments
    bound.pop(next(iter(signature.parameters)))  # self
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
    return bound


# ---------------------------------------------------------------- rotary

def _format_of(unsqueeze_dim: int) -> str:
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f"{_NAME}: q and k must be [B, H, S, D] (unsqueeze_dim=1) or [B, S, H, D] "
                         f"(unsqueeze_dim=2), got unsqueeze_dim={unsqueeze_dim}")
    return "bhsd" if unsqueeze_dim == 1 else "bshd"


class RotaryAngles:
    """What a patched model passes to its layers in place of Hugging Face's cos/sin tables (``position_embeddings``
    holds it twice, as ``(cos, sin)``): the positions and float64 frequencies of this forward pass.

    ``rotate(q, k, unsqueeze_dim)`` is one ``rope_qk`` call: q and k as the attention layer holds them, [B, H, S, D]
    (``unsqueeze_dim=1``, Hugging Face's default) or [B, S, H, D] (``unsqueeze_dim=2``); the first ``2 *
    len(inv_freq)`` channels rotate, the others pass through (partial rotary). ``layout`` is the rotation the
    modeling file does: "neox" (halves, channel i with i + rotary_dim / 2) or "gptj" (interleaved pairs 2i,
    2i + 1: Cohere, GLM, ERNIE 4.5, Helium), pair i at frequency ``inv_freq[i]`` in both. Angles that carry a
    layer's q/k norms (``with_qk_norm``, handed to that one layer) make ``rotate`` one ``qk_norm_rope`` call.
    """

    __slots__ = ("positions", "inv_freq", "attention_scale", "layout", "pair_axis", "qk_norm")

    def __init__(self, positions: Tensor, inv_freq: Tensor, attention_scale: float, layout: str = "neox",
                 pair_axis: Optional[Tensor] = None, qk_norm: Optional[tuple] = None):
        self.positions, self.inv_freq, self.attention_scale = positions, inv_freq, attention_scale
        self.layout, self.pair_axis = layout, pair_axis
        # (q_weight, k_weight, eps, norm): the q_norm/k_norm of the one attention layer these angles were handed
        # to, deferred to the rotation (see _fuse_qk_norms); None for a plain rotation.
        self.qk_norm = qk_norm

    def with_qk_norm(self, q_weight: Tensor, k_weight: Tensor, eps: float, norm: str) -> "RotaryAngles":
        """The same angles, for a layer whose q_norm and k_norm ``rotate`` applies (one ``qk_norm_rope`` call)."""
        return RotaryAngles(self.positions, self.inv_freq, self.attention_scale, self.layout, self.pair_axis,
                            (q_weight, k_weight, eps, norm))

    def rotate(self, q: Tensor, k: Tensor, unsqueeze_dim: int = 1) -> Tuple[Tensor, Tensor]:
        if self.qk_norm is not None:
            q_weight, k_weight, eps, norm = self.qk_norm
            return torch.ops.posenc.qk_norm_rope(q, k, q_weight, k_weight, self.positions, self.inv_freq, eps, norm,
                                                 self.attention_scale, self.layout, _format_of(unsqueeze_dim), 0,
                                                 None, self.pair_axis)
        return torch.ops.posenc.rope_qk(q, k, self.positions, self.inv_freq, self.attention_scale, self.layout,
                                        _format_of(unsqueeze_dim), 0, None, self.pair_axis)

    def _no_qk_norm(self, method: str) -> None:
        if self.qk_norm is not None:  # the layer's norms were deferred to rotate(q, k): this call would drop them
            raise RuntimeError(f"{_NAME}: RotaryAngles.{method} got angles that carry a layer's q/k norm; only "
                               f"rotate(q, k) applies it")

    def rotate_interleaved_to_halves(self, q: Tensor, k: Tensor, unsqueeze_dim: int = 1) -> Tuple[Tensor, Tensor]:
        """The MLA models' ``apply_rotary_pos_emb_interleave`` (DeepSeek V3, Mistral 4, GLM-4 MoE Lite, ...): pairs
        (2i, 2i + 1) rotated at frequency i, as one ``rope_qk`` call with layout "gptj", and returned in halves
        (the even channels, then the odd ones), as that function returns them."""
        self._no_qk_norm("rotate_interleaved_to_halves")
        q, k = torch.ops.posenc.rope_qk(q, k, self.positions, self.inv_freq, self.attention_scale, "gptj",
                                        _format_of(unsqueeze_dim), 0, None, self.pair_axis)
        return (torch.cat([q[..., 0::2], q[..., 1::2]], dim=-1), torch.cat([k[..., 0::2], k[..., 1::2]], dim=-1))

    def rotate_one(self, x: Tensor, unsqueeze_dim: int = 1) -> Tensor:
        """One ``rope`` call, for modeling files whose ``apply_rotary_pos_emb(x, cos, sin, ...)`` rotates one
        tensor at a time (Gemma 4)."""
        self._no_qk_norm("rotate_one")
        return torch.ops.posenc.rope(x, self.positions, self.inv_freq, self.attention_scale, self.layout,
                                     _format_of(unsqueeze_dim), 0, None, self.pair_axis)

    def to(self, *args, **kwargs) -> "RotaryAngles":
        """The angles on a device, as ``Tensor.to`` moves a tensor (Llama 4 and DeepSeek V2 move their complex
        tables to q's device before rotating). A dtype changes nothing: positions stay integer, frequencies
        float64."""
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if device is None or torch.device(device) == self.positions.device:
            return self
        pair_axis = None if self.pair_axis is None else self.pair_axis.to(device)
        return RotaryAngles(self.positions.to(device), self.inv_freq.to(device), self.attention_scale, self.layout,
                            pair_axis, self.qk_norm)

    def __repr__(self) -> str:
        axes = "" if self.pair_axis is None else f", {self.positions.shape[0]} axes"
        norm = "" if self.qk_norm is None else f", qk_norm={self.qk_norm[3]!r} (eps={self.qk_norm[2]})"
        return (f"RotaryAngles(positions {list(self.positions.shape)}, {self.inv_freq.numel()} frequencies, "
                f"attention_scale={self.attention_scale}, layout={self.layout!r}{axes}{norm})")


class _HoldsRotaryWrapper(torch.nn.Module):
    """A replacement module that keeps its modeling file's apply_rotary_pos_emb wrapped while it exists (and in each
    deep copy of it)."""

    modeling: str

    def _hold_wrapper(self) -> None:
        _hold_rotary_wrapper(self.modeling)
        self._release = weakref.finalize(self, _release_rotary_wrapper, self.modeling)

    def release(self) -> None:
        """Gives up this instance's hold on the wrapper (once; later calls do nothing)."""
        self._release()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_HoldsRotaryWrapper":
        duplicate = type(self).__new__(type(self))
        memo[id(self)] = duplicate
        duplicate.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()
                                   if key != "_release"})
        duplicate._hold_wrapper()
        return duplicate

    def __getstate__(self) -> Dict[str, Any]:
        # Pickled (torch.save of a patched model): the hold of this process stays behind, and the loaded module
        # takes one of its own, so that it works in a process where nothing else holds the wrapper.
        return {key: value for key, value in super().__getstate__().items() if key != "_release"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._hold_wrapper()


class RotaryPositions(_HoldsRotaryWrapper):
    """Takes the place of a Hugging Face model's rotary module (``<Model>RotaryEmbedding``): ``forward(x,
    position_ids)`` returns ``(angles, angles)`` with :class:`RotaryAngles` instead of cos/sin tables (the angles
    alone instead of complex tables, for files that rotate with ``apply_rotary_emb``: Llama 4, DeepSeek V2).

    Frequencies come from ``posenc.nn.RotaryEmbedding.from_hf_config`` (float64; the config's scaling). The two
    scalings whose frequencies depend on the sequence follow Hugging Face's rule with L = max(position_ids) + 1:
    LongRoPE takes its long factors when L > original_max_position_embeddings; dynamic NTK keeps Hugging Face's
    state, the longest L seen, and rescales for it (back to the original frequencies once an L below
    max_position_embeddings arrives), so a model gives the same results patched or not, call after call.

    Each instance holds the wrapper of its modeling file's ``apply_rotary_pos_emb`` (see :func:`patch`) until
    :meth:`release` (called by :func:`unpatch`) or until it is garbage collected; a ``copy.deepcopy`` holds it
    too.

    The attributes of the replaced module stay readable, with its values: ``rope_type``, ``attention_scaling``,
    ``inv_freq`` and ``original_inv_freq`` (Hugging Face's float32 frequencies, non-persistent buffers as there;
    dynamic NTK updates ``inv_freq`` as Hugging Face does), ``max_seq_len_cached``, ``original_max_seq_len`` and
    ``config``. The rotation itself uses posenc's float64 frequencies (``self.rotary``), in ``layout``: "neox"
    (halves) or "gptj" (interleaved pairs), the rotation :func:`recognize_rotary` found in the modeling file.
    """

    def __init__(self, original: torch.nn.Module, modeling: str, layout: str = "neox",
                 pair_axis: Optional[Any] = None):
        super().__init__()
        if layout not in ("neox", "gptj"):
            raise ValueError(f"{_NAME}: layout must be 'neox' or 'gptj', got {layout!r}")
        self.config = original.config
        self.modeling = modeling
        self.layout = layout
        # A file that rotates by complex tables (apply_rotary_emb: Llama 4, DeepSeek V2) takes one tensor from its
        # rotary module, not a (cos, sin) pair: it gets the angles alone.
        self.angles_alone = _original_apply(modeling) is None
        # M-RoPE: the axis of each frequency pair, a tensor, or one per layer type (a dict) where the rope
        # parameters are per layer type (plain attributes: model.to(dtype) leaves them int64)
        self.pair_axis = pair_axis.detach().clone() if isinstance(pair_axis, Tensor) else None
        self.pair_axes = {t: a.detach().clone() for t, a in pair_axis.items()} if isinstance(pair_axis, dict) \
            else None
        # Code written for Hugging Face's module (its tests, scaling checks) reads these.
        self.rope_type = original.rope_type
        self.layer_types = _layer_types(original)
        if self.layer_types is None:
            self.rotary = RotaryEmbedding.from_hf_config(original.config)
            self.attention_scaling = original.attention_scaling
            self._keep_frequencies(original, "")
        else:  # forward(x, position_ids, layer_type), as Gemma 3's module: one rotary embedding per layer type
            self.rotaries = torch.nn.ModuleDict({t: RotaryEmbedding.from_hf_config(original.config, layer_type=t)
                                                 for t in self.layer_types})
            for t in self.layer_types:
                setattr(self, f"{t}_attention_scaling", getattr(original, f"{t}_attention_scaling"))
                self._keep_frequencies(original, f"{t}_")
        # A "dynamic" dict with an alpha (HunYuan) is fixed NTK: frequencies.rope then ignores the length, so the
        # state kept below changes nothing for it. (Per layer type, dynamic NTK is refused by recognize_rotary.)
        self.dynamic = self.layer_types is None and self.rotary.rope_type == "dynamic"
        length = getattr(original, "original_max_seq_len", None) if self.layer_types is not None else \
            self.rotary.max_position_embeddings
        self.original_max_seq_len = int(length or 0)
        # Hugging Face's dynamic state, taken over from the module this one replaces.
        self.max_seq_len_cached = int(getattr(original, "max_seq_len_cached", self.original_max_seq_len))
        self._dynamic_inv_freq: Optional[Tuple[int, Tensor]] = None
        self._hold_wrapper()

    def _keep_frequencies(self, original: torch.nn.Module, prefix: str) -> None:
        inv_freq = getattr(original, f"{prefix}inv_freq")
        original_inv_freq = getattr(original, f"{prefix}original_inv_freq", inv_freq)
        self.register_buffer(f"{prefix}inv_freq", inv_freq.detach().clone(), persistent=False)
        self.register_buffer(f"{prefix}original_inv_freq", original_inv_freq.detach().clone(), persistent=False)

    def _inv_freq(self, x: Tensor, positions: Tensor) -> Tensor:
        if not self.dynamic:
            return self.rotary.inv_freq_for(x, positions)
        seq_len, previous = int(positions.max()) + 1, self.max_seq_len_cached
        if seq_len > self.max_seq_len_cached:
            self.max_seq_len_cached = seq_len
        elif seq_len < self.original_max_seq_len < self.max_seq_len_cached:
            self.max_seq_len_cached = self.original_max_seq_len
        if self._dynamic_inv_freq is None or self._dynamic_inv_freq[0] != self.max_seq_len_cached:
            inv_freq = frequencies.rope(self.rotary.rotary_dim, self.rotary.base, self.rotary.scaling,
                                        self.max_seq_len_cached)[0]
            self._dynamic_inv_freq = (self.max_seq_len_cached, inv_freq)
        if self.max_seq_len_cached != previous:  # where Hugging Face's module replaces its inv_freq
            self.inv_freq = (self.original_inv_freq if self.max_seq_len_cached == self.original_max_seq_len
                             else self._dynamic_inv_freq[1].to(self.inv_freq))
        return self._dynamic_inv_freq[1].to(self.rotary.inv_freq.device)

    def forward(self, x: Tensor, position_ids: Tensor,
                layer_type: Optional[str] = None) -> Union[RotaryAngles, Tuple[RotaryAngles, RotaryAngles]]:
        if self.layer_types is not None and layer_type not in self.rotaries:
            raise ValueError(f"{_NAME}: layer_type must be one of {self.layer_types}, got {layer_type!r}")
        pair_axis = self.pair_axis if self.pair_axes is None else self.pair_axes[layer_type]
        if pair_axis is not None:  # M-RoPE: [B, S] is every axis at once, as Hugging Face's module expands it
            if position_ids.dim() == 2:
                position_ids = position_ids.expand(_AXES, -1, -1)
            if position_ids.dim() != 3 or position_ids.size(0) != _AXES:
                raise ValueError(f"{_NAME}: position_ids of a multi-axis rotary must be [3, batch, seq] or [batch, "
                                 f"seq], got shape {list(position_ids.shape)}")
            if pair_axis.device != position_ids.device:
                pair_axis = pair_axis.to(position_ids.device)
                if self.pair_axes is None:
                    self.pair_axis = pair_axis
                else:
                    self.pair_axes[layer_type] = pair_axis
            positions = position_ids[:, 0] if position_ids.size(1) == 1 else position_ids
        else:
            if position_ids.dim() != 2:
                raise ValueError(f"{_NAME}: position_ids must be [batch, seq] or [1, seq], got shape "
                                 f"{list(position_ids.shape)}")
            # [1, S] is shared by the batch: rope_qk then forms each angle once for all rows.
            positions = position_ids[0] if position_ids.size(0) == 1 else position_ids
        if self.layer_types is None:
            inv_freq, scale = self._inv_freq(x, positions), self.rotary.attention_scale
        else:
            rotary = self.rotaries[layer_type]
            inv_freq, scale = rotary.inv_freq_for(x, positions), rotary.attention_scale
        angles = RotaryAngles(positions, inv_freq, scale, self.layout, pair_axis)
        return angles if self.angles_alone else (angles, angles)

    def extra_repr(self) -> str:
        def describe(rotary: RotaryEmbedding) -> str:
            return f"rotary_dim={rotary.rotary_dim}, base={rotary.base}, scaling={rotary.scaling}"

        text = describe(self.rotary) if self.layer_types is None else \
            "; ".join(f"{t}: {describe(self.rotaries[t])}" for t in self.layer_types)
        if self.pair_axis is not None:
            text += f", pair_axis={self.pair_axis.tolist()} (M-RoPE, {_AXES} axes)"
        if self.pair_axes is not None:
            text += "; " + "; ".join(f"{t}: pair_axis={a.tolist()}" for t, a in self.pair_axes.items()) + \
                f" (M-RoPE, {_AXES} axes)"
        return text if self.layout == "neox" else f"{text}, layout=gptj (interleaved pairs)"


# Per modeling file: [{name: its original function, for each rotation wrapped}, the number of RotaryPositions
# holding the wrappers]. Each wrapper hands RotaryAngles to posenc, anything else (cos/sin or complex tables) to
# the original function.
_ROTARY_WRAPPERS: Dict[str, list] = {}
# Per modeling file that rotates by complex tables: the unsqueeze_dim of the q and k its apply_rotary_emb takes,
# found by _check_complex_apply (1: [B, H, S, D], DeepSeek V2; 2: [B, S, H, D], Llama 4).
_COMPLEX_UNSQUEEZE_DIM: Dict[str, int] = {}


def _original(modeling: str, name: str) -> Optional[Callable]:
    if modeling in _ROTARY_WRAPPERS:
        return _ROTARY_WRAPPERS[modeling][0].get(name)
    function = getattr(sys.modules.get(modeling), name, None)
    return function if callable(function) else None


def _original_apply(modeling: str) -> Optional[Callable]:
    return _original(modeling, "apply_rotary_pos_emb")


def _original_interleave(modeling: str) -> Optional[Callable]:
    """The modeling file's ``apply_rotary_pos_emb_interleave`` (the MLA models' rotation of interleaved pairs into
    halves), where it defines one."""
    return _original(modeling, "apply_rotary_pos_emb_interleave")


def _original_complex(modeling: str) -> Optional[Callable]:
    """The modeling file's ``apply_rotary_emb(xq, xk, freqs_cis)``, where it has no ``apply_rotary_pos_emb``: the
    rotation of pairs (2i, 2i + 1) as complex numbers times complex tables (Llama 4, DeepSeek V2)."""
    return None if _original_apply(modeling) is not None else _original(modeling, "apply_rotary_emb")


def _rotated_tensors(signature: inspect.Signature) -> int:
    """How many tensors an ``apply_rotary_pos_emb`` rotates: 2 for ``(q, k, cos, sin, ...)``, 1 for Gemma 4's
    ``(x, cos, sin, ...)`` (its required positional parameters less the two tables); 0 for anything else."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = list(signature.parameters.values())
    required = [p for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    if parameters[:len(required)] != required or len(required) not in (3, 4):
        return 0
    return len(required) - 2


def _unsqueeze_dim_reader(signature: inspect.Signature) -> Callable[..., int]:
    """How the wrapper reads ``unsqueeze_dim`` from a call's arguments, as the original function binds them
    (some versions take ``position_ids`` before it)."""
    parameter = signature.parameters.get("unsqueeze_dim")
    default = 1 if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default
    required = _rotated_tensors(signature) + 2  # the tensors and the two tables: read once, not per call

    def read(*args, **kwargs) -> int:
        # The calls of the modeling files, read without Signature.bind (which torch.compile cannot always trace).
        if len(args) == required and kwargs.keys() <= {"unsqueeze_dim"}:
            return kwargs.get("unsqueeze_dim", default)
        return signature.bind(*args, **kwargs).arguments.get("unsqueeze_dim", default)

    return read


def _wrap_apply(modeling: str, original: Callable) -> Callable:
    signature = inspect.signature(original)
    unsqueeze_dim_of = _unsqueeze_dim_reader(signature)
    if _rotated_tensors(signature) == 1:
        @functools.wraps(original)
        def apply_rotary_pos_emb(x, cos, sin, *args, **kwargs):
            if isinstance(cos, RotaryAngles):
                return cos.rotate_one(x, unsqueeze_dim_of(x, cos, sin, *args, **kwargs))
            return original(x, cos, sin, *args, **kwargs)
    else:
        @functools.wraps(original)
        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            if isinstance(cos, RotaryAngles):
                return cos.rotate(q, k, unsqueeze_dim_of(q, k, cos, sin, *args, **kwargs))
            return original(q, k, cos, sin, *args, **kwargs)
    return apply_rotary_pos_emb


def _wrap_interleave(modeling: str, original: Callable) -> Callable:
    interleave_dim_of = _unsqueeze_dim_reader(inspect.signature(original))

    @functools.wraps(original)
    def apply_rotary_pos_emb_interleave(q, k, cos, sin, *args, **kwargs):
        if isinstance(cos, RotaryAngles):
            return cos.rotate_interleaved_to_halves(q, k, interleave_dim_of(q, k, cos, sin, *args, **kwargs))
        return original(q, k, cos, sin, *args, **kwargs)
    return apply_rotary_pos_emb_interleave


def _wrap_complex(modeling: str, original: Callable) -> Callable:
    unsqueeze_dim = _COMPLEX_UNSQUEEZE_DIM[modeling]

    @functools.wraps(original)
    def apply_rotary_emb(xq, xk, freqs_cis, *args, **kwargs):
        if isinstance(freqs_cis, RotaryAngles):
            return freqs_cis.rotate(xq, xk, unsqueeze_dim)
        return original(xq, xk, freqs_cis, *args, **kwargs)
    return apply_rotary_emb


_WRAP = {"apply_rotary_pos_emb": _wrap_apply, "apply_rotary_pos_emb_interleave": _wrap_interleave,
         "apply_rotary_emb": _wrap_complex}


def _hold_rotary_wrapper(modeling: str) -> None:
    """Wraps the modeling file's rotations (each checked by recognize_rotary before any model of the file is
    patched), once for all the replacement modules of that file."""
    if modeling not in _ROTARY_WRAPPERS:
        module = importlib.import_module(modeling)
        found = {"apply_rotary_pos_emb": _original_apply(modeling),
                 "apply_rotary_pos_emb_interleave": _original_interleave(modeling),
                 "apply_rotary_emb": _original_complex(modeling)}
        originals = {name: function for name, function in found.items() if function is not None}
        for name, original in originals.items():
            setattr(module, name, _WRAP[name](modeling, original))
        _ROTARY_WRAPPERS[modeling] = [originals, 0]
    _ROTARY_WRAPPERS[modeling][1] += 1


def _release_rotary_wrapper(modeling: str) -> None:
    entry = _ROTARY_WRAPPERS[modeling]
    entry[1] -= 1
    if entry[1] == 0:  # the last holder: the modeling file gets its own functions back
        for name, original in entry[0].items():
            setattr(sys.modules[modeling], name, original)
        del _ROTARY_WRAPPERS[modeling]


class NotRecognized(ValueError):
    """Raised by :func:`patch` (and :func:`recognize_rotary`) for a model it does not recognize: ``model_type``,
    ``category`` (a short, stable phrase such as "no rotary module", "non-standard apply_rotary_pos_emb",
    "multi-axis positions", "rope_type unsupported") and ``detail``."""

    def __init__(self, model_type: str, category: str, detail: str):
        self.model_type, self.category, self.detail = model_type, category, detail
        super().__init__(f'{_NAME}.patch: got model_type "{model_type}", which is not recognized: {category}: '
                         f'{detail} (known to work: {", ".join(SUPPORTED_MODEL_TYPES)}; see '
                         f'docs/integrations-transformers.md)')


_PROBE_LENGTH = 12  # positions 0..11 of the probes: below every original length the tests use
_PROBE_ATOL = 1e-5


def _tables(angles: Tensor, scale: float, layout: str = "neox") -> Tuple[Tensor, Tensor]:
    """cos/sin tables of angles [S, r/2]: "neox" holds each frequency in both halves, "gptj" twice side by side,
    "half" once (GPT-OSS: tables [S, r/2] that its apply_rotary_pos_emb applies to both halves)."""
    if layout == "half":
        return angles.cos() * scale, angles.sin() * scale
    doubled = torch.cat([angles, angles], dim=-1) if layout == "neox" else torch.repeat_interleave(angles, 2, dim=-1)
    return doubled.cos() * scale, doubled.sin() * scale


def _max_diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("inf")


def _probe_atol(module_inv_freq: Tensor, max_position: int) -> float:
    """How far the tables of a module may be from posenc's: 1e-5, or, for a module whose frequencies were rounded
    to a lower precision (``model.to(torch.bfloat16)`` before ``patch``), the angle error of that rounding at
    max_position (twice the bound, as margin). Such a module's own tables agree with the exact frequencies to
    that rounding only; the patched model rotates with the exact ones."""
    if module_inv_freq.dtype in (torch.float32, torch.float64):
        return _PROBE_ATOL
    eps = torch.finfo(module_inv_freq.dtype).eps
    return max(_PROBE_ATOL, max_position * float(module_inv_freq.abs().max()) * eps)


def _module_inv_freq(module: torch.nn.Module, layer_type: Optional[str]) -> Tensor:
    """Hugging Face's frequencies of a rotary module (of one layer type, where its parameters are per type)."""
    return getattr(module, "inv_freq" if layer_type is None else f"{layer_type}_inv_freq")


def _check_tables(model_type: str, name: str, module: torch.nn.Module, rotary: RotaryEmbedding,
                  layer_type: Optional[str] = None) -> str:
    """Hugging Face's module, called as the model calls it (on a copy: dynamic NTK keeps state; with the layer type
    where its parameters are per layer type), returns the tables of posenc's frequencies, [1, S, rotary_dim]: in
    neox form (each frequency in both halves; returns "neox") or GPT-J form (each frequency twice side by side, as
    Cohere builds them; returns "gptj"), or [1, S, rotary_dim / 2] with each frequency once (GPT-OSS; returns
    "half"), or complex tables scale * exp(i angle), [1, S, rotary_dim / 2] (Llama 4, DeepSeek V2; returns
    "complex")."""
    module_inv_freq = _module_inv_freq(module, layer_type)
    device = module_inv_freq.device
    positions = torch.arange(_PROBE_LENGTH, device=device)
    x = torch.zeros(1, _PROBE_LENGTH, rotary.head_dim, dtype=torch.float32, device=device)
    by_type = () if layer_type is None else (layer_type,)
    try:
        with torch.no_grad():
            tables = copy.deepcopy(module)(x, positions[None], *by_type)
    except Exception as error:  # noqa: BLE001 - any failure means the contract is not this one
        raise NotRecognized(model_type, "rotary forward", f"{name}(x, position_ids) raised {type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''}") from None
    complex_tables = isinstance(tables, Tensor) and tables.is_complex()
    if complex_tables:  # its real part is the cos table, its imaginary part the sin one, each frequency once
        tables = (tables.real, tables.imag)
    if not (isinstance(tables, tuple) and len(tables) == 2 and all(isinstance(t, Tensor) for t in tables)):
        raise NotRecognized(model_type, "rotary forward", f"{name}(x, position_ids) returns "
                            f"{type(tables).__name__}, not a (cos, sin) pair of tensors")
    cos, sin = tables
    expected_shape = (1, _PROBE_LENGTH, rotary.rotary_dim)
    half = tuple(cos.shape) == (1, _PROBE_LENGTH, rotary.rotary_dim // 2)
    if tuple(cos.shape) != expected_shape and not half:
        category = "multi-axis positions" if cos.dim() != 3 or cos.size(0) != 1 else "cos/sin shape"
        raise NotRecognized(model_type, category, f"{name} returns cos of shape {list(cos.shape)} for position_ids "
                            f"[1, {_PROBE_LENGTH}], expected {list(expected_shape)}")
    # Position ids with a leading axis, [2, 1, S]: a one-axis module gives a table per row (4-D); one that folds
    # the axes into [1, S, rotary_dim] takes one position per axis (NeoMME's rows and columns), which [1, S]
    # position ids only hide (it expands them to every axis).
    try:
        with torch.no_grad():
            folded = copy.deepcopy(module)(x, positions[None, None].expand(2, 1, -1), *by_type)
            folded = folded if complex_tables else folded[0]
    except Exception:  # noqa: BLE001 - refusing axes is the one-axis contract
        folded = None
    if isinstance(folded, Tensor) and tuple(folded.shape) == tuple(cos.shape):
        raise NotRecognized(model_type, "multi-axis positions", f"{name} folds position_ids [2, 1, {_PROBE_LENGTH}] "
                            f"(one row per axis) into one table: positions per axis")
    angles = positions.double()[:, None] * rotary.inv_freq_for(x, positions).to(positions.device)[None, :]
    scale = rotary.attention_scale
    diffs = {}
    for layout in ("half",) if half else ("neox", "gptj"):
        ref_cos, ref_sin = _tables(angles, scale, layout)
        diffs[layout] = max(_max_diff(cos[0], ref_cos), _max_diff(sin[0], ref_sin))
        if diffs[layout] <= _probe_atol(module_inv_freq, _PROBE_LENGTH - 1):
            return "complex" if complex_tables else layout
    rope_type = module.rope_type if layer_type is None else f"{layer_type}: {module.rope_type[layer_type]}"
    raise NotRecognized(model_type, "frequencies differ", f"the cos/sin tables of {name} ({rope_type}) "
                        f"differ from posenc's frequencies of its config by " + " and ".join(
                            f"{diff:.2e} ({layout})" for layout, diff in diffs.items()))


_AXES = 3  # M-RoPE's time, height and width: position_ids [3, B, S]


def _probe_pair_axis(model_type: str, name: str, module: torch.nn.Module, rotary: RotaryEmbedding,
                     layout: str, layer_type: Optional[str] = None) -> Tensor:
    """The axis that drives each frequency pair of a multi-axis (M-RoPE) rotary module, read from the module
    itself rather than from its sections: called (on a copy) with position ids [3, 1, S] that move one axis at a
    time, the columns of its sin table that move name that axis' pairs (in the module's table layout). Then
    checked on positions that differ on every axis: the tables must be posenc's, angle(pair i) =
    positions[pair_axis[i]] * inv_freq[i], to 1e-5. Consecutive sections (Qwen2-VL, GLM-4V) and Qwen3-VL's
    interleaved ones are both just data here."""
    module_inv_freq = _module_inv_freq(module, layer_type)
    device = module_inv_freq.device
    by_type = () if layer_type is None else (layer_type,)
    positions = torch.arange(1, _PROBE_LENGTH + 1, device=device)
    x = torch.zeros(1, _PROBE_LENGTH, rotary.head_dim, dtype=torch.float32, device=device)
    pairs = rotary.rotary_dim // 2
    column = torch.arange(pairs) * 2 if layout == "gptj" else torch.arange(pairs)  # the first column of pair i

    def tables(position_ids: Tensor) -> Tuple[Tensor, Tensor]:
        with torch.no_grad():
            return copy.deepcopy(module)(x, position_ids, *by_type)

    try:
        moved = []
        for axis in range(_AXES):
            position_ids = torch.zeros(_AXES, 1, _PROBE_LENGTH, dtype=torch.long, device=device)
            position_ids[axis] = positions
            moved.append(tables(position_ids)[1][0][:, column].abs().amax(0).cpu() > 0)
        found = torch.stack(moved)  # [axes, pairs]
        generator = torch.Generator().manual_seed(0)
        mixed = torch.randint(0, 4 * _PROBE_LENGTH, (_AXES, 1, _PROBE_LENGTH), generator=generator).to(device)
        cos, sin = tables(mixed)
    except Exception as error:  # noqa: BLE001 - any failure means the contract is not this one
        raise NotRecognized(model_type, "multi-axis sections", f"{name}(x, position_ids [3, 1, S]) raised "
                            f"{type(error).__name__}") from None
    if not bool((found.sum(0) == 1).all()):
        raise NotRecognized(model_type, "multi-axis sections", f"{name}: not every frequency pair follows exactly "
                            f"one of the {_AXES} position axes")
    pair_axis = found.long().argmax(0)
    inv_freq = rotary.inv_freq_for(x, positions).cpu()
    angles = mixed[:, 0].cpu().double()[pair_axis].T * inv_freq[None, :]  # [S, pairs]
    ref_cos, ref_sin = _tables(angles, rotary.attention_scale, layout)
    diff = max(_max_diff(cos[0].cpu(), ref_cos), _max_diff(sin[0].cpu(), ref_sin))
    if not diff <= _probe_atol(module_inv_freq, int(mixed.max())):
        raise NotRecognized(model_type, "multi-axis sections", f"{name}: the tables of positions per axis differ "
                            f"from posenc's multi-axis ones (pair_axis {pair_axis.tolist()}) by {diff:.2e}")
    return pair_axis


def _check_apply(model_type: str, modeling: str, function: Callable, rotary: RotaryEmbedding,
                 tables: str = "neox") -> str:
    """The modeling file's apply_rotary_pos_emb, given tables in the rotary module's form (``tables``), gives for
    q and k [B, H, S, D] (and [B, S, H, D] where it takes unsqueeze_dim) what RotaryAngles.rotate gives in one
    of rope_qk's layouts: the neox rotation (halves) or the GPT-J one (interleaved pairs 2i, 2i + 1) of the first
    rotary_dim channels. Returns that layout. D is the head dim, or rotary_dim for files whose layers pass only
    the rotated channels (where the function cannot take the whole head: one that takes it and rotates other
    channels is refused). A file whose ``apply_rotary_pos_emb(x, cos, sin, ...)`` rotates one tensor (Gemma 4) is
    probed on q alone, against RotaryAngles.rotate_one (one ``rope`` call)."""
    signature = inspect.signature(function)
    tensors = _rotated_tensors(signature)
    if tensors == 0:
        raise NotRecognized(model_type, "apply_rotary_pos_emb signature",
                            f"{modeling}.apply_rotary_pos_emb{signature} is not (q, k, cos, sin, ...) or "
                            f"(x, cos, sin, ...)")
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(_PROBE_LENGTH)
    inv_freq = rotary.inv_freq_for(torch.zeros(1, _PROBE_LENGTH, 1), positions).cpu()
    cos, sin = _tables(positions.double()[:, None] * inv_freq[None, :], rotary.attention_scale, tables)
    cos, sin = cos.float()[None], sin.float()[None]
    layouts = [1, 2] if "unsqueeze_dim" in signature.parameters else [1]
    failures = []
    for head_dim in dict.fromkeys([rotary.head_dim, rotary.rotary_dim]):
        q = torch.randn(2, 3, _PROBE_LENGTH, head_dim, generator=generator)
        k = torch.randn(2, 1, _PROBE_LENGTH, head_dim, generator=generator)
        diffs = {"neox": [], "gptj": []}
        try:
            for unsqueeze_dim in layouts:
                qq, kk = (q, k) if unsqueeze_dim == 1 else (q.transpose(1, 2), k.transpose(1, 2))
                extra = {} if unsqueeze_dim == 1 else {"unsqueeze_dim": 2}
                theirs = function(qq, kk, cos, sin, **extra) if tensors == 2 else (function(qq, cos, sin, **extra),)
                for layout, found in diffs.items():
                    angles = RotaryAngles(positions, inv_freq, rotary.attention_scale, layout)
                    ours = angles.rotate(qq, kk, unsqueeze_dim) if tensors == 2 else \
                        (angles.rotate_one(qq, unsqueeze_dim),)
                    found.append(max(_max_diff(a, b) for a, b in zip(theirs, ours)))
        except Exception as error:  # noqa: BLE001
            failures.append((head_dim, f"raised {type(error).__name__}"))
            continue
        for layout, found in diffs.items():
            if max(found) <= _PROBE_ATOL:
                return layout
        failures.append((head_dim, f"differs from the neox rotation by {max(diffs['neox']):.2e} and from the GPT-J "
                                   f"one (interleaved pairs) by {max(diffs['gptj']):.2e}"))
        break  # it takes the whole head and rotates other channels (DeepSeek V4's trailing ones): not rope_qk's
    raise NotRecognized(model_type, "non-standard apply_rotary_pos_emb", f"{modeling}.apply_rotary_pos_emb with "
                        f"{tables} tables: " + "; ".join(f"head dim {d}: {why}" for d, why in failures))


def _check_complex_apply(model_type: str, modeling: str, function: Callable, rotary: RotaryEmbedding) -> int:
    """The modeling file's ``apply_rotary_emb(xq, xk, freqs_cis)``, given complex tables, gives for q and k of
    rotary_dim channels what ``RotaryAngles.rotate`` gives with layout "gptj" (pair (2i, 2i + 1) as the complex
    number x_2i + i x_2i+1, times exp(i angle)): in [B, S, H, D] (returns unsqueeze_dim 2, Llama 4) or [B, H, S, D]
    (returns 1, DeepSeek V2). The probe's H and S differ, so that a function broadcasting its tables on the other
    axes fails the other layout."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(_PROBE_LENGTH)
    inv_freq = rotary.inv_freq_for(torch.zeros(1, _PROBE_LENGTH, 1), positions).cpu()
    angles = positions.double()[:, None] * inv_freq[None, :]
    tables = torch.polar(torch.full_like(angles, rotary.attention_scale), angles).to(torch.complex64)[None]
    q = torch.randn(2, 3, _PROBE_LENGTH, rotary.rotary_dim, generator=generator)
    k = torch.randn(2, 1, _PROBE_LENGTH, rotary.rotary_dim, generator=generator)
    why = {}
    for unsqueeze_dim in (2, 1):
        qq, kk = (q, k) if unsqueeze_dim == 1 else (q.transpose(1, 2), k.transpose(1, 2))
        try:
            theirs = function(qq, kk, tables)
            ours = RotaryAngles(positions, inv_freq, rotary.attention_scale, "gptj").rotate(qq, kk, unsqueeze_dim)
            diff = max(_max_diff(a, b) for a, b in zip(theirs, ours))
        except Exception as error:  # noqa: BLE001 - this layout is not the function's
            why[_format_of(unsqueeze_dim)] = f"raised {type(error).__name__}"
            continue
        if diff <= _PROBE_ATOL:
            return unsqueeze_dim
        why[_format_of(unsqueeze_dim)] = f"differs from pairs rotated as complex numbers by {diff:.2e}"
    raise NotRecognized(model_type, "non-standard apply_rotary_pos_emb", f"{modeling}.apply_rotary_emb with "
                        f"complex tables: " + "; ".join(f"q and k {f}: {w}" for f, w in why.items()))


def _check_interleave(model_type: str, modeling: str, function: Callable, rotary: RotaryEmbedding) -> None:
    """The modeling file's ``apply_rotary_pos_emb_interleave(q, k, cos, sin, ...)``, given neox tables, gives for
    q and k [B, H, S, rotary_dim] what ``RotaryAngles.rotate_interleaved_to_halves`` gives: pairs (2i, 2i + 1)
    rotated at frequency i, returned in halves. Else the model is refused."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(_PROBE_LENGTH)
    inv_freq = rotary.inv_freq_for(torch.zeros(1, _PROBE_LENGTH, 1), positions).cpu()
    cos, sin = _tables(positions.double()[:, None] * inv_freq[None, :], rotary.attention_scale, "neox")
    q = torch.randn(2, 3, _PROBE_LENGTH, rotary.rotary_dim, generator=generator)
    k = torch.randn(2, 1, _PROBE_LENGTH, rotary.rotary_dim, generator=generator)
    try:
        theirs = function(q, k, cos.float()[None], sin.float()[None])
        ours = RotaryAngles(positions, inv_freq, rotary.attention_scale).rotate_interleaved_to_halves(q, k)
        diff = max(_max_diff(a, b) for a, b in zip(theirs, ours))
    except Exception as error:  # noqa: BLE001
        diff, why = float("inf"), f"raised {type(error).__name__}"
    else:
        why = f"differs from pairs rotated into halves by {diff:.2e}"
    if not diff <= _PROBE_ATOL:
        raise NotRecognized(model_type, "non-standard apply_rotary_pos_emb", f"{modeling}."
                            f"apply_rotary_pos_emb_interleave with neox tables: {why}")


def _layer_types(module: torch.nn.Module) -> Optional[List[str]]:
    """The layer types of a rotary module whose parameters are per layer type (``rope_type`` a dict, as Gemma 3's
    module holds it, with ``<type>_inv_freq`` buffers), else None."""
    rope_type = getattr(module, "rope_type", None)
    return list(rope_type) if isinstance(rope_type, dict) else None


def _check_rotary_module(model_type: str, name: str, module: torch.nn.Module) -> Tuple[str, str, Any]:
    """(modeling file, rotation layout "neox" or "gptj", pair axes or None) of one rotary module, checked for each
    of its layer types where its rope parameters are per layer type. The pair axes are those of a multi-axis
    (M-RoPE) module, found by probing it (:func:`_probe_pair_axis`): a tensor, or a dict of one per layer type."""
    modeling = type(module).__module__
    function, complex_apply = _original_apply(modeling), _original_complex(modeling)
    if function is None and complex_apply is None:
        raise NotRecognized(model_type, "no apply_rotary_pos_emb", f"{name} is a {type(module).__name__} of "
                            f"{modeling}, which defines no apply_rotary_pos_emb")
    layer_types = _layer_types(module)
    if layer_types is None and getattr(module, "layer_types", None) is not None:
        raise NotRecognized(model_type, "per-layer-type rope", f"{name} has layer types but no rope_type per type")
    params = getattr(getattr(module, "config", None), "rope_parameters", None)
    multi_axis = getattr(module, "mrope_section", None) is not None or (isinstance(params, dict) and
                                                                         "mrope_section" in params)
    config = getattr(module, "config", None)
    forward = inspect.signature(type(module).forward)
    arguments = [p for p in list(forward.parameters.values())[1:]
                 if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    expected = ["x", "position_ids"] if layer_types is None else ["x", "position_ids", "layer_type"]
    if len(arguments) < len(expected) or (layer_types is not None and arguments[2].name != "layer_type") or any(
            p.default is inspect.Parameter.empty for p in arguments[len(expected):]):
        raise NotRecognized(model_type, "rotary forward", f"{type(module).__name__}.forward{forward} is not "
                            f"forward({', '.join(expected)})")
    layouts, pair_axes = {}, {}
    for layer_type in layer_types or [None]:
        what = name if layer_type is None else f"{name} (layer type {layer_type!r})"
        prefix = "" if layer_type is None else f"{layer_type}_"
        rope_type = getattr(module, "rope_type", None) if layer_type is None else module.rope_type[layer_type]
        if not isinstance(rope_type, str):
            raise NotRecognized(model_type, "no rope_type", f"{what} ({type(module).__name__}) has no rope_type")
        if rope_type not in frequencies.ROPE_TYPES:
            raise NotRecognized(model_type, "rope_type unsupported", f"rope_type {rope_type!r} of {what} is not one "
                                f"of posenc's {', '.join(frequencies.ROPE_TYPES)}")
        if layer_type is not None and rope_type == "dynamic":
            raise NotRecognized(model_type, "per-layer-type rope", f"{what}: dynamic NTK per layer type (its state, "
                                f"the longest length seen) is not taken over")
        inv_freq = getattr(module, f"{prefix}inv_freq", None)
        if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or config is None:
            raise NotRecognized(model_type, "no inv_freq", f"{what} ({type(module).__name__}) has no 1-D "
                                f"{prefix}inv_freq buffer and config")
        try:
            rotary = RotaryEmbedding.from_hf_config(config, layer_type=layer_type)
        except (ValueError, TypeError, KeyError, RuntimeError) as error:
            raise NotRecognized(model_type, "rope parameters unsupported", f"{what}: {error}") from None
        if rotary.rotary_dim != 2 * inv_freq.numel():
            raise NotRecognized(model_type, "rotary dim", f"the config gives rotary_dim {rotary.rotary_dim}, {what} "
                                f"rotates {2 * inv_freq.numel()} channels")
        tables = _check_tables(model_type, name, module, rotary, layer_type)
        if (tables == "complex") != (function is None):
            raise NotRecognized(model_type, "non-standard apply_rotary_pos_emb", f"{name} returns "
                                f"{'complex' if tables == 'complex' else 'cos/sin'} tables, and {modeling} rotates "
                                f"with {'apply_rotary_pos_emb' if function is not None else 'apply_rotary_emb'}")
        if tables == "complex":
            if multi_axis:
                raise NotRecognized(model_type, "multi-axis sections", f"{name}: complex tables of several axes")
            _COMPLEX_UNSQUEEZE_DIM[modeling] = _check_complex_apply(model_type, modeling, complex_apply, rotary)
            layouts[layer_type] = "gptj"
            continue
        if multi_axis:
            pair_axes[layer_type] = _probe_pair_axis(model_type, what, module, rotary, tables, layer_type)
        layouts[layer_type] = _check_apply(model_type, modeling, function, rotary, tables)
        interleave = _original_interleave(modeling)
        if interleave is not None:
            if tables != "neox":
                raise NotRecognized(model_type, "non-standard apply_rotary_pos_emb", f"{modeling} defines "
                                    f"apply_rotary_pos_emb_interleave and {name} builds GPT-J style tables")
            _check_interleave(model_type, modeling, interleave, rotary)
    if len(set(layouts.values())) != 1:
        raise NotRecognized(model_type, "per-layer-type rope", f"{name}: its layer types rotate in different "
                            f"layouts ({layouts})")
    pair_axis = None if not multi_axis else pair_axes if layer_types is not None else pair_axes[None]
    return modeling, next(iter(layouts.values())), pair_axis


def recognize_rotary(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str]]:
    """The rotary modules of a model that follows Hugging Face's rotary contract: ``[(path, module, modeling
    file)]``; raises :class:`NotRecognized` (a ``ValueError``) with the reason otherwise.

    The contract, checked on the instance and its modeling file, not by model type:

    - the model has one or more ``*RotaryEmbedding`` submodules, each with a string ``rope_type`` that posenc
      knows (``frequencies.ROPE_TYPES``), a 1-D ``inv_freq``, its ``config`` (from which
      ``RotaryEmbedding.from_hf_config`` reads the same rotary dim) and ``forward(x, position_ids)``;
    - called on positions 0..11 (on a copy), it returns ``(cos, sin)`` of shape [1, S, rotary_dim] equal, to 1e-5,
      to the neox tables of posenc's frequencies times the attention scale (or [1, S, rotary_dim / 2], each
      frequency once: GPT-OSS): this checks the rope type, its parameters, partial rotary and the layout of the
      tables; an M-RoPE module (``mrope_section``) is then probed for the position axis of each pair;
    - the module's modeling file defines ``apply_rotary_pos_emb(q, k, cos, sin, ...)`` which, on random q and k
      [B, H, S, D] (and [B, S, H, D] with ``unsqueeze_dim=2`` where it takes that argument), gives what
      ``rope_qk`` gives: the neox rotation of the first rotary_dim channels, the rest passed through.

    Interleaved pairs are recognized too: GPT-J style tables (each frequency twice side by side, Cohere) where the
    neox ones are not, and an ``apply_rotary_pos_emb`` that, fed the module's tables, rotates pairs (2i, 2i + 1)
    of the first rotary_dim channels (Cohere, GLM, ERNIE 4.5, Helium): equal to ``rope_qk`` with layout "gptj".
    :func:`patch` then rotates with that layout; a file that matches neither rotation is refused.
    """
    return [(name, module, modeling) for name, module, modeling, _, _ in _recognize_rotary(model)]


def _is_rotary_module(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RotaryEmbedding") and not isinstance(module, RotaryPositions)


def _recognize_rotary(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str, str, Any]]:
    """:func:`recognize_rotary`'s rotary modules with the rotation layout of each and its pair axes (M-RoPE, else
    None): (path, module, modeling, layout, pair_axis)."""
    model_type = _model_type(model)
    found = _find(model, _is_rotary_module)
    if not found:
        raise NotRecognized(model_type, "no rotary module", f"this {type(model).__name__} has no *RotaryEmbedding "
                            f"submodule, and bloom, t5 and gpt2 are the non-rotary types patch knows")
    recognized = []
    for name, module in found:
        modeling, layout, pair_axis = _check_rotary_module(model_type, name, module)
        recognized.append((name, module, modeling, layout, pair_axis))
    return recognized


def _patch_rotary(model: torch.nn.Module, model_type: str) -> Patch:
    recognized = _recognize_rotary(model)
    record = Patch(model_type, "rotary")
    for name, original, modeling, layout, pair_axis in recognized:
        replacement = RotaryPositions(original, modeling, layout, pair_axis).to(
            device=next(original.buffers()).device)
        _swap_module(record, model, name, replacement, f"posenc RotaryPositions ({replacement.extra_repr()})")
    fused, fused_files = _fuse_qk_norms(model, model_type)
    for modeling in dict.fromkeys(modeling for _, _, modeling, _, _ in recognized):
        if _original_complex(modeling) is not None:
            record.changes.append(Change("function", f"{modeling}.apply_rotary_emb", "posenc: RotaryAngles -> "
                                         "rope_qk (layout gptj), complex tables -> the original"))
            continue
        one = _rotated_tensors(inspect.signature(_original_apply(modeling))) == 1
        rotation = "rope (one tensor a call)" if one else "rope_qk (qk_norm_rope with a layer's q/k norms)" \
            if modeling in fused_files else "rope_qk"
        record.changes.append(Change("function", f"{modeling}.apply_rotary_pos_emb",
                                     f"posenc: RotaryAngles -> {rotation}, cos/sin tables -> the original"))
        if _original_interleave(modeling) is not None:
            record.changes.append(Change("function", f"{modeling}.apply_rotary_pos_emb_interleave",
                                         "posenc: RotaryAngles -> rope_qk (layout gptj) into halves, cos/sin tables "
                                         "-> the original"))
    record.changes.extend(fused.changes)
    record._undo.extend(fused._undo)
    record.notes.extend(fused.notes)
    return record


# ---------------------------------------------------------------- rotary: q_norm/k_norm fused into the rotation

class _Unfused(Exception):
    """Why one attention layer's q_norm/k_norm stay Hugging Face's modules."""


_NORM_CONVENTIONS = ("llama", "gemma", "olmo2")  # qk_norm_rope's roundings of a model's own RMSNorm
_ATTENTION_PROBE_TOKENS = 8


def _norm_convention(what: str, norm: torch.nn.Module) -> Tuple[str, float]:
    """(qk_norm_rope's ``norm``, eps) that computes what this norm module computes, found from its outputs rather
    than its class: a copy with random weights, on rows whose scales run from 3e-4 to 100 (eps decides the small
    ones), in float32 and in bfloat16, against ``qk_norm_rope`` at angle 0 (the norm alone) in each convention.
    float32 must agree to 1e-5 relative; bfloat16 (where the conventions round differently) picks the closest."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or weight.numel() < 2:
        raise _Unfused(f"{what} ({type(norm).__name__}) has no 1-D weight")
    eps = {value for key, value in vars(norm).items() if "eps" in key.lower() and type(value) is float}
    if len(eps) != 1:
        raise _Unfused(f"{what} ({type(norm).__name__}) has no single float eps attribute")
    eps = eps.pop()
    generator = torch.Generator().manual_seed(0)
    width = weight.numel()
    x = torch.randn(1, 8, 1, width, generator=generator) * torch.logspace(-3.5, 2, 8)[None, :, None, None]
    no_turn = torch.zeros(1, dtype=torch.float64)
    diffs: Dict[str, List[float]] = {convention: [] for convention in _NORM_CONVENTIONS}
    try:
        with torch.no_grad():
            probe = copy.deepcopy(norm).to("cpu", torch.float32)
            probe.weight.copy_(torch.rand(width, generator=generator) + 0.5)
            for dtype in (torch.float32, torch.bfloat16):
                module, data = probe.to(dtype), x.to(dtype)
                theirs = module(data).float()
                scale = max(1.0, float(theirs.abs().max()))
                for convention in _NORM_CONVENTIONS:
                    ours = PF.qk_norm_rope(data, data, module.weight, module.weight, None, no_turn, eps, convention)[0]
                    difference = (ours.float() - theirs).abs() / scale
                    diffs[convention].append(float(difference.max() if dtype == torch.float32 else difference.mean()))
    except Exception as error:  # noqa: BLE001 - a module that does not take [..., width] is not an RMSNorm
        raise _Unfused(f"{what} ({type(norm).__name__}) raised {type(error).__name__} on the probe") from None
    matching = [c for c in _NORM_CONVENTIONS if diffs[c][0] <= 1e-5]
    if not matching:
        raise _Unfused(f"{what} ({type(norm).__name__}) is not an RMSNorm of qk_norm_rope's conventions (float32 "
                       f"differences {', '.join(f'{c} {d[0]:.1e}' for c, d in diffs.items())})")
    return min(matching, key=lambda c: diffs[c][1]), eps


def _deferred_norm(self, hidden_states: Tensor) -> Tensor:
    """A fused layer's q_norm/k_norm: the input as it is; qk_norm_rope normalizes it in the rotation."""
    return hidden_states


def _qk_norm_attention_forward(self, *args, **kwargs):
    """The attention's own forward, with position_embeddings that carry this layer's q_norm and k_norm weights
    (``RotaryAngles.with_qk_norm``): its apply_rotary_pos_emb then normalizes and rotates q and k in one
    ``qk_norm_rope`` call, while its norm modules pass their input through."""
    index, eps, norm = self._posenc_qk_norm
    by_name = "position_embeddings" in kwargs
    pair = kwargs["position_embeddings"] if by_name else args[index] if len(args) > index else None
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], RotaryAngles)):
        return _forward_with_norms(self, args, kwargs)
    angles = pair[0].with_qk_norm(self.q_norm.weight, self.k_norm.weight, eps, norm)
    if by_name:
        kwargs = dict(kwargs, position_embeddings=(angles, angles))
    else:
        args = args[:index] + ((angles, angles),) + args[index + 1:]
    return type(self).forward(self, *args, **kwargs)


def _forward_with_norms(attention: torch.nn.Module, args: tuple, kwargs: dict):
    """A call that brings cos/sin tables (or no angles): the rotation cannot normalize, so the norm modules run
    as Hugging Face's for this call."""
    shadows = [(norm, norm.__dict__.pop("forward")) for norm in (attention.q_norm, attention.k_norm)]
    try:
        return type(attention).forward(attention, *args, **kwargs)
    finally:
        for norm, shadow in shadows:
            norm.forward = shadow


def _probe_angles(attention: torch.nn.Module, rotaries: List[RotaryPositions], device) -> RotaryAngles:
    """Angles of positions 0..7 from the patched rotary module of the attention's modeling file (its layer type
    where the rope parameters are per type), as the layer gets them."""
    modeling = type(attention).__module__
    mine = [r for r in rotaries if r.modeling == modeling]
    if not mine:
        raise _Unfused(f"no rotary module of {modeling} was patched")
    rotary = copy.deepcopy(mine[0])  # a dynamic NTK module keeps state
    by_type = ()
    if rotary.layer_types is not None:
        layer_type = getattr(attention, "layer_type", None)
        if layer_type not in rotary.layer_types:
            layer_types = getattr(getattr(attention, "config", None), "layer_types", None)
            index = getattr(attention, "layer_idx", None)
            layer_type = layer_types[index] if isinstance(index, int) and layer_types and index < len(layer_types) \
                else None
        by_type = (layer_type if layer_type in rotary.layer_types else rotary.layer_types[0],)
    positions = torch.arange(_ATTENTION_PROBE_TOKENS, device=device)[None]
    return rotary(torch.zeros(1, _ATTENTION_PROBE_TOKENS, 1, device=device), positions, *by_type)[0]


def _attention_output(attention: torch.nn.Module, angles: RotaryAngles, hidden: Tensor) -> Tensor:
    """The attention layer's output for one probe call (in eval mode: no dropout), without a mask or cache."""
    modes = [(module, module.training) for module in attention.modules()]
    attention.eval()
    try:
        with torch.no_grad():
            out = attention(hidden_states=hidden, position_embeddings=(angles, angles), attention_mask=None)
    finally:
        for module, training in modes:
            module.training = training
    return out[0] if isinstance(out, (tuple, list)) else out


def _fuse_qk_norm(model: torch.nn.Module, record: Patch, path: str, attention: torch.nn.Module,
                  rotaries: List[RotaryPositions], uses: Dict[int, int]) -> None:
    """Fuses one attention layer's q_norm and k_norm into its rotation, when a probe call of the layer gives the
    unfused output (to 1e-5 relative in float32, 1e-2 in 16-bit dtypes); raises _Unfused otherwise, with nothing
    left changed."""
    q_norm, k_norm = attention.q_norm, attention.k_norm
    if q_norm is k_norm or uses[id(q_norm)] != 1 or uses[id(k_norm)] != 1:
        raise _Unfused("its q_norm or k_norm module is used elsewhere too")
    parameters = [p for p in inspect.signature(type(attention).forward).parameters.values()][1:]
    names = [p.name for p in parameters]
    if "position_embeddings" not in names:
        raise _Unfused(f"{type(attention).__name__}.forward takes no position_embeddings")
    index = names.index("position_embeddings")
    q_convention, q_eps = _norm_convention("q_norm", q_norm)
    k_convention, k_eps = _norm_convention("k_norm", k_norm)
    if (q_convention, q_eps) != (k_convention, k_eps):
        raise _Unfused(f"q_norm ({q_convention}, eps={q_eps}) and k_norm ({k_convention}, eps={k_eps}) differ")
    parameter = q_norm.weight
    hidden_size = getattr(getattr(attention, "config", None), "hidden_size", None)
    projection = getattr(attention, "q_proj", None)
    if isinstance(projection, torch.nn.Linear):
        hidden_size = projection.in_features
    if not isinstance(hidden_size, int):
        raise _Unfused(f"no hidden size for a probe of {type(attention).__name__}")
    dtype = next((p.dtype for p in attention.parameters() if p.is_floating_point()), parameter.dtype)
    generator = torch.Generator().manual_seed(0)
    scales = torch.logspace(-1, 2, _ATTENTION_PROBE_TOKENS)[None, :, None]  # missing norms show on every scale
    hidden = (torch.randn(1, _ATTENTION_PROBE_TOKENS, hidden_size, generator=generator) * scales).to(
        parameter.device, dtype)
    try:
        angles = _probe_angles(attention, rotaries, parameter.device)
        expected = _attention_output(attention, angles, hidden)
    except _Unfused:
        raise
    except Exception as error:  # noqa: BLE001
        raise _Unfused(f"the probe call of {type(attention).__name__} raised {type(error).__name__}") from None
    scratch = Patch(record.model_type, record.family)
    what = f"q_norm and k_norm ({q_convention} convention, eps={q_eps}) applied by the rotation: one qk_norm_rope"
    _shadow_method(scratch, attention, path, "forward", _qk_norm_attention_forward, f"posenc: its {what}")
    attention._posenc_qk_norm = (index, q_eps, q_convention)
    scratch._undo.append(("attribute", path, "_posenc_qk_norm"))
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        _shadow_method(scratch, norm, f"{path}.{name}", "forward", _deferred_norm,
                       "the input unchanged: qk_norm_rope normalizes it in the rotation")
    try:
        fused = _attention_output(attention, angles, hidden)
        diff = _max_diff(fused, expected) / max(1.0, float(expected.abs().max()))
        why = f"the fused layer's probe output differs from the unfused one by {diff:.1e} (relative)"
    except Exception as error:  # noqa: BLE001
        diff, why = float("inf"), f"the fused layer's probe call raised {type(error).__name__}: {error}"
    if not diff <= (1e-5 if dtype in (torch.float32, torch.float64) else 1e-2):
        for _, owner, attribute in reversed(scratch._undo):
            model.get_submodule(owner).__dict__.pop(attribute, None)
        raise _Unfused(why.splitlines()[0])
    record.changes.extend(scratch.changes)
    record._undo.extend(scratch._undo)


def _fuse_qk_norms(model: torch.nn.Module, model_type: str) -> Tuple[Patch, set]:
    """Every attention layer with a q_norm and a k_norm (Qwen3, Gemma 3, OLMo 2, ...) gets them applied by its
    rotation, ``qk_norm_rope`` in one pass over q and k instead of two norms and a rotation, where the norms are
    RMSNorms of a convention the op has and a probe call of the layer gives what the unfused layer gives. The
    others keep their norm modules, and the notes say why. Returns (the changes, undo steps and notes; the
    modeling files with a fused layer)."""
    record = Patch(model_type, "rotary")
    rotaries = [module for module in model.modules() if isinstance(module, RotaryPositions)]
    uses: Dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        uses[id(module)] = uses.get(id(module), 0) + 1
    unfused: Dict[str, List[str]] = {}
    fused_files = set()
    for path, attention in list(model.named_modules()):
        if not all(isinstance(getattr(attention, name, None), torch.nn.Module) for name in ("q_norm", "k_norm")):
            continue
        try:
            _fuse_qk_norm(model, record, path, attention, rotaries, uses)
            fused_files.add(type(attention).__module__)
        except _Unfused as why:
            unfused.setdefault(str(why), []).append(path)
    for why, paths in unfused.items():
        record.notes.append(f"q_norm/k_norm of {', '.join(paths)} left to Hugging Face: {why}")
    return record, fused_files


# ---------------------------------------------------------------- DINOv3: rotary by patch centres

def _is_dinov3_rope(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "DINOv3ViTRopePositionEmbedding"


class PatchCenterAngles(_HoldsRotaryWrapper):
    """Takes the place of DINOv3's rotary module (``DINOv3ViTRopePositionEmbedding``): ``forward(pixel_values)``
    returns ``(angles, angles)``, :class:`RotaryAngles` of the patch centres
    (:func:`posenc.functional.patch_center_positions`, zeros for the cls and register tokens, DINOv3's training
    augmentations drawn in training as transformers draws them) and the axial frequencies times 2 pi, in float64,
    instead of cos/sin tables."""

    def __init__(self, original: torch.nn.Module, modeling: str):
        super().__init__()
        self.config = original.config
        self.modeling = modeling
        size = original.config.patch_size
        self.patch_size = (size, size) if isinstance(size, int) else tuple(size)
        self.num_prefix_tokens = 1 + int(getattr(original.config, "num_register_tokens", 0))
        inv_freq, pair_axis = frequencies.axial(original.head_dim, 2, float(original.base))
        # plain attributes, not buffers: model.to(torch.bfloat16) leaves the float64 frequencies exact
        self.inv_freq, self.pair_axis = inv_freq * (2 * math.pi), pair_axis
        self._hold_wrapper()

    def forward(self, pixel_values: Tensor) -> Tuple[RotaryAngles, RotaryAngles]:
        height, width = pixel_values.shape[-2] // self.patch_size[0], pixel_values.shape[-1] // self.patch_size[1]
        config = self.config
        augment = (config.pos_embed_shift, config.pos_embed_jitter, config.pos_embed_rescale) if self.training \
            else (None, None, None)
        device = pixel_values.device
        if self.inv_freq.device != device:
            self.inv_freq, self.pair_axis = self.inv_freq.to(device), self.pair_axis.to(device)
        positions = PF.patch_center_positions(height, width, self.num_prefix_tokens, *augment, device=device)
        angles = RotaryAngles(positions, self.inv_freq, 1.0, "neox", self.pair_axis)
        return angles, angles

    def extra_repr(self) -> str:
        return (f"patch_size={self.patch_size}, num_prefix_tokens={self.num_prefix_tokens}, "
                f"pairs={self.inv_freq.numel()}")


def _patch_dinov3(model: torch.nn.Module, model_type: str) -> Patch:
    record = Patch(model_type, "rotary (patch centres)")
    for name, original in _find(model, _is_dinov3_rope):
        modeling = type(original).__module__
        replacement = PatchCenterAngles(original, modeling)
        _swap_module(record, model, name, replacement, f"posenc PatchCenterAngles ({replacement.extra_repr()})")
        record.changes.append(Change("function", f"{modeling}.apply_rotary_pos_emb",
                                     "posenc: RotaryAngles -> rope_qk (prefix tokens at angle 0), cos/sin tables -> "
                                     "the original"))
    return record


# ---------------------------------------------------------------- learned position tables resized to the image grid

# F.interpolate settings a ViT-style interpolate_pos_encoding may use, tried in this order by the probe:
# (mode, align_corners, antialias).
_TABLE_MODES = (("bicubic", False, False), ("bicubic", False, True), ("bilinear", False, False),
                ("bilinear", False, True), ("bicubic", True, False), ("bilinear", True, False))
_TABLE_PROBE_RTOL = 1e-5


def _table_attribute(module: torch.nn.Module) -> Optional[str]:
    """Where a ViT-style embeddings module keeps its learned table: ``position_embeddings`` or
    ``position_embedding``, a tensor [1, R, D] or [R, D] (ViT, DINOv2, BEiT, ...) or an ``nn.Embedding`` (CLIP,
    SigLIP, ...)."""
    for attribute in ("position_embeddings", "position_embedding"):
        table = getattr(module, attribute, None)
        if isinstance(table, torch.nn.Embedding):
            return attribute
        if isinstance(table, Tensor) and (table.dim() == 2 or (table.dim() == 3 and table.shape[0] == 1)):
            return attribute
    return None


def _table_rows(module: torch.nn.Module, attribute: str) -> Tensor:
    """The table as rows [R, D], the parameter or a view of it (its gradient reaches the parameter)."""
    table = getattr(module, attribute)
    if isinstance(table, torch.nn.Embedding):
        return table.weight
    return table[0] if table.dim() == 3 else table


def _has_resized_table(module: torch.nn.Module) -> bool:
    method = getattr(type(module), "interpolate_pos_encoding", None)
    if not callable(method) or _table_attribute(module) is None:
        return False
    parameters = list(inspect.signature(method).parameters)
    return parameters[1:4] == ["embeddings", "height", "width"]


def _pair(value: Any) -> Optional[Tuple[int, int]]:
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def _module_pairs(module: torch.nn.Module, name: str) -> List[Tuple[int, int]]:
    """The values of ``name`` on the module, its ``patch_embeddings`` and its ``config``, as (height, width)."""
    owners = (module, getattr(module, "patch_embeddings", None), getattr(module, "config", None))
    pairs = [_pair(getattr(owner, name, None)) for owner in owners if owner is not None]
    return list(dict.fromkeys(pair for pair in pairs if pair is not None))


@dataclass(frozen=True)
class _TableSpec:
    """What the probe found about one embeddings module's table and how Hugging Face resizes it."""

    attribute: str
    num_prefix_tokens: int
    source_grid: Tuple[int, int]
    patch_size: Tuple[int, int]
    mode: str
    align_corners: bool
    antialias: bool
    image_size: Optional[Tuple[int, int]]  # where interpolate_pos_encoding=False adds the table as it is
    flag: Optional[Tuple[int, str, bool]]  # forward's interpolate_pos_encoding: (position, name, default)
    pixel_values: Tuple[int, str]  # forward's first argument

    def describe(self) -> str:
        options = f"mode={self.mode}" + (", align_corners=True" if self.align_corners else "") + (
            ", antialias=True" if self.antialias else "")
        return (f"{self.attribute} ({self.num_prefix_tokens} prefix rows, grid {self.source_grid[0]}x"
                f"{self.source_grid[1]}, patch {self.patch_size[0]}x{self.patch_size[1]}, {options})")


class ResampledTable:
    """What a patched ``interpolate_pos_encoding`` returns inside its embeddings' forward, in place of the table
    resized to the image's patch grid: the table, its grid and the image's. The embeddings' own
    ``embeddings + position_embeddings`` becomes one ``posenc.add_resampled_learned`` call, the resize and the
    add in one pass; any other use of it raises ``TypeError``."""

    def __init__(self, weight: Tensor, spec: _TableSpec, grid: Tuple[Any, Any]):
        self.weight, self.spec, self.grid = weight, spec, grid

    def _arguments(self) -> tuple:
        spec = self.spec
        return (self.weight, spec.source_grid, self.grid, spec.mode, spec.align_corners, spec.antialias, None,
                spec.num_prefix_tokens)

    def add_to(self, x: Tensor) -> Tensor:
        return PF.add_resampled_learned(x, *self._arguments())

    def rows(self) -> Tensor:
        """The resized table [P + H * W, D] (``posenc.resample_learned``)."""
        return PF.resample_learned(*self._arguments())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.add) and len(args) == 2 \
                and not kwargs:
            table, x = (args[0], args[1]) if isinstance(args[0], cls) else (args[1], args[0])
            if isinstance(x, Tensor) and isinstance(table, cls):
                return table.add_to(x)
        raise TypeError(f"{_NAME}: the resized position table of a patched embeddings module is added by "
                        f"posenc.add_resampled_learned; only adding it to a tensor is supported, got "
                        f"{getattr(func, '__name__', func)}")


def _table_interpolate(self, spec: _TableSpec, embeddings: Tensor, height: int, width: int) -> Any:
    """``interpolate_pos_encoding(embeddings, height, width)``: inside the embeddings' forward, a
    :class:`ResampledTable` that their ``embeddings + ...`` adds with one ``add_resampled_learned``; called from
    elsewhere, the resized table itself, [1, P + H * W, D] as Hugging Face returns it."""
    grid = (height // spec.patch_size[0], width // spec.patch_size[1])
    table = ResampledTable(_table_rows(self, spec.attribute), spec, grid)
    if self.__dict__.get("_posenc_adding"):
        return table
    return table.rows().unsqueeze(0)


def _table_forward(self, spec: _TableSpec, *args, **kwargs):
    """The embeddings' own forward, whose ``embeddings + self.interpolate_pos_encoding(...)`` becomes one
    ``add_resampled_learned`` call. ``interpolate_pos_encoding=False`` with an image of the configured size becomes
    True: both add the table as it is (the resize to the same grid is the identity, bit for bit). At any other size
    Hugging Face's False path runs as it is (it raises, or adds the table unresized where the token count allows)."""
    if spec.flag is not None:
        position, name, default = spec.flag
        if name in kwargs:
            flag = kwargs[name]
        else:
            flag = args[position] if len(args) > position else default
        index, pixel_name = spec.pixel_values
        pixels = args[index] if len(args) > index else kwargs.get(pixel_name)
        if not flag and isinstance(pixels, Tensor) and tuple(pixels.shape[-2:]) == spec.image_size:
            if len(args) > position:
                args = args[:position] + (True,) + args[position + 1:]
            else:
                kwargs = {**kwargs, name: True}
    self._posenc_adding = True
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:  # also when the call raised before the add
        self._posenc_adding = False


def _table_methods(spec: _TableSpec, calls: Optional[list] = None) -> Tuple[Callable, Callable]:
    """The two methods a recognized embeddings module gets, bound to its probe's findings (``calls`` counts the
    probe's calls of interpolate_pos_encoding)."""

    def interpolate_pos_encoding(self, embeddings: Tensor, height: int, width: int) -> Any:
        if calls is not None:
            calls.append(1)
        return _table_interpolate(self, spec, embeddings, height, width)

    def forward(self, *args, **kwargs):
        return _table_forward(self, spec, *args, **kwargs)

    return interpolate_pos_encoding, forward


class _TableRefused(Exception):
    pass


def _table_probe_grids(side: int) -> List[Tuple[int, int]]:
    # non-square, larger on one axis and smaller on the other (antialias shows when shrinking)
    return [(side + 2, max(side - 1, 1)), (max(side // 2, 1), side + 1)]


def _table_probe_diff(rows: Tensor, spec: _TableSpec, grid: Tuple[int, int], expected: Tensor) -> float:
    try:
        with torch.no_grad():
            return _max_diff(ResampledTable(rows, spec, grid).rows(), expected)
    except RuntimeError:  # a setting the op refuses (antialias with aligned corners, ...) is not the one
        return math.inf


def _probe_table(name: str, module: torch.nn.Module) -> _TableSpec:
    """Runs the module's own ``interpolate_pos_encoding`` on a float32 copy with a random table and finds the
    ``resample_learned`` call that gives its result (prefix rows, square source grid, patch size, interpolation),
    then checks that the patched forward gives the unpatched one's output."""
    attribute = _table_attribute(module)
    probe = copy.deepcopy(module).float().eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        table = _table_rows(probe, attribute)
        table.copy_(torch.randn(table.shape, generator=generator).to(table.device))
    rows = _table_rows(probe, attribute).detach()
    total, dim = rows.shape
    patch_sizes = _module_pairs(module, "patch_size")
    if not patch_sizes:
        raise _TableRefused(f"{name} ({type(module).__name__}) has no patch_size")
    # the grid before the probe tells the prefix rows: the first split into a few rows and a square (Hugging Face
    # reads the table the same way); the probe grids only need to differ from the table's
    guesses = [(prefix, math.isqrt(total - prefix)) for prefix in range(min(total, 9))]
    guesses = [(prefix, side) for prefix, side in guesses if side > 1 and side * side == total - prefix]
    if not guesses:
        raise _TableRefused(f"{name}.{attribute}: {total} rows are not a few prefix rows and a square grid")
    guess_prefix, guess_side = guesses[0]
    found = None
    for patch in patch_sizes:
        outputs = {}
        try:
            for grid in _table_probe_grids(guess_side):
                height, width = grid[0] * patch[0] + patch[0] - 1, grid[1] * patch[1] + patch[1] - 1
                embeddings = torch.zeros(1, guess_prefix + grid[0] * grid[1], dim, device=rows.device)
                with torch.no_grad():
                    out = probe.interpolate_pos_encoding(embeddings, height, width)
                outputs[grid] = out.reshape(-1, out.shape[-1]) if isinstance(out, Tensor) else None
        except Exception as error:  # noqa: BLE001 - any failure of the original is a refusal reason
            raise _TableRefused(f"{name}.interpolate_pos_encoding raised {type(error).__name__}: {error}") from None
        if any(out is None or out.shape[-1] != dim for out in outputs.values()):
            raise _TableRefused(f"{name}.interpolate_pos_encoding does not return a table [.., rows, {dim}]")
        grid = next(iter(outputs))
        prefix = outputs[grid].shape[0] - grid[0] * grid[1]
        side = math.isqrt(max(total - prefix, 0))
        if prefix < 0 or side * side != total - prefix:
            continue
        scale = 1.0 + float(rows.abs().max())
        for mode, align_corners, antialias in _TABLE_MODES:
            spec = _TableSpec(attribute, prefix, (side, side), patch, mode, align_corners, antialias, None, None,
                              (0, "pixel_values"))
            if all(out.shape[0] == prefix + g[0] * g[1] and _table_probe_diff(rows, spec, g, out) <= _TABLE_PROBE_RTOL
                   * scale for g, out in outputs.items()):
                found = spec
                break
        if found is not None:
            break
    if found is None:
        raise _TableRefused(f"{name}.interpolate_pos_encoding differs from resample_learned in every mode "
                            f"(bicubic and bilinear, aligned corners or not, antialias or not), patch size "
                            f"{' or '.join(f'{p[0]}x{p[1]}' for p in patch_sizes)}")
    return _check_table_forward(name, module, probe, found)


def _tensors_of(output: Any) -> List[Tensor]:
    """The tensors a forward returns: itself, or those of a tuple (Swin returns the grid's size beside them)."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    return [item.float() for item in items if isinstance(item, Tensor) and item.is_floating_point()]


def _check_table_forward(name: str, module: torch.nn.Module, probe: torch.nn.Module, spec: _TableSpec) -> _TableSpec:
    """Reads forward's arguments, then runs the probe copy's forward unpatched and patched (through
    :class:`ResampledTable`) on random pixels at the configured image size and at a non-square one."""
    signature = inspect.signature(type(module).forward)
    parameters = list(signature.parameters.values())[1:]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        raise _TableRefused(f"{name}.forward takes no pixel values")
    pixel_values = (0, positional[0].name)
    flag = None
    for position, parameter in enumerate(positional):
        if parameter.name == "interpolate_pos_encoding":
            flag = (position, parameter.name, bool(parameter.default) if parameter.default is not
                    inspect.Parameter.empty else False)
    image_sizes = _module_pairs(module, "image_size")
    image_size = image_sizes[0] if image_sizes else None
    spec = dataclasses.replace(spec, image_size=image_size if flag is not None else None, flag=flag,
                               pixel_values=pixel_values)
    channels = [c for c in (getattr(getattr(module, "config", None), "num_channels", None),
                            getattr(getattr(module, "patch_embeddings", None), "num_channels", None))
                if isinstance(c, int)]
    side = spec.source_grid[0]
    # the configured size (interpolate_pos_encoding False and True), then resized grids: the first that Hugging
    # Face's own forward takes must give its output patched (windowed models take some grids only)
    sizes = [((side + 2) * spec.patch_size[0], max(side - 1, 1) * spec.patch_size[1]),
             (2 * side * spec.patch_size[0], 2 * side * spec.patch_size[1]),
             (max(side // 2, 1) * spec.patch_size[0], max(side // 2, 1) * spec.patch_size[1])]
    calls = []
    patched = copy.deepcopy(probe)
    interpolate, forward = _table_methods(spec, calls)
    patched.interpolate_pos_encoding = types.MethodType(interpolate, patched)
    patched.forward = types.MethodType(forward, patched)
    generator = torch.Generator().manual_seed(1)
    device = _table_rows(probe, spec.attribute).device

    def compare(height: int, width: int, options: Dict[str, bool]) -> bool:
        pixels = torch.randn(1, channels[0] if channels else 3, height, width, generator=generator).to(device)
        try:
            with torch.no_grad():
                expected = probe(pixels, **options)
        except Exception:  # noqa: BLE001 - Hugging Face does not take this size
            return False
        del calls[:]
        try:
            with torch.no_grad():
                actual = patched(pixels, **options)
        except Exception as error:  # noqa: BLE001
            raise _TableRefused(f"{name}.forward uses the resized table other than adding it to the embeddings: "
                                f"patched, on pixels [1, C, {height}, {width}], it raised {type(error).__name__}: "
                                f"{error}") from None
        expected, actual = _tensors_of(expected), _tensors_of(actual)
        if not expected or len(actual) != len(expected):
            raise _TableRefused(f"{name}.forward returns no tensor")
        if not calls:
            raise _TableRefused(f"{name}.forward does not call interpolate_pos_encoding")
        if any(a.shape != e.shape for a, e in zip(actual, expected)):
            raise _TableRefused(f"{name}.forward patched gives other shapes than Hugging Face's")
        diff = max(_max_diff(a, e) for a, e in zip(actual, expected))
        expected = expected[0]
        if diff > _TABLE_PROBE_RTOL * (1.0 + float(expected.abs().max())):
            raise _TableRefused(f"{name}.forward patched differs from Hugging Face's by {diff:.2e} on pixels "
                                f"[1, C, {height}, {width}]")
        return True

    resize = {flag[1]: True} if flag is not None else {}
    if image_size is not None:
        for options in ([{flag[1]: False}, {flag[1]: True}] if flag is not None else [{}]):
            if not compare(*image_size, options):
                raise _TableRefused(f"{name}.forward does not take pixels of its image size "
                                    f"{image_size[0]}x{image_size[1]}")
    if not any(compare(height, width, resize) for height, width in sizes):
        raise _TableRefused(f"{name}.forward takes pixels [1, C, H, W] of no size tried: "
                            f"{', '.join(f'{h}x{w}' for h, w in sizes)}")
    return spec


def recognize_resized_tables(model: torch.nn.Module) -> Tuple[List[Tuple[str, torch.nn.Module, Any]], List[str]]:
    """The ViT-style embeddings modules of a model, found by probing: ``(recognized, refused)``, where recognized
    holds ``(path, module, spec)`` and refused the reason for each other candidate.

    A candidate has an ``interpolate_pos_encoding(embeddings, height, width)`` method and a learned table
    (``position_embeddings`` [1, R, D] or ``position_embedding``, an ``nn.Embedding``). It is recognized when,
    on a float32 copy with a random table, that method gives for two non-square grids what
    ``posenc.resample_learned`` gives for one setting of F.interpolate (bicubic or bilinear, aligned corners or
    not, antialias or not), the table being a few prefix rows and a square grid, and the module's forward,
    patched, gives its unpatched output at the configured image size and at a non-square one."""
    recognized, refused = [], []
    for name, module in _find(model, _has_resized_table):
        try:
            recognized.append((name, module, _probe_table(name or "model", module)))
        except _TableRefused as reason:
            refused.append(str(reason))
    return recognized, refused


def _patch_resized_tables(model: torch.nn.Module, model_type: str) -> Patch:
    recognized, refused = recognize_resized_tables(model)
    if not recognized:
        raise NotRecognized(model_type, "resized learned table", "; ".join(refused))
    record = Patch(model_type, "learned (resized to the image grid)")
    for name, module, spec in recognized:
        interpolate, forward = _table_methods(spec)
        _shadow_method(record, module, name, "interpolate_pos_encoding", interpolate,
                       f"posenc ResampledTable of {spec.describe()}")
        _shadow_method(record, module, name, "forward", forward,
                       "the embeddings' forward, its table added by one posenc.add_resampled_learned"
                       + (" (interpolate_pos_encoding=False at the image size "
                          f"{spec.image_size[0]}x{spec.image_size[1]} included)" if spec.image_size else ""))
        record._undo.append(("attribute", name, "_posenc_adding"))
    record.notes.extend(f"left to Hugging Face: {reason}" for reason in refused)
    return record


# ---------------------------------------------------------------- BLOOM: ALiBi

def _bloom_alibi(self, attention_mask: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
    """BLOOM's bias rows ``[B * H, 1, K]``, added inside ``baddbmm``: slope m times p_j, the number of real tokens
    before key j (0 on padding), which ``posenc.positions_from_mask`` gives.

    Each key has its own position, so padding anywhere in the mask (left, right, or between real tokens) gives
    BLOOM's bias. A bias that depends on the column alone (``alibi_bias``) would equal it after softmax for left
    or right padding only.
    """
    batch, k_len = attention_mask.shape
    slopes = PF.alibi_slopes(num_heads, device=attention_mask.device)
    positions = PF.positions_from_mask(attention_mask)
    return (slopes[:, None] * positions[:, None, :]).reshape(batch * num_heads, 1, k_len).to(dtype)


def _cache_of(arguments: Dict[str, Any]) -> Any:
    # transformers 5.x renames past_key_values to cache inside forward; a caller may still use either name.
    return arguments.get("cache", arguments.get("past_key_values"))


def _bloom_forward(self, *args, **kwargs):
    """BLOOM builds its bias inline when no attention mask is given; an all-ones mask (what "no mask" means)
    sends that call through build_alibi_tensor too."""
    arguments = _class_forward(self, args, kwargs)
    embeddings = arguments.get("inputs_embeds")
    tokens = arguments.get("input_ids") if embeddings is None else embeddings[..., 0]
    if arguments.get("attention_mask") is None and tokens is not None:
        batch, seq = tokens.shape[:2]
        cache = _cache_of(arguments)
        k_len = cache.get_mask_sizes(seq, 0)[0] if cache is not None else seq
        arguments["attention_mask"] = torch.ones(batch, k_len, dtype=torch.long, device=tokens.device)
    return type(self).forward(self, **arguments)


def _patch_bloom(model: torch.nn.Module) -> Patch:
    record = Patch("bloom", "alibi")
    for name, bloom in _find(model, lambda m: type(m).__name__ == "BloomModel"):
        _shadow_method(record, bloom, name, "build_alibi_tensor", _bloom_alibi,
                       "posenc.alibi_slopes times posenc.positions_from_mask (one row per head)")
        _shadow_method(record, bloom, name, "forward", _bloom_forward,
                       "BloomModel.forward with an all-ones attention mask when none is given")
    return record


# ---------------------------------------------------------------- T5: relative bias

def _t5_compute_bias(self, query_length: int, key_length: int, device=None, past_seen_tokens=0) -> Tensor:
    """``posenc.t5_bias`` of this layer's bucket table: [1, H, query_length, key_length], queries from
    past_seen_tokens on (decoder with a cache).

    The lengths reach the op as they come: under torch.compile they are symbolic sizes, which ``int()`` would
    pin to one value (a recompilation per decoding step). A static cache gives past_seen_tokens as a tensor;
    reading it as a number (``.item()``) fails torch.export and breaks the graph, so the query positions are
    computed from the tensor and bucketed by ``posenc.relative_position_bucket``, as Hugging Face does.
    """
    table = self.relative_attention_bias
    if isinstance(past_seen_tokens, Tensor):
        queries = torch.arange(query_length, device=past_seen_tokens.device) + past_seen_tokens
        relative = torch.arange(key_length, device=queries.device) - queries[:, None]
        buckets = PF.relative_position_bucket(relative, not self.is_decoder, self.relative_attention_num_buckets,
                                              self.relative_attention_max_distance)
        return table(buckets.to(table.weight.device)).permute(2, 0, 1).unsqueeze(0)
    return PF.t5_bias(table.weight, query_length, key_length, not self.is_decoder,
                      self.relative_attention_num_buckets, self.relative_attention_max_distance, past_seen_tokens)


def _patch_t5(model: torch.nn.Module) -> Patch:
    record = Patch("t5", "relative bias")
    for name, attention in _find(model, lambda m: getattr(m, "has_relative_attention_bias", False)):
        _shadow_method(record, attention, name, "compute_bias", _t5_compute_bias, "posenc.t5_bias")
    return record


# ---------------------------------------------------------------- GPT-2: fused token + position embeddings

class _AlreadyInEmbeddings:
    """What a patched ``wpe`` returns when the token embeddings passed to GPT-2 already hold the position rows
    (``embed_learned``): GPT-2 adds it to them (``inputs_embeds + position_embeds.to(device)``), and the sum
    is the embeddings themselves, with no pass over memory."""

    def to(self, *args, **kwargs) -> "_AlreadyInEmbeddings":
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.add) and len(args) == 2 \
                and not kwargs:
            return args[1] if isinstance(args[0], cls) else args[0]
        raise TypeError(f"{_NAME}: the position embeddings of a patched GPT-2 are already inside its token "
                        f"embeddings; only adding them is supported, got {getattr(func, '__name__', func)}")


def _gpt2_wte_forward(self, input_ids: Tensor) -> Tensor:
    pending = self.__dict__.get("_posenc_pending")
    if pending is None:
        return torch.nn.Embedding.forward(self, input_ids)
    self._posenc_pending = None  # the token ids of this call only: token_type_ids come through wte too
    wpe, positions = pending
    wpe._posenc_positions_added = True
    return PF.embed_learned(input_ids, self.weight, wpe.weight, positions)


def _gpt2_wpe_forward(self, position_ids: Tensor):
    if self.__dict__.get("_posenc_positions_added"):
        self._posenc_positions_added = False  # one call
        return _AlreadyInEmbeddings()
    return torch.nn.Embedding.forward(self, position_ids)


def _gpt2_forward(self, *args, **kwargs):
    """GPT2Model.forward, where GPT-2's ``wte(input_ids)`` returns ``embed_learned(input_ids, wte, wpe, positions)``
    for this call and ``wpe`` then a marker that GPT-2's ``inputs_embeds + position_embeds`` leaves out. The rest
    is GPT-2's code, so input_ids of any shape ([S], [B, S], [B, choices, S]) give its output shapes. Calls with
    ``inputs_embeds`` run as they are."""
    arguments = _class_forward(self, args, kwargs)
    tokens, position_ids = arguments.get("input_ids"), arguments.get("position_ids")
    if tokens is None or arguments.get("inputs_embeds") is not None:
        return type(self).forward(self, **arguments)
    seq = tokens.size(-1)  # wte sees the ids as GPT-2 flattens them: [-1, seq]
    if position_ids is not None:
        positions = position_ids.reshape(-1, seq)
        positions = positions[0] if positions.size(0) == 1 else positions
    else:
        # GPT-2's numbering, cache length + arange(S). The length is added as it comes (a tensor for a static
        # cache, a symbolic size under torch.compile): reading it as a number would fail torch.export and
        # recompile at every decoding step.
        cache = _cache_of(arguments)
        positions = None if cache is None else torch.arange(seq, device=tokens.device) + cache.get_seq_length()
    self.wte._posenc_pending = (self.wpe, positions)
    try:
        return type(self).forward(self, **arguments)
    finally:  # also when the call raised before reaching wte or wpe
        self.wte._posenc_pending = None
        self.wpe._posenc_positions_added = False


def _patch_gpt2(model: torch.nn.Module) -> Patch:
    record = Patch("gpt2", "learned")
    for name, gpt2 in _find(model, lambda m: type(m).__name__ == "GPT2Model"):
        wte, wpe = (f"{name}.wte", f"{name}.wpe") if name else ("wte", "wpe")
        _shadow_method(record, gpt2.wte, wte, "forward", _gpt2_wte_forward,
                       "posenc.embed_learned(input_ids, wte, wpe, positions) for GPT2Model's token ids")
        record._undo.append(("attribute", wte, "_posenc_pending"))
        _shadow_method(record, gpt2.wpe, wpe, "forward", _gpt2_wpe_forward,
                       "nothing to add while the token embeddings already hold the positions")
        record._undo.append(("attribute", wpe, "_posenc_positions_added"))
        _shadow_method(record, gpt2, name, "forward", _gpt2_forward,
                       "GPT2Model.forward with its positions handed to the fused wte")
    return record
