"""A patched model wherever a user takes it: saved and reloaded, deep-copied, cast to bfloat16, trained with
gradient checkpointing, fed left padding and explicit position ids, decoding with every cache class, and
exported with torch.export. Each check compares against the unpatched Hugging Face model on the same weights.

Representatives: Llama (neox halves), Qwen3 (QK-norm), Gemma 3 (rope parameters per layer type, sliding window
layers), Cohere (GPT-J style interleaved pairs, YaRN) and Qwen2-VL (M-RoPE; its text model patched inside the
whole vision-language model, whose vision tower keeps its own rotary code).
"""
import copy
import functools
import gc
import io

import pytest
import torch

import posenc  # noqa: F401

transformers = pytest.importorskip("transformers")
PT = pytest.importorskip("posenc.integrations.transformers")

from test_integrations_transformers import (GRAD_ATOL, GRAD_RTOL, LOGITS_ATOL, VOCAB, OpCounter,  # noqa: E402
                                            logits, ops_of, training_grads)


pytestmark = pytest.mark.usefixtures("one_thread")


COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
SLIDING_WINDOW = 4  # Gemma 3's sliding layers: the prompts and generations below are longer


def _configs():
    layer_types = ["sliding_attention", "full_attention"]
    return {
        "llama": transformers.LlamaConfig(**COMMON),
        "qwen3": transformers.Qwen3Config(**COMMON),
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON, layer_types=layer_types, sliding_window=SLIDING_WINDOW,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
        "cohere": transformers.CohereConfig(**COMMON, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}),
        "qwen2_vl": transformers.Qwen2VLConfig(
            text_config=dict(COMMON, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, mlp_ratio=1, patch_size=2,
                               spatial_merge_size=1, temporal_patch_size=1),
            image_token_id=60, video_token_id=61, vision_start_token_id=62),
    }


MODELS = list(_configs())


@functools.lru_cache(maxsize=None)
def _reference(name):
    torch.manual_seed(0)
    config = _configs()[name]
    if name == "qwen2_vl":
        return transformers.Qwen2VLForConditionalGeneration(config).eval()
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def reference(name):
    """A fresh copy of the unpatched model (the same weights each time)."""
    return copy.deepcopy(_reference(name))


def patch(name, model):
    """Qwen2-VL: the text model is what patch takes; the vision tower's rotary (axial) stays Hugging Face's."""
    return PT.patch(model.model.language_model if name == "qwen2_vl" else model)


def unpatch(name, model):
    return PT.unpatch(model.model.language_model if name == "qwen2_vl" else model)


def patched(name):
    model = reference(name)
    patch(name, model)
    return model


def rotary_modules(model):
    return [m for m in model.modules() if isinstance(m, PT.RotaryPositions)]


def exact_frequencies(model):
    """posenc's frequencies of every replacement module (float64, outside the state dict)."""
    found = []
    for module in rotary_modules(model):
        found += [module.rotary.inv_freq] if module.layer_types is None else \
            [module.rotaries[t].inv_freq for t in module.layer_types]
    return found


# Each layer rotates q and k with one of these (qk_norm_rope where the patch fuses the layer's QK-norm into it).
ROTATIONS = ("posenc.rope_qk.default", "posenc.qk_norm_rope.default")


def rotations(counts):
    return sum(counts[op] for op in ROTATIONS)


def tokens(batch=2, seq=12, seed=0):
    return torch.randint(3, 60, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(ours, theirs):
    torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)


# ---------------------------------------------------------------- save_pretrained, from_pretrained, deepcopy

@pytest.mark.parametrize("name", MODELS)
def test_save_pretrained_and_from_pretrained_of_a_patched_model(name, tmp_path):
    """The state dict is unchanged by patching, so what save_pretrained writes is the unpatched model's. The model
    from_pretrained loads is Hugging Face's (unpatched); patched again, it gives the original's logits."""
    original = reference(name)
    model = patched(name)
    theirs = original.state_dict()
    assert model.state_dict().keys() == theirs.keys()
    assert all(torch.equal(value, theirs[key]) for key, value in model.state_dict().items())
    model.save_pretrained(tmp_path)
    loaded = type(original).from_pretrained(tmp_path).eval()
    assert not PT.is_patched(loaded) and not rotary_modules(loaded)
    ids = tokens()
    expected = logits(original, input_ids=ids)
    assert torch.equal(logits(loaded, input_ids=ids), expected)
    patch(name, loaded)
    assert rotary_modules(loaded)
    assert_same_logits(logits(loaded, input_ids=ids), expected)
    assert_same_logits(logits(model, input_ids=ids), expected)


