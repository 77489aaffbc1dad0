"""Coverage of posenc.integrations.transformers.patch over every rotary model type of the installed transformers.

Discovery: every ``transformers/models/*/modeling_*.py`` that defines ``def apply_rotary_pos_emb``. Each is built
from a tiny config (its config class, or the ``text_config`` class of a composite one, with hidden size 64, 2
layers, 4 heads, vocabulary 128; nothing downloaded) and run on one random batch with an attention mask (one row
left-padded), unpatched and then patched. Every type ``patch`` accepts must give the unpatched fp32 logits (or
last hidden state, for a model without a causal LM head) to 1e-5 at the real positions; a type it refuses is
recorded with its reason, a type that cannot be built or run generically with that reason.

``python tests/python/test_transformers_coverage.py`` prints the table that docs/integrations-transformers.md holds.
"""
import functools
import glob
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
PATCHED_FLOOR = 85  # measured: 92 patched (8 of them interleaved pairs, 12 with rope parameters per layer type),
# equal, rope_qk doing the rotation, with transformers 5.24.0
TIME_LIMIT_S = 100.0  # the whole sweep, imports of ~190 modeling files included: measured 18-27 s on 2 cores

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
            tie_word_embeddings=False, rotary_dim=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            kv_lora_rank=16, q_lora_rank=32, vocab_size_per_layer_input=VOCAB)  # Gemma 4's per-layer embeddings


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


def tiny_model(directory: str) -> Tuple[str, torch.nn.Module]:
    """(model type, model): the tiny model of this directory, its causal LM class where it has one."""
    model_type = _model_type_of(directory)
    config_class = configuration_auto.CONFIG_MAPPING[model_type]
    text = (getattr(config_class, "sub_configs", None) or {}).get("text_config")
    if text is not None:  # composite (multimodal) config: the text model, where it is a model of its own
        if not isinstance(text, type) or not hasattr(text, "model_type") or text is transformers.AutoConfig:
            raise Skip("composite config", f"{model_type}: text_config is {getattr(text, '__name__', text)}")
        config_class, model_type = text, text.model_type
    try:
        config = config_class(**TINY)
    except Exception as error:  # noqa: BLE001 - recorded as the reason
        raise Skip("tiny config", f"{config_class.__name__}(tiny values) raised {_first_line(error)}") from None
    model_class = None
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        if type(config) in mapping:
            model_class = mapping[type(config)]
            break
    if model_class is None:
        raise Skip("no model class", f"{config_class.__name__} has no causal LM or base model class")
    try:
        with torch.device("meta"):
            parameters = sum(p.numel() for p in model_class(config).parameters())
    except Exception as error:  # noqa: BLE001
        raise Skip("build", f"{model_class.__name__}(tiny config) raised {_first_line(error)}") from None
    if parameters > MAX_PARAMETERS:
        raise Skip("not tiny", f"{model_class.__name__} has {parameters / 1e6:.1f}M parameters with the tiny values "
                   f"(sub-configs keep their sizes)")
    torch.manual_seed(0)
    try:
        model = model_class(config).eval()
    except Exception as error:  # noqa: BLE001
        raise Skip("build", f"{model_class.__name__}(tiny config) raised {_first_line(error)}") from None
    return model_type, model


def _inputs() -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (2, 10), generator=generator)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # left padding: positions come from the mask
    return tokens, mask


def _output(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=tokens, attention_mask=mask, use_cache=False)
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
        try:
            reference = _output(model, tokens, mask)
        except Exception as error:  # noqa: BLE001
            raise Skip("forward", f"the unpatched forward(input_ids, attention_mask) raised "
                       f"{_first_line(error)}") from None
        try:
            record = PT.patch(model)
        except PT.NotRecognized as error:
            row.status, row.category, row.detail = "refused", error.category, error.detail
            return row
        methods = {name: getattr(PT.RotaryAngles, name) for name in ("rotate", "rotate_one")}

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
