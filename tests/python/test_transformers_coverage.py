"""Coverage of posenc.integrations.transformers.patch over every rotary model type of the installed transformers.

Discovery: every ``transformers/models/*/modeling_*.py`` that defines ``def apply_rotary_pos_emb``. Each is built
from a tiny config (its config class, or the ``text_config`` class of a composite one, with hidden size 64, 2
layers, 4 heads, vocabulary 128; nothing downloaded), fitted to the kind of config by general rules
(``_tiny_kwargs``: MLA head dims, per-layer lists, one layer of each layer type, M-RoPE sections scaled to the
tiny head, tiny sub-configs; ``RETRIES`` for the configs' own architecture rules), with the modeling file's own
class for a text config the auto mappings do not list, and run on one random batch with an attention mask (one
row left-padded), unpatched and then patched. Every type ``patch`` accepts must give the unpatched fp32 logits
(or last hidden state, for a model without a causal LM head) to 1e-5 at the real positions; a type it refuses is
recorded with its reason, a type that cannot be built or run generically with that reason.

``python tests/python/test_transformers_coverage.py`` prints the table that docs/integrations-transformers.md holds.
"""
import functools
import glob
import importlib
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import pytest
import torch

import posenc  # noqa: F401

transformers = pytest.importorskip("transformers")
PT = pytest.importorskip("posenc.integrations.transformers")
from transformers.models.auto import configuration_auto, modeling_auto  # noqa: E402

VOCAB = 128
ATOL = 1e-5
MAX_PARAMETERS = 6_000_000  # a "tiny" config that still builds more than this is skipped, with the count
PATCHED_FLOOR = 120  # measured: 137 patched (17 M-RoPE, 8 MLA files with interleaved pairs), equal, rope_qk
# doing the rotation, with transformers 5.24.0; the floor is the goal
TIME_LIMIT_S = 100.0  # the whole sweep, imports of ~190 modeling files included: measured 17 s on 2 cores

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
            top_k_experts=2, tie_word_embeddings=False, rotary_dim=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, kv_lora_rank=16, q_lora_rank=32,
            vocab_size_per_layer_input=VOCAB,  # Gemma 4's per-layer embeddings
            n_group=1, topk_group=1,  # group-limited routing (DeepSeek V3 style): one group of the 4 experts
            mamba_d_state=16, mamba_n_heads=8, mamba_chunk_size=16)  # the Mamba layers of hybrids, tiny too


@dataclass
class Row:
    directory: str  # transformers/models/<directory>
    model_type: str  # the config's model_type that was built ("" when none)
    model_class: str
    status: str  # "patched", "refused" or "skipped"
    detail: str  # what was replaced (patched), or why not
    category: str = ""  # refused: NotRecognized.category; skipped: a short phrase
    diff: Optional[float] = None
    rotations: int = 0  # RotaryAngles.rotate / rotate_one calls (one rope_qk or rope each) in the patched forward
    seconds: float = 0.0


def discover() -> List[str]:
    """The model directories whose modeling file defines apply_rotary_pos_emb."""
    root = os.path.dirname(transformers.__file__)
    found = []
    for path in sorted(glob.glob(os.path.join(root, "models", "*", "modeling_*.py"))):
        with open(path, encoding="utf-8") as source:
            if re.search(r"^def apply_rotary_pos_emb\(", source.read(), re.MULTILINE):
                found.append(os.path.basename(os.path.dirname(path)))
    return sorted(dict.fromkeys(found))


class Skip(Exception):
    def __init__(self, category: str, detail: str):
        super().__init__(detail)
        self.category, self.detail = category, detail


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:140] if text else ''}"


def _model_type_of(directory: str) -> str:
    if directory in configuration_auto.CONFIG_MAPPING_NAMES:
        return directory
    types = [t for t in configuration_auto.CONFIG_MAPPING_NAMES
             if configuration_auto.model_type_to_module_name(t) == directory]
    if not types:
        raise Skip("no config", f"no model type maps to transformers/models/{directory}")
    return types[0]


def _defaults(config_class) -> Optional[object]:
    """The config class's default instance (its full-size values), or None where even that does not build."""
    try:
        return config_class()
    except Exception:  # noqa: BLE001 - then no rule below reads defaults
        return None