@pytest.mark.parametrize("name", MODELS)
def test_torch_save_and_load_of_a_patched_model(name):
    """torch.save pickles the whole patched model; torch.load gives a patched model that takes its own hold on the
    wrapped apply_rotary_pos_emb, so it works where no other patched model exists (a new process): here, once
    the saved model is collected and the modeling file has its own function back."""
    original, model = reference(name), patched(name)
    modeling = rotary_modules(model)[0].modeling
    buffer = io.BytesIO()
    torch.save(model, buffer)
    del model
    gc.collect()
    assert modeling not in PT._ROTARY_WRAPPERS
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert PT._ROTARY_WRAPPERS[modeling][1] == 1 and rotary_modules(loaded)
    ids = tokens()
    counts = ops_of(lambda: logits(loaded, input_ids=ids))
    assert rotations(counts) == 2 and counts["aten.cos.default"] == 0
    assert_same_logits(logits(loaded, input_ids=ids), logits(original, input_ids=ids))
    unpatch(name, loaded)
    assert modeling not in PT._ROTARY_WRAPPERS and torch.equal(logits(loaded, input_ids=ids),
                                                                logits(original, input_ids=ids))


@pytest.mark.parametrize("name", MODELS)
def test_a_deep_copy_is_patched_on_its_own(name):
    original = reference(name)
    model = patched(name)
    duplicate = copy.deepcopy(model)
    unpatch(name, model)
    assert not rotary_modules(model) and rotary_modules(duplicate)
    ids = tokens()
    counts = ops_of(lambda: logits(duplicate, input_ids=ids))
    assert rotations(counts) == 2 and counts["aten.cos.default"] == 0
    assert_same_logits(logits(duplicate, input_ids=ids), logits(original, input_ids=ids))


# ---------------------------------------------------------------- bfloat16

# Measured: the bfloat16 logits' max abs distance from the float32 model's, patched / unpatched, in either order:
# llama 2.7e-3 / 2.7e-3, qwen3 2.2e-3 / 4.0e-3, gemma3 4.0e-3 / 4.4e-3, cohere 1.3e-4 / 1.3e-4, qwen2_vl 3.6e-3 /
# 3.9e-3. The factor leaves room for other seeds' rounding.
BF16_FACTOR = 1.5


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("order", ["patch_then_cast", "cast_then_patch"])
def test_bfloat16_keeps_float64_frequencies_and_hugging_face_accuracy(name, order):
    """model.to(torch.bfloat16) converts parameters and buffers; posenc's frequencies are plain float64 attributes,
    so they stay exact, whether the model is cast after patching or patched after casting. The bfloat16 logits
    are as close to the float32 ones as Hugging Face's bfloat16 model's are."""
    original = reference(name)
    ids = tokens(seq=20)
    expected = logits(original, input_ids=ids)
    their_error = float((logits(reference(name).to(torch.bfloat16), input_ids=ids).float() - expected).abs().max())
    model = reference(name)
    if order == "patch_then_cast":
        patch(name, model)
        before = [f.clone() for f in exact_frequencies(model)]
        model.to(torch.bfloat16)
        assert all(torch.equal(f, b) for f, b in zip(exact_frequencies(model), before))
    else:
        model.to(torch.bfloat16)
        patch(name, model)
    frequencies = exact_frequencies(model)
    assert frequencies and all(f.dtype == torch.float64 for f in frequencies)
    # the float32 inv_freq kept for readers is a buffer, cast as Hugging Face's own module's is
    assert all(b.dtype == torch.bfloat16 for m in rotary_modules(model) for b in m.buffers())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    counts = ops_of(lambda: logits(model, input_ids=ids))
    assert rotations(counts) == 2 and counts["aten.cos.default"] == 0
    our_error = float((logits(model, input_ids=ids).float() - expected).abs().max())
    assert our_error <= BF16_FACTOR * their_error


# ---------------------------------------------------------------- gradient checkpointing