def _get(config, name: str):
    """config.<name>, or None where it has none or refuses the read (heterogeneous per-layer configs)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001
        return None


def _scaled(sections: List[int], total: int) -> List[int]:
    """Sections in the proportions of ``sections`` that sum to ``total`` (each at least 1)."""
    scaled = [max(1, round(s * total / sum(sections))) for s in sections]
    scaled[-1] = total - sum(scaled[:-1])
    return scaled


# Per model type, where no rule can derive a value: each default config lists no layer kinds of its own (its
# checkpoints do), so the tiny model would hold no attention layer (Bamba) or could not be built (LFM2-MoE,
# DeepSeek-OCR 2's text model).
OVERRIDES = {
    "bamba": dict(attn_layer_indices=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse"]),
}


def _mrope_sections(config_class, rope: dict) -> Optional[List[int]]:
    """The default M-RoPE sections of a config, None where it is not for M-RoPE: the mrope_section of its default
    rope parameters, else the default its modeling file's rotary module reads (PaddleOCR-VL, ERNIE 4.5 VL), else
    Qwen2-VL's [16, 24, 24] where its rope validation ignores mrope_section."""
    if "mrope_section" in rope:
        return list(rope["mrope_section"])
    path = sys.modules[config_class.__module__].__file__.replace("configuration_", "modeling_")
    try:
        with open(path, encoding="utf-8") as source:
            found = re.search(r'get\("mrope_section", \[([0-9, ]+)\]\)', source.read())
    except OSError:
        found = None
    if found:
        return [int(n) for n in found.group(1).split(",")]
    if "mrope_section" in (getattr(config_class, "ignore_keys_at_rope_validation", None) or ()):
        return [16, 24, 24]
    return None


def _settable(config_class, kwargs: dict) -> dict:
    """kwargs without the keys the class holds as read-only properties (derived values: Falcon's head_dim, the
    layer types of hybrid models)."""
    return {k: v for k, v in kwargs.items() if not isinstance(getattr(config_class, k, None), property)}


def _tiny_kwargs(config_class, depth: int = 0) -> dict:
    """TINY, fitted to one config class by rules that each apply to a kind of config (not to a model type):

    - a key the class holds as a read-only property (Falcon's head_dim, derived) is not passed;
    - a size the default holds as a list gets TINY's size once per layer where the list has one entry per layer
      (Gemma 3n's intermediate sizes), else once per entry (ERNIE 4.5 VL's moe_intermediate_size per modality);
    - MLA configs (``qk_rope_head_dim``): head_dim in the default's ratio to the rope head dim (their rotary
      modules rotate head_dim times a partial factor channels), and one key/value head per query head;
    - lists of layer kinds (``layer_types``, ``mlp_layer_types``): each kind of the default once, in order of first
      appearance (at least TINY's 2 layers), so that a hybrid keeps an attention layer and the validators see
      matching lengths; counts of layers of one kind (``num_kv_shared_layers``) that the tiny model cannot hold: 0;
    - M-RoPE (``_mrope_sections``): the default sections in their proportions, summing to the tiny number of
      frequencies; rope parameters per layer type of which the default holds none: the default rotary per kind;
    - sub-configs of a composite config (vision, audio, ...): built tiny the same way (two levels deep), so that
      the model is tiny as a whole.
    """
    kwargs = dict(TINY)
    defaults = _defaults(config_class)
    if defaults is None:
        return _settable(config_class, kwargs)
    layers = _get(defaults, "num_hidden_layers")
    # Lists of layer kinds, one entry per layer (attention kinds, dense or sparse MLPs): each kind of the default
    # once, in order of first appearance, all lists and the layer count of one length (at least TINY's).
    kind_lists = {key: value for key, value in vars(defaults).items() if key.endswith("layer_types") and
                  isinstance(value, (list, tuple)) and value and all(isinstance(t, str) for t in value)}
    kinds = {key: list(dict.fromkeys(value)) for key, value in kind_lists.items()}
    count = max([TINY["num_hidden_layers"]] + [len(k) for k in kinds.values()])
    for key, kind in kinds.items():
        kwargs[key] = (kind * count)[:count]
    kwargs["num_hidden_layers"] = count
    for key in list(TINY):
        value = _get(defaults, key)
        if isinstance(value, (list, tuple)) and value and isinstance(kwargs[key], int):
            # one per layer (Gemma 3n's intermediate sizes) or one per entry of the default
            kwargs[key] = [kwargs[key]] * (count if len(value) == layers else len(value))
    for key, value in vars(defaults).items():  # layers of one kind among the default's (Gemma 3n's 15 KV-sharing
        # layers of 35) that the tiny model cannot hold: none
        if key.startswith("num_") and key.endswith("_layers") and key != "num_hidden_layers" and \
                isinstance(value, int) and not isinstance(value, bool) and isinstance(layers, int) and \
                count <= value < layers:
            kwargs[key] = 0
    rope_head_dim = _get(defaults, "qk_rope_head_dim")
    if rope_head_dim is not None:  # MLA: its rotary module rotates head_dim (times a partial factor) channels
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"] * (_get(defaults, "head_dim") or rope_head_dim) // rope_head_dim
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # one key/value per query head
    rope = _get(defaults, "rope_parameters")
    sections = _mrope_sections(config_class, rope) if isinstance(rope, dict) and (
        "rope_type" in rope or "rope_theta" in rope) else None
    if sections:
        partial = rope.get("partial_rotary_factor", _get(defaults, "partial_rotary_factor")) or 1.0
        frequencies = int(kwargs["head_dim"] * partial) // 2
        if frequencies >= len(sections):
            kwargs["rope_parameters"] = {**rope, "mrope_section": _scaled(sections, frequencies)}
    if isinstance(rope, dict) and not rope and kwargs.get("layer_types"):  # rope parameters per layer type, none
        # in the default (Cohere Compass): the default rotary for each layer kind
        kwargs["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                     for kind in dict.fromkeys(kwargs["layer_types"])}
    kwargs.update(OVERRIDES.get(getattr(config_class, "model_type", ""), {}))
    kwargs = _settable(config_class, kwargs)
    if depth < 2:
        for key, sub in (getattr(config_class, "sub_configs", None) or {}).items():
            if isinstance(sub, type) and sub is not transformers.AutoConfig and key != "text_config":
                try:
                    kwargs[key] = sub(**_tiny_kwargs(sub, depth + 1))
                except Exception:  # noqa: BLE001 - that sub-config keeps its own sizes
                    pass
    return kwargs


# Tiny configs tried in turn until one builds and runs unpatched (the first one's failure is the reason recorded
# when none does): the fitted values; then each of these on its own, then all together: the configs' own
# architecture rules ("no grouped-query attention": ESMC, dots3; "one expert per token": ZAYA) and a window for
# models that build a sliding-window mask whatever their layer types (Step 3.5); last, the fitted values without
# the tiny layer kinds (the config derives them: hybrids whose layer kinds need more than their names).
RETRIES = (dict(num_key_value_heads=TINY["num_attention_heads"]), dict(num_experts_per_tok=1), dict(sliding_window=8))


def _candidates(config_class):
    kwargs = _tiny_kwargs(config_class)
    yield kwargs
    for retry in RETRIES:
        yield {**kwargs, **retry}
    yield functools.reduce(lambda a, b: {**a, **b}, RETRIES, kwargs)
    if any(key.endswith("layer_types") for key in kwargs):
        yield {k: v for k, v in kwargs.items() if not k.endswith("layer_types")} | \
            {"num_hidden_layers": TINY["num_hidden_layers"]}


def _build(config_class, kwargs: dict) -> torch.nn.Module:
    """The tiny model of one set of config values, run once unpatched; raises Skip with the reason otherwise."""
    try:
        config = config_class(**kwargs)
    except Exception as error:  # noqa: BLE001 - recorded as the reason
        raise Skip("tiny config", f"{config_class.__name__}(tiny values) raised {_first_line(error)}") from None
    model_class = _model_class(config)
    if model_class is None:
        raise Skip("no model class", f"{config_class.__name__} has no causal LM or base model class")
    try:
        with torch.device("meta"):
            parameters = sum(p.numel() for p in model_class(config).parameters())
    except Exception as error:  # noqa: BLE001
        raise Skip("build", f"{model_class.__name__}(tiny config) raised {_first_line(error)}") from None
    if parameters > MAX_PARAMETERS:
        raise Skip("not tiny", f"{model_class.__name__} has {parameters / 1e6:.1f}M parameters with the tiny values "
                   f"(sizes of its own that the tiny values do not reach)")
    torch.manual_seed(0)
    try:
        model = model_class(config).eval()
    except Exception as error:  # noqa: BLE001
        raise Skip("build", f"{model_class.__name__}(tiny config) raised {_first_line(error)}") from None
    try:
        _output(model, *_inputs())
    except Exception as error:  # noqa: BLE001
        raise Skip("forward", f"the unpatched forward(input_ids, attention_mask) raised "
                   f"{_first_line(error)}") from None
    return model


def _model_class(config):
    """The causal LM (else base) model class of an auto mapping; else, for a config the auto mappings do not list
    (the text config of a multimodal model), the modeling file's class for exactly this config: its
    ``*ForCausalLM``, else its ``*TextModel``, else its ``*Model``, else any."""
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        if type(config) in mapping:
            return mapping[type(config)]
    modeling = sys.modules.get(type(config).__module__.replace(".configuration_", ".modeling_"))
    if modeling is None:
        try:
            modeling = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        except Exception:  # noqa: BLE001
            return None
    candidates = [c for c in vars(modeling).values() if isinstance(c, type) and
                  issubclass(c, transformers.PreTrainedModel) and c.__module__ == modeling.__name__ and
                  getattr(c, "config_class", None) is type(config) and not c.__name__.endswith("PreTrainedModel")]
    for suffix in ("ForCausalLM", "TextModel", "Model", ""):  # "": any class of that config (CLVP's encoder)
        for candidate in candidates:
            if candidate.__name__.endswith(suffix):
                return candidate
    return None


def _text_config(config_class):
    """The text_config class of a composite config, also one level down (Qwen2.5-Omni's thinker_config holds it);
    None for a config of one model."""
    subs = getattr(config_class, "sub_configs", None) or {}
    if "text_config" in subs:
        return subs["text_config"]
    for sub in subs.values():
        if isinstance(sub, type) and sub is not transformers.AutoConfig and \
                isinstance(getattr(sub, "sub_configs", None), dict) and "text_config" in sub.sub_configs:
            return sub.sub_configs["text_config"]
    return None


def tiny_model(directory: str) -> Tuple[str, torch.nn.Module]:
    """(model type, model): the tiny model of this directory, its causal LM class where it has one, that runs
    unpatched on the sweep's batch."""
    model_type = _model_type_of(directory)
    config_class = configuration_auto.CONFIG_MAPPING[model_type]
    text = _text_config(config_class)
    if text is not None:  # composite (multimodal) config: the text model, where it is a model of its own
        if not isinstance(text, type) or not hasattr(text, "model_type") or text is transformers.AutoConfig:
            raise Skip("composite config", f"{model_type}: text_config is {getattr(text, '__name__', text)}")
        config_class, model_type = text, text.model_type
    first = None
    for kwargs in _candidates(config_class):
        try:
            return model_type, _build(config_class, kwargs)
        except Skip as skip:
            first = first or skip
    first.model_type = model_type
    raise first


def _inputs() -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (2, 10), generator=generator)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # left padding: positions come from the mask
    return tokens, mask