@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing(name, reentrant):
    """Checkpointed layers recompute their forward pass in backward, with the RotaryAngles of the first pass:
    the gradients are the unpatched model's (with the same checkpointing), and each layer rotates twice."""
    original, model = reference(name), patched(name)
    for m in (original, model):
        # gradient_checkpointing_enable, the older name, is a deprecated alias in transformers 5.24
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = tokens(seq=16)
    inputs = dict(input_ids=ids, labels=ids)
    theirs = training_grads(original, **inputs)
    model.train()
    with OpCounter() as counter:
        model.zero_grad(set_to_none=True)
        try:
            model(**inputs).loss.backward()
        finally:
            model.eval()
    ours = {key: p.grad for key, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys() and ours
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=key)
    backward = {op: n for op, n in counter.counts.items() if op.startswith("posenc.") and "backward" in op}
    assert rotations(counter.counts) == 4 and sum(backward.values()) == 2 and counter.counts["aten.cos.default"] == 0


# ---------------------------------------------------------------- left padding, explicit position ids

@pytest.mark.parametrize("name", [n for n in MODELS if n != "llama"])  # Llama: test_integrations_transformers.py
def test_left_padding_and_explicit_position_ids(name):
    original, model = reference(name), patched(name)
    ids = tokens(batch=3, seq=11)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    real = mask.bool()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    calls = [dict(attention_mask=mask), dict(attention_mask=mask, position_ids=position_ids)]
    if name == "qwen2_vl":  # M-RoPE: [3, B, S], a different position on every axis (as an image's tokens have)
        calls.append(dict(attention_mask=mask, position_ids=torch.stack(
            [position_ids, position_ids * 2 + 1, (position_ids * 3) % 17])))
    for inputs in calls:
        ours, theirs = logits(model, input_ids=ids, **inputs), logits(original, input_ids=ids, **inputs)
        assert_same_logits(ours[real], theirs[real])
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(**options), original.generate(**options))


def test_mrope_generation_with_an_image_and_left_padding():
    """Qwen2-VL with a 2 x 2 patch image in each prompt, one row left-padded: the positions of the image tokens
    differ on every axis, and the patched text model generates the unpatched tokens."""
    original, model = reference("qwen2_vl"), patched("qwen2_vl")
    text = tokens(batch=2, seq=5)
    image = torch.tensor([62, 60, 60, 60, 60]).expand(2, -1)  # vision start, then one token per patch
    ids = torch.cat([text[:, :2], image, text[:, 2:]], dim=1)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    options = dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(8, 12), max_new_tokens=NEW_TOKENS,
                   image_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]), mm_token_type_ids=(ids == 60).int(),
                   do_sample=False, pad_token_id=0)
    seen = []
    rotary_modules(model)[0].register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    with torch.no_grad():
        assert torch.equal(model.generate(**options), original.generate(**options))
    assert seen[0].shape == (3, 2, ids.size(1)) and not torch.equal(seen[0][1], seen[0][2])


# ---------------------------------------------------------------- generation with every cache class


def _caches():
    """(id, generate's keywords or a function of the config giving them). Quantized: transformers' fp8 backend is
    built in; quanto and hqq need packages of their own."""
    yield "default", lambda config: {}
    yield "dynamic", lambda config: dict(cache_implementation="dynamic")
    yield "offloaded", lambda config: dict(cache_implementation="offloaded")
    yield "static", lambda config: dict(cache_implementation="static")
    yield "offloaded_static", lambda config: dict(cache_implementation="offloaded_static")
    yield "sliding_window", lambda config: dict(cache_implementation="sliding_window")
    yield "hybrid", lambda config: dict(cache_implementation="hybrid")
    yield "DynamicCache", lambda config: dict(cache=transformers.DynamicCache(config=config))
    yield "StaticCache", lambda config: dict(cache=transformers.StaticCache(config=config, max_cache_len=24))
    # generate's former name of `cache` (deprecated in 5.24)
    yield "past_key_values", lambda config: dict(past_key_values=transformers.DynamicCache(config=config))
    for backend in ("fp8", "quanto", "hqq"):
        yield f"quantized_{backend}", functools.partial(
            lambda config, backend: dict(cache_implementation="quantized",
                                         cache_config={"backend": backend, "config": config}), backend=backend)