def _output(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    decoder = {}
    if getattr(model.config, "is_encoder_decoder", False):  # T5Gemma: the same tokens into the decoder
        decoder = dict(decoder_input_ids=tokens, decoder_attention_mask=mask)
    with torch.no_grad():
        out = model(input_ids=tokens, attention_mask=mask, use_cache=False, **decoder)
    value = getattr(out, "logits", None)
    if value is None:
        value = getattr(out, "last_hidden_state", None)
    if value is None:
        value = out[0]
    return value.float()


def check(directory: str) -> Row:
    """Builds, runs, patches and runs again the tiny model of one directory."""
    start = time.perf_counter()
    row = Row(directory, "", "", "skipped", "")
    try:
        row.model_type, model = tiny_model(directory)
        row.model_class = type(model).__name__
        tokens, mask = _inputs()
        reference = _output(model, tokens, mask)
        try:
            record = PT.patch(model)
        except PT.NotRecognized as error:
            row.status, row.category, row.detail = "refused", error.category, error.detail
            return row
        methods = {name: getattr(PT.RotaryAngles, name)
                   for name in ("rotate", "rotate_one", "rotate_interleaved_to_halves")}

        def counted(method):
            def call(angles, *args, **kwargs):
                row.rotations += 1
                return method(angles, *args, **kwargs)
            return call

        for name, method in methods.items():
            setattr(PT.RotaryAngles, name, counted(method))
        try:
            ours = _output(model, tokens, mask)
        except Exception as error:  # noqa: BLE001 - a patched model that fails is a failure of the test
            ours, row.detail = None, f"the patched forward raised {_first_line(error)}"
        finally:
            for name, method in methods.items():
                setattr(PT.RotaryAngles, name, method)
            PT.unpatch(model)
        row.status = "patched"
        real = mask.bool()
        if ours is not None:
            row.diff = float((ours[real] - reference[real]).abs().max()) if ours.shape == reference.shape \
                else float("inf")
            row.detail = ", ".join(c.target.replace("transformers.models.", "") for c in record.changes)
    except Skip as skip:
        row.status, row.category, row.detail = "skipped", skip.category, skip.detail
        row.model_type = getattr(skip, "model_type", row.model_type)
    finally:
        row.seconds = time.perf_counter() - start
    return row


@functools.lru_cache(maxsize=None)
def coverage() -> Tuple[Tuple[Row, ...], float]:
    """(one row per discovered directory, wall seconds of the whole sweep), computed once per process."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verbosity = transformers.logging.get_verbosity()
            transformers.logging.set_verbosity_error()
            try:
                rows = tuple(check(directory) for directory in discover())
            finally:
                transformers.logging.set_verbosity(verbosity)
    finally:
        torch.set_num_threads(previous)
    return rows, time.perf_counter() - start


def table(rows) -> str:
    lines = ["| directory | model type built | status | replaced, or the reason |", "|---|---|---|---|"]
    for row in rows:
        if row.status == "patched":
            what = row.detail if row.diff is None else \
                f"{row.detail}; posenc rotations: {row.rotations}; max abs diff {row.diff:.1e}"
        else:
            what = f"{row.category}: {row.detail}"
        what = what.replace("|", "\\|")
        lines.append(f"| {row.directory} | {row.model_type or '-'} | {row.status} | {what} |")
    return "\n".join(lines)


def summary(rows) -> str:
    counts = {}
    for row in rows:
        key = f"{row.status}: {row.category}"
        if row.status == "patched":
            key = "patched, posenc rotated" if row.rotations else "patched, no layer called apply_rotary_pos_emb"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{key} {n}" for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


# ---------------------------------------------------------------- tests

def test_discovery_finds_the_rotary_modeling_files():
    directories = discover()
    assert len(directories) >= 150, directories
    assert set(PT.ROTARY_MODEL_TYPES) <= set(directories)


def test_every_patched_model_type_matches_hugging_face():
    rows, _ = coverage()
    wrong = [f"{r.directory} ({r.model_type}): diff {r.diff} {r.detail}" for r in rows
             if r.status == "patched" and not (r.diff is not None and r.diff <= ATOL)]
    assert not wrong, "\n".join(wrong)


def test_the_types_known_to_work_are_patched():
    rows, _ = coverage()
    status = {r.directory: r.status for r in rows}
    assert all(status[t] == "patched" for t in PT.ROTARY_MODEL_TYPES), status


def test_a_floor_of_patched_model_types():
    rows, _ = coverage()
    patched = sum(r.status == "patched" and r.rotations > 0 for r in rows)  # rope_qk (or rope) did the rotary work
    assert patched >= PATCHED_FLOOR, f"{patched} patched: {summary(rows)}"


def test_every_refusal_names_the_model_type_and_a_reason():
    rows, _ = coverage()
    for row in rows:
        if row.status == "refused":
            assert row.category and row.detail, row
    refused = [r for r in rows if r.status == "refused"]
    if refused:
        _, model = tiny_model(refused[0].directory)
        with pytest.raises(ValueError, match=f'model_type "{re.escape(refused[0].model_type)}", which is not '
                                             f'recognized: {re.escape(refused[0].category)}: '):
            PT.patch(model)


DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "integrations-transformers.md")


def _key(line: str) -> Tuple[str, ...]:
    """A table row as the docs keep it, less what varies with the machine: directory, model type built, status,
    and what was replaced (patched) or the category of the reason."""
    cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
    what = cells[3].split("; posenc rotations:")[0] if cells[2] == "patched" else cells[3].split(":")[0]
    return tuple(cells[:3]) + (what,)


def test_the_docs_table_is_the_sweeps():
    """docs/integrations-transformers.md holds the table and totals of this sweep for the transformers version it
    names: regenerate them with ``python tests/python/test_transformers_coverage.py`` when they change."""
    with open(DOCS, encoding="utf-8") as page:
        text = page.read()
    version = re.search(r"^### The sweep over transformers (\S+)$", text, re.MULTILINE).group(1)
    if transformers.__version__ != version:
        pytest.skip(f"the docs describe transformers {version}, this is {transformers.__version__}")
    rows, _ = coverage()
    lines = text.splitlines()
    start = lines.index(table([]).splitlines()[0]) + 2
    end = next(i for i in range(start, len(lines) + 1) if i == len(lines) or not lines[i].startswith("| "))
    documented = [_key(line) for line in lines[start:end]]
    assert documented == [_key(line) for line in table(rows).splitlines()[2:]]
    assert f"Totals: {summary(rows)}." in text


def test_the_sweep_time_is_bounded():
    rows, seconds = coverage()
    slowest = sorted(rows, key=lambda r: -r.seconds)[:5]
    assert seconds < TIME_LIMIT_S, f"{seconds:.1f} s; slowest: " + ", ".join(
        f"{r.directory} {r.seconds:.1f} s" for r in slowest)


if __name__ == "__main__":
    all_rows, total = coverage()
    print(table(all_rows))
    print()
    print(f"{len(all_rows)} directories in {total:.1f} s: {summary(all_rows)}", file=sys.stderr)