CACHES = dict(_caches())
NEW_TOKENS = 6  # after a prompt of 6: 12 tokens, past Gemma 3's window of 4
# The cache class generate ends up with. "sliding_window" is a deprecated name of the static cache; "hybrid",
# given to generate, is reset to the default (transformers' generation/utils.py).
CACHE_CLASSES = dict(default="DynamicCache", dynamic="DynamicCache", offloaded="DynamicCache", static="StaticCache",
                     offloaded_static="StaticCache", sliding_window="StaticCache", hybrid="DynamicCache",
                     DynamicCache="DynamicCache", StaticCache="StaticCache", past_key_values="DynamicCache",
                     quantized_fp8="QuantizedCache",
                     quantized_quanto="QuantizedCache", quantized_hqq="QuantizedCache")


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_generation_with_every_cache(name, cache):
    """The patched model generates the unpatched one's tokens with each cache. A cache the unpatched model cannot
    use here is skipped with Hugging Face's reason (the patched model then fails the same way)."""
    original, model = reference(name), patched(name)
    ids = tokens(seq=6)
    text_config = original.config.get_text_config(decoder=True)
    options = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                   pad_token_id=0, return_dict_in_generate=True)
    try:
        with torch.no_grad():
            theirs = original.generate(**options, **CACHES[cache](text_config))
    except Exception as error:  # noqa: BLE001 - transformers' own limits, checked on the patched model below
        with pytest.raises(type(error)):
            with torch.no_grad():
                model.generate(**options, **CACHES[cache](text_config))
        pytest.skip(f"unpatched {name} with {cache}: {type(error).__name__}: {str(error).splitlines()[0]}")
    with torch.no_grad(), OpCounter() as counter:
        ours = model.generate(**options, **CACHES[cache](text_config))
    assert torch.equal(ours.sequences, theirs.sequences)
    assert rotations(counter.counts) == 2 * NEW_TOKENS and counter.counts["aten.cos.default"] == 0
    # the same cache, of the kind asked for (Gemma 3's sliding layers keep a window: the generation outgrows it)
    kind = type(ours.cache).__name__, sorted({type(layer).__name__ for layer in ours.cache.layers})
    assert kind == (type(theirs.cache).__name__, sorted({type(layer).__name__ for layer in theirs.cache.layers}))
    assert kind[0] == CACHE_CLASSES[cache] and (name == "gemma3") == any("Sliding" in k for k in kind[1])


# ---------------------------------------------------------------- torch.export


def _posenc_and_trig_targets(program):
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    return ([t for t in targets if t.startswith("posenc.")], [t for t in targets if t.startswith(("aten.cos",
                                                                                                 "aten.sin"))])


# A dynamic sequence length for one model of each rotation: rope_qk in halves, qk_norm_rope (QK-norm fused),
# rope_qk with M-RoPE's pair axes (each export costs seconds).
DYNAMIC_EXPORT = ("llama", "qwen3", "qwen2_vl")


@pytest.mark.parametrize("name", MODELS)
def test_torch_export_of_the_patched_forward(name):
    """torch.export.export of the patched model's forward: the program's logits are the unpatched model's, its graph
    calls one posenc rotation per layer and computes no cos/sin. Where the unpatched model exports with a dynamic sequence length, the
    patched one does too, and the program gives the unpatched logits at another length."""
    original, model = reference(name), patched(name)
    ids = tokens(seq=10)
    program = torch.export.export(model, (), dict(input_ids=ids, use_cache=False))
    posenc_ops, trig = _posenc_and_trig_targets(program)
    assert len(posenc_ops) == 2 and len(set(posenc_ops)) == 1 and posenc_ops[0] in ROTATIONS and not trig  # per layer
    assert_same_logits(program.module()(input_ids=ids, use_cache=False).logits, logits(original, input_ids=ids))
    if name not in DYNAMIC_EXPORT:
        return
    dynamic = {"input_ids": {1: torch.export.Dim("seq", min=2, max=32)}, "use_cache": None}
    try:
        program = torch.export.export(model, (), dict(input_ids=ids, use_cache=False), dynamic_shapes=dynamic)
    except Exception:  # noqa: BLE001 - a failure is the patch's only where the unpatched model exports
        try:
            torch.export.export(original, (), dict(input_ids=ids, use_cache=False), dynamic_shapes=dynamic)
        except Exception as error:  # noqa: BLE001
            pytest.skip(f"unpatched {name} does not export with a dynamic sequence: {type(error).__name__}")
        raise
    assert _posenc_and_trig_targets(program)[0] == posenc_ops
    for length in (5, 17):
        longer = tokens(seq=length, seed=length)
        assert_same_logits(program.module()(input_ids=longer, use_cache=False).logits,
                           logits(original, input_ids=longer))
