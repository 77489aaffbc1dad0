"""posenc.integrations.transformers on tiny random Hugging Face models built from configs (nothing downloaded).

Every check runs a patched copy of a model against the unpatched original: logits (fp32, <= 1e-5 abs), the
gradients of one training step (<= 1e-6 abs + 1e-5 relative), greedy generation with a KV cache (the same
tokens), and, through a dispatch mode, that the posenc op does the positional work (no cos/sin tables).
"""
import copy
import gc
import inspect
import re
from pathlib import Path

import pytest
import torch

import posenc  # noqa: F401

from helpers import OpCounter

transformers = pytest.importorskip("transformers")
PT = pytest.importorskip("posenc.integrations.transformers")

VOCAB = 64
LOGITS_ATOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5  # measured: at most 5e-8 apart (gradients up to 0.3)


pytestmark = pytest.mark.usefixtures("one_thread")


def ops_of(fn):
    with OpCounter() as counter:
        fn()
    return counter.counts


def logits(model, **inputs):
    with torch.no_grad():
        return model(**inputs).logits


def training_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    model.train()
    model(**inputs).loss.backward()
    model.eval()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_same_model_outputs(reference, patched, inputs, train_inputs, generate_inputs=None, real=None):
    """Logits, one training step's gradients and greedy generation of `patched` equal those of `reference`.
    `real` selects the positions compared (padding rows of a left-padded batch are whatever the mask leaves)."""
    ours, theirs = logits(patched, **inputs), logits(reference, **inputs)
    mask = slice(None) if real is None else real
    torch.testing.assert_close(ours[mask], theirs[mask], atol=LOGITS_ATOL, rtol=0)
    our_grads, their_grads = training_grads(patched, **train_inputs), training_grads(reference, **train_inputs)
    assert our_grads.keys() == their_grads.keys() and our_grads
    for name in their_grads:
        torch.testing.assert_close(our_grads[name], their_grads[name], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)
    if generate_inputs is not None:
        options = dict(do_sample=False, use_cache=True, pad_token_id=0)
        with torch.no_grad():
            ours, theirs = patched.generate(**generate_inputs, **options), reference.generate(**generate_inputs, **options)
        assert torch.equal(ours, theirs)


def patched_copy(model):
    patched = copy.deepcopy(model)
    record = PT.patch(patched)
    return patched, record


# ---------------------------------------------------------------- rotary: Llama with every scaling

SEQ_LIMIT = 24  # max_position_embeddings; the original length of llama3 and longrope is 16, of yarn 6 (factor 4)
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 16},
}


def llama(scaling, theta=10000.0):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=SEQ_LIMIT,
                                      rope_parameters=dict(scaling, rope_theta=theta))
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_llama_every_scaling_matches_hugging_face(scaling):
    reference = llama(SCALINGS[scaling])
    patched, record = patched_copy(reference)
    assert [c.target for c in record.changes] == [
        "model.rotary_emb", "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"]
    long = torch.randint(0, VOCAB, (2, 30))  # past max_position_embeddings and the original 16: scaling at work
    prompt = torch.randint(0, VOCAB, (2, 15))  # generation crosses 16 and 24: LongRoPE switches, dynamic grows
    assert_same_model_outputs(reference, patched, dict(input_ids=long), dict(input_ids=long, labels=long),
                              dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10))
    counts = ops_of(lambda: patched(input_ids=long, labels=long).loss.backward())
    assert counts["posenc.rope_qk.default"] == 2 and counts["posenc.rope_qk_backward.default"] == 2  # per layer
    assert counts["aten.cos.default"] == counts["aten.sin.default"] == 0  # no tables


def test_llama_left_padding_and_explicit_position_ids():
    reference = llama(SCALINGS["yarn"])
    patched, _ = patched_copy(reference)
    tokens = torch.randint(0, VOCAB, (3, 11))
    mask = torch.ones_like(tokens)
    mask[1, :4] = 0
    mask[2, :7] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]: per-row positions, as generate builds them
    real = mask.bool()
    inputs = dict(input_ids=tokens, attention_mask=mask, position_ids=position_ids)
    assert_same_model_outputs(reference, patched, inputs, dict(inputs, labels=tokens.masked_fill(~real, -100)),
                              dict(input_ids=tokens, attention_mask=mask, max_new_tokens=8), real=real)


def test_dynamic_ntk_keeps_hugging_face_state_across_calls():
    """HF's dynamic NTK keeps the frequencies of the longest sequence seen: a shorter call that is still past
    max_position_embeddings uses them. The patched model does the same, so calls in any order agree."""
    reference = llama(SCALINGS["dynamic"])
    patched, _ = patched_copy(reference)
    tokens = torch.randint(0, VOCAB, (1, 40))
    for length in (40, 30, 12, 30):  # grows to 40; 30 keeps 40's frequencies; 12 < 24 resets; 30 grows again
        torch.testing.assert_close(logits(patched, input_ids=tokens[:, :length]),
                                   logits(reference, input_ids=tokens[:, :length]), atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("scaling", ["default", "linear", "dynamic", "yarn"])
def test_the_rotary_module_keeps_hugging_face_attributes(scaling):
    """Code written for Hugging Face's rotary module finds the patched one and reads the original's values: a
    module named like ``rotary_emb`` with ``inv_freq`` and ``rope_type`` is what transformers' own
    test_model_rope_scaling_frequencies looks for (it skips a model without one)."""
    reference = llama(SCALINGS[scaling])
    patched, _ = patched_copy(reference)
    found = next(module for name, module in patched.named_modules()
                 if "rotary_emb" in name and hasattr(module, "inv_freq") and hasattr(module, "rope_type"))
    assert found is patched.model.rotary_emb and isinstance(found, PT.RotaryPositions)
    ours, theirs = patched.model.rotary_emb, reference.model.rotary_emb

    def assert_same_attributes():
        assert ours.rope_type == theirs.rope_type == scaling
        assert ours.attention_scaling == theirs.attention_scaling
        assert ours.original_max_seq_len == theirs.original_max_seq_len
        assert int(ours.max_seq_len_cached) == int(theirs.max_seq_len_cached)
        assert torch.equal(ours.original_inv_freq, theirs.original_inv_freq)
        # Dynamic NTK grown past the limit: posenc's float64 frequencies rounded, within an ulp of Hugging Face's.
        torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, atol=0, rtol=2e-7)
        assert ours.inv_freq.dtype == theirs.inv_freq.dtype == torch.float32

    assert_same_attributes()
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    tokens = torch.randint(0, VOCAB, (1, 40))
    for length in (40, 30, 12):  # dynamic: grows to 40, keeps it, resets below max_position_embeddings
        for model in (patched, reference):
            logits(model, input_ids=tokens[:, :length])
        assert_same_attributes()
        if scaling == "dynamic" and length > SEQ_LIMIT:
            assert (ours.inv_freq <= ours.original_inv_freq).all() and not torch.equal(ours.inv_freq,
                                                                                      ours.original_inv_freq)
    default = reference.model.rotary_emb.compute_default_rope_parameters(reference.config)[0]
    if scaling == "linear":
        torch.testing.assert_close(ours.inv_freq * 2.0, default)
    elif scaling == "yarn":
        assert ours.attention_scaling > 1.0


# ---------------------------------------------------------------- rotary: the other model types

def rotary_models():
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=SEQ_LIMIT, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    longrope = dict(SCALINGS["longrope"], short_factor=[1.0, 1.2, 1.4, 1.6], long_factor=[2.0, 3.0, 4.0, 5.0])
    yield "mistral", transformers.MistralConfig(**common, rope_parameters={"rope_type": "linear", "factor": 3.0,
                                                                           "rope_theta": 1000.0})
    yield "mixtral", transformers.MixtralConfig(**common, num_local_experts=2, num_experts_per_tok=1)
    yield "qwen2", transformers.Qwen2Config(**common, rope_parameters=dict(SCALINGS["yarn"], rope_theta=1e6))
    yield "qwen3", transformers.Qwen3Config(**common, head_dim=8)
    yield "gemma", transformers.GemmaConfig(**common, head_dim=16)
    yield "gemma2", transformers.Gemma2Config(**common, head_dim=16)
    # Partial rotary: Phi-3 (half the channels, LongRoPE), GPT-NeoX and StableLM (a quarter).
    yield "phi3", transformers.Phi3Config(**common, partial_rotary_factor=0.5,
                                          rope_parameters=dict(longrope, partial_rotary_factor=0.5))
    yield "gpt_neox", transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.25,
                                                 max_position_embeddings=SEQ_LIMIT, pad_token_id=0)
    yield "stablelm", transformers.StableLmConfig(**common, partial_rotary_factor=0.25)
    # Not in ROTARY_MODEL_TYPES: recognized by the rotary contract alone.
    yield "starcoder2", transformers.Starcoder2Config(**common, rope_parameters=dict(SCALINGS["llama3"],
                                                                                     rope_theta=1e4))
    yield "olmo2", transformers.Olmo2Config(**common)
    # GPT-J style interleaved pairs, rotated by rope_qk with layout="gptj": Cohere builds interleaved tables
    # (YaRN here); GLM builds neox tables and interleaves them in apply_rotary_pos_emb, on half the channels.
    yield "cohere", transformers.CohereConfig(**common, rope_parameters=dict(SCALINGS["yarn"], rope_theta=1e4))
    yield "glm", transformers.GlmConfig(**common, head_dim=16, partial_rotary_factor=0.5)
    # Rope parameters per layer type (one rotary module, forward(x, position_ids, layer_type)): Gemma 3's sliding
    # layers at base 1e4, its full ones at 1e6 with linear scaling; OLMo 3's full layers with YaRN.
    layer_types = ["sliding_attention", "full_attention"]
    yield "gemma3_text", transformers.Gemma3TextConfig(
        **common, head_dim=16, layer_types=layer_types, sliding_window=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    # MLA (DeepSeek V3): rope on its decoupled 8 channels, interleaved pairs rotated into halves by
    # apply_rotary_pos_emb_interleave (rope_qk with layout="gptj", then the halves), YaRN with mscale.
    yield "deepseek_v3", transformers.DeepseekV3Config(
        **dict(common, num_key_value_heads=2), head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        kv_lora_rank=16, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=16, first_k_dense_replace=1, rope_interleave=True,
        rope_parameters=dict(SCALINGS["yarn"], rope_theta=1e4, mscale=1.0, mscale_all_dim=0.707))
    yield "olmo3", transformers.Olmo3Config(
        **common, layer_types=layer_types, sliding_window=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
                         "full_attention": dict(SCALINGS["yarn"], rope_theta=5e5)})
    # Complex tables (the rotary module returns scale * exp(i angle); apply_rotary_emb multiplies pairs as complex
    # numbers): rope_qk with layout="gptj". Llama 4: q and k [B, S, H, D], Llama 3 scaling, a NoPE layer with the
    # query temperature, chunked attention, the L2 norm after the rotation; DeepSeek V2: [B, H, S, D] (MLA).
    yield "llama4_text", transformers.Llama4TextConfig(
        **common, head_dim=16, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=4,
        attn_scale=0.1, attention_chunk_size=8, use_qk_norm=True,
        rope_parameters=dict(SCALINGS["llama3"], rope_theta=5e5))
    yield "deepseek_v2", transformers.DeepseekV2Config(
        **dict(common, num_key_value_heads=2), qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        kv_lora_rank=16, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1)


INTERLEAVED = ("cohere", "glm", "llama4_text", "deepseek_v2")
ROTARY_LAYERS = {"llama4_text": 1}  # of 2: the other is a NoPE layer


@pytest.mark.parametrize("model_type, config", list(rotary_models()), ids=lambda v: v if isinstance(v, str) else "")
def test_rotary_model_types_match_hugging_face(model_type, config):
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    patched, record = patched_copy(reference)
    assert config.model_type == model_type == record.model_type and record.family == "rotary"
    layout = "gptj" if model_type in INTERLEAVED else "neox"
    rotary = [m for m in patched.modules() if isinstance(m, PT.RotaryPositions)]
    assert [m.layout for m in rotary] == [layout] and ("layout=gptj" in str(record)) == (layout == "gptj")
    tokens = torch.randint(3, VOCAB, (2, 20))
    prompt = tokens[:, :12]
    assert_same_model_outputs(reference, patched, dict(input_ids=tokens), dict(input_ids=tokens, labels=tokens),
                              dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10))
    counts = ops_of(lambda: patched(input_ids=tokens))
    # one rotation per layer: rope_qk, or qk_norm_rope where the layer's q/k norms are fused into it
    assert counts["posenc.rope_qk.default"] + counts["posenc.qk_norm_rope.default"] == ROTARY_LAYERS.get(model_type, 2)
    assert counts["aten.cos.default"] == counts["aten.polar.default"] == 0


def test_rope_parameters_per_layer_type():
    """Gemma 3: each layer type rotates with its own frequencies, and the patched module keeps Hugging Face's
    per-type attributes; a layer type it does not hold is an error naming the ones it does."""
    config = dict(rotary_models())["gemma3_text"]
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    patched, record = patched_copy(reference)
    ours, theirs = patched.model.rotary_emb, reference.model.rotary_emb
    assert ours.layer_types == ["full_attention", "sliding_attention"] and ours.rope_type == theirs.rope_type
    assert "full_attention: rotary_dim=16, base=1000000.0" in str(record)
    x, position_ids = torch.zeros(1, 5, 16), torch.arange(5)[None]
    for layer_type in ours.layer_types:
        assert torch.equal(getattr(ours, f"{layer_type}_inv_freq"), getattr(theirs, f"{layer_type}_inv_freq"))
        assert getattr(ours, f"{layer_type}_attention_scaling") == getattr(theirs, f"{layer_type}_attention_scaling")
        angles, _ = ours(x, position_ids, layer_type)
        cos, sin = theirs(x, position_ids, layer_type)
        theta = angles.positions[:, None] * angles.inv_freq  # float64: Hugging Face's float32 tables to 1e-6
        torch.testing.assert_close(theta.cos().float(), cos[0, :, :8], atol=1e-6, rtol=0)
        torch.testing.assert_close(theta.sin().float(), sin[0, :, :8], atol=1e-6, rtol=0)
    slow = ours(x, position_ids, "sliding_attention")[0].inv_freq
    fast = ours(x, position_ids, "full_attention")[0].inv_freq
    torch.testing.assert_close(slow[1] / fast[1], torch.tensor(8.0 * 100 ** (2 / 16), dtype=torch.float64))
    with pytest.raises(ValueError, match=r"layer_type must be one of \['full_attention', 'sliding_attention'\], "
                                         r"got 'chunked_attention'"):
        ours(x, position_ids, "chunked_attention")


def test_gemma4_proportional_rope_one_tensor_at_a_time():
    """Gemma 4 (its unified text model): full-attention layers with heads of global_head_dim and "proportional"
    rope (a quarter of the pairs turning), sliding ones with the default rope; its apply_rotary_pos_emb(x, cos, sin)
    rotates one tensor a call, which the patch sends to one posenc.rope call."""
    layer_types = ["sliding_attention", "full_attention"]
    config = transformers.AutoConfig.for_model(
        "gemma4_unified_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ_LIMIT, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, head_dim=16, global_head_dim=32, layer_types=layer_types, sliding_window=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                            "partial_rotary_factor": 0.25}})
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    patched, record = patched_copy(reference)
    assert "rope (one tensor a call)" in str(record) and "full_attention: rotary_dim=32" in str(record)
    rotary = patched.model.rotary_emb.rotaries["full_attention"]
    assert int((rotary.inv_freq != 0).sum()) == 4 and rotary.inv_freq.numel() == 16
    tokens = torch.randint(3, VOCAB, (2, 20))
    prompt = tokens[:, :12]
    assert_same_model_outputs(reference, patched, dict(input_ids=tokens), dict(input_ids=tokens, labels=tokens),
                              dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10))
    counts = ops_of(lambda: patched(input_ids=tokens))
    assert counts["posenc.rope.default"] >= 2 and counts["posenc.rope_qk.default"] == 0
    assert counts["aten.cos.default"] == 0


def test_dynamic_ntk_per_layer_type_is_refused():
    config = dict(rotary_models())["gemma3_text"]
    config.rope_parameters["full_attention"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(PT.NotRecognized, match="per-layer-type rope: model.rotary_emb \\(layer type "
                                               "'full_attention'\\): dynamic NTK per layer type"):
        PT.patch(model)
    assert not PT.is_patched(model) and not PT._ROTARY_WRAPPERS


MROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}


@pytest.mark.parametrize("model_type, layer_type, pair_axis", [
    ("qwen2_vl_text", None, [0, 0, 1, 1, 1, 2, 2, 2]),  # consecutive sections, neox
    ("qwen3_vl_text", None, [0, 1, 2, 0, 1, 2, 0, 1]),  # Qwen3-VL's interleaved sections
    ("glm4v_text", None, [0, 0, 1, 1, 1, 2, 2, 2]),  # GLM-4V: sections in GPT-J style tables
    ("cohere_compass_text", "full_attention", [0, 1, 2, 0, 1, 2, 0, 1])])  # rope parameters per layer type
def test_mrope_with_positions_per_axis_matches_hugging_face(model_type, layer_type, pair_axis):
    """M-RoPE (position_ids [3, B, S], one row per axis: time, height, width): the patch reads each pair's axis
    from the rotary module and rotates with rope_qk's pair_axis; positions that differ on every axis give the
    unpatched logits, and [B, S] position ids (every axis the same) and none too."""
    layers = {} if layer_type is None else dict(layer_types=[layer_type] * 2)
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters=MROPE if layer_type is None else {layer_type: MROPE}, **layers)
    model = transformers.AutoModelForCausalLM.from_config(config).eval() \
        if type(config) in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING else \
        transformers.AutoModel.from_config(config).eval()
    patched, record = patched_copy(model)
    rotary = [m for _, m in patched.named_modules() if isinstance(m, PT.RotaryPositions)]
    found = rotary[0].pair_axis if layer_type is None else rotary[0].pair_axes[layer_type]
    assert len(rotary) == 1 and found.tolist() == pair_axis, record
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, VOCAB, (2, 12), generator=generator)
    positions = torch.randint(0, 40, (3, 2, 12), generator=generator)

    def output(m, **inputs):
        with torch.no_grad():
            out = m(input_ids=tokens, **inputs)
        return getattr(out, "logits", None) if getattr(out, "logits", None) is not None else out.last_hidden_state

    for inputs in (dict(position_ids=positions), dict(position_ids=positions[0]), {}):
        torch.testing.assert_close(output(patched, **inputs), output(model, **inputs), atol=LOGITS_ATOL, rtol=0)
    counts = ops_of(lambda: output(patched, position_ids=positions))
    assert counts["posenc.rope_qk.default"] + counts["posenc.qk_norm_rope.default"] == 2
    assert counts["aten.cos.default"] == 0
    PT.unpatch(patched)
    assert not PT._ROTARY_WRAPPERS


@pytest.mark.parametrize("model_type, category", [("nanochat", "non-standard apply_rotary_pos_emb"),
                                                   ("neomme", "multi-axis positions")])
def test_models_outside_the_contract_are_refused_unchanged(model_type, category):
    config = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModel.from_config(config).eval()
    rotary = [m for _, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")]
    with pytest.raises(PT.NotRecognized, match=f'got model_type "{model_type}", which is not recognized: '
                                               f'{category}: ') as refused:
        PT.patch(model)
    assert refused.value.model_type == model_type and refused.value.category == category
    assert not PT.is_patched(model) and not PT._ROTARY_WRAPPERS and rotary == [
        m for _, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")]


def test_a_rotation_that_matches_neither_layout_is_refused():
    """The probe feeds apply_rotary_pos_emb the tables in the rotary module's form: Llama's neox rotation of
    GPT-J style tables (Cohere's) is neither rope_qk layout, nor is Cohere's rotation of neox tables."""
    rotary = posenc.nn.RotaryEmbedding(16, 16, 1e4)
    llama_apply = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    cohere_apply = transformers.models.cohere.modeling_cohere.apply_rotary_pos_emb
    assert PT._check_apply("llama", "llama", llama_apply, rotary, "neox") == "neox"
    assert PT._check_apply("cohere", "cohere", cohere_apply, rotary, "gptj") == "gptj"
    for function, tables in ((llama_apply, "gptj"), (cohere_apply, "neox")):
        with pytest.raises(PT.NotRecognized, match="non-standard apply_rotary_pos_emb: .* with "
                                                   f"{tables} tables: head dim 16: differs from the neox rotation"):
            PT._check_apply("test", "test", function, rotary, tables)


def test_the_wrapper_reads_unsqueeze_dim_as_the_original_binds_it():
    """An apply_rotary_pos_emb that takes position_ids before unsqueeze_dim (older files): the wrapper reads the
    layout from the bound arguments, and gives what the original gives with tables."""
    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise AssertionError("not called for RotaryAngles")

    read = PT._unsqueeze_dim_reader(inspect.signature(apply_rotary_pos_emb))
    q = k = cos = sin = None
    assert read(q, k, cos, sin) == 1 and read(q, k, cos, sin, None, 2) == 2 and read(q, k, cos, sin, None) == 1
    assert read(q, k, cos, sin, unsqueeze_dim=2) == 2 and read(q, k, cos, sin, position_ids=None) == 1
    reference = llama(SCALINGS["default"])
    original = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    patched, _ = patched_copy(reference)
    queries, keys = torch.randn(2, 5, 2, 16), torch.randn(2, 5, 1, 16)  # [B, S, H, D]
    position_ids = torch.arange(5)[None]
    cos, sin = reference.model.rotary_emb(queries, position_ids)
    angles = patched.model.rotary_emb(queries, position_ids)
    wrapper = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    for ours, theirs in zip(wrapper(queries, keys, *angles, unsqueeze_dim=2),
                            original(queries, keys, cos, sin, unsqueeze_dim=2)):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- BLOOM, T5, GPT-2

def test_bloom_alibi_matches_hugging_face():
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    reference = transformers.BloomForCausalLM(config).eval()
    patched, record = patched_copy(reference)
    assert [c.target for c in record.changes] == ["transformer.build_alibi_tensor", "transformer.forward"]
    tokens = torch.randint(3, VOCAB, (2, 13))
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0  # left padding
    real = mask.bool()
    for inputs, compared in ((dict(input_ids=tokens), None), (dict(input_ids=tokens, attention_mask=mask), real)):
        labels = tokens if compared is None else tokens.masked_fill(~real, -100)
        assert_same_model_outputs(reference, patched, inputs, dict(inputs, labels=labels),
                                  dict(input_ids=tokens, attention_mask=mask, max_new_tokens=8), real=compared)
        assert ops_of(lambda: patched(**inputs))["posenc.positions_from_mask.default"] == 1
    # Decoding with a cache and no mask: BLOOM's inline path, sent through posenc by the all-ones mask.
    with torch.no_grad():
        steps = [model(input_ids=tokens[:, :9], use_cache=True) for model in (patched, reference)]
        for _ in range(3):
            following = tokens[:, 9 + _:10 + _]
            steps = [model(input_ids=following, cache=step.cache, use_cache=True)
                     for model, step in zip((patched, reference), steps)]
            torch.testing.assert_close(steps[0].logits, steps[1].logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("padding", ["left", "between"])
def test_bloom_padding_anywhere_matches_hugging_face(padding):
    """BLOOM's bias is the slope times the number of real tokens before each key; with holes in the mask (padding
    between real tokens) it is not a per-row constant away from a column-only bias. The patch gives BLOOM's."""
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    reference = transformers.BloomForCausalLM(config).eval()
    patched, _ = patched_copy(reference)
    tokens = torch.randint(3, VOCAB, (3, 9))
    mask = torch.ones_like(tokens)
    if padding == "left":
        mask[1, :3] = 0
        mask[2, :6] = 0
    else:
        mask[0, 2] = 0  # [1, 1, 0, 1, 1, ...]
        mask[1, 3:6] = 0
        mask[2, 0] = mask[2, 4] = 0
    real = mask.bool()
    inputs = dict(input_ids=tokens, attention_mask=mask)
    assert_same_model_outputs(reference, patched, inputs, dict(inputs, labels=tokens.masked_fill(~real, -100)),
                              dict(inputs, max_new_tokens=6), real=real)
    embeds = reference.transformer.word_embeddings(tokens).detach()
    torch.testing.assert_close(logits(patched, inputs_embeds=embeds, attention_mask=mask)[real],
                               logits(reference, inputs_embeds=embeds, attention_mask=mask)[real],
                               atol=LOGITS_ATOL, rtol=0)


def test_t5_relative_bias_matches_hugging_face():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=2,
                                   num_decoder_layers=2, relative_attention_num_buckets=16,
                                   relative_attention_max_distance=20, dropout_rate=0.0, decoder_start_token_id=0)
    reference = transformers.T5ForConditionalGeneration(config).eval()
    patched, record = patched_copy(reference)
    assert [c.target for c in record.changes] == ["encoder.block.0.layer.0.SelfAttention.compute_bias",
                                                  "decoder.block.0.layer.0.SelfAttention.compute_bias"]
    tokens, targets = torch.randint(3, VOCAB, (2, 25)), torch.randint(3, VOCAB, (2, 9))
    assert_same_model_outputs(reference, patched, dict(input_ids=tokens, decoder_input_ids=targets),
                              dict(input_ids=tokens, labels=targets), dict(input_ids=tokens, max_new_tokens=12))
    counts = ops_of(lambda: patched(input_ids=tokens, labels=targets).loss.backward())
    assert counts["posenc.t5_bias.default"] == 2 and counts["posenc.t5_bias_backward.default"] == 2


def t5_generator():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=64, num_heads=4, num_layers=2,
                                   num_decoder_layers=2, relative_attention_num_buckets=16,
                                   relative_attention_max_distance=20, dropout_rate=0.0, decoder_start_token_id=0,
                                   pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config).eval()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_shapes", "dynamic_shapes"])
def test_t5_exports_for_generation_with_a_static_cache(dynamic):
    """transformers' test_torch_export_generate_{static,dynamic}_static_cache: prefill and decode captured from
    generate() with a static cache, each exported with torch.export. A static cache's length is a tensor; the
    patched bias computes the query positions from it (a number read from it would fail the export)."""
    exporters = pytest.importorskip("transformers.exporters")
    from transformers.exporters.utils import decompose_for_generation

    reference = t5_generator()
    patched, _ = patched_copy(reference)
    tokens = torch.randint(3, VOCAB, (2, 9))
    stages = decompose_for_generation(patched, dict(input_ids=tokens, attention_mask=torch.ones_like(tokens)),
                                      generation_config=transformers.GenerationConfig(cache_implementation="static",
                                                                                      max_cache_len=16))
    posenc_ops = {}
    for stage, (model, inputs) in stages.items():
        program, _ = exporters.DynamoExporter().export_program(model, inputs, exporters.DynamoConfig(dynamic=dynamic))
        posenc_ops[stage] = {str(node.target) for node in program.graph.nodes if "posenc" in str(node.target)}
        with torch.no_grad():
            ours = program.module()(**copy.deepcopy(inputs))["logits"]
            theirs = reference(**copy.deepcopy(inputs)).logits
        torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0, msg=stage)
    assert posenc_ops == {"prefill": {"posenc.t5_bias.default"}, "decode": {"posenc.relative_position_bucket.default"}}


@pytest.mark.parametrize("family, cache", [("t5", "static"), ("gpt2", "static"), ("gpt2", "dynamic")])
def test_compiled_decoding_recompiles_no_more_than_hugging_face(family, cache):
    """torch.compile over greedy decoding steps: the patched model compiles no more graphs than the unpatched one
    and breaks no graph. Reading the cache length as a Python number would recompile at each step (a static
    cache's length is a tensor, a dynamic one's a symbolic size)."""
    from torch._dynamo.utils import counters

    reference = t5_generator() if family == "t5" else gpt2()
    patched, _ = patched_copy(reference)
    tokens = torch.randint(3, VOCAB, (2, 9))

    def decode(model):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="eager")
        caches = [transformers.StaticCache(config=model.config, max_cache_len=20) if cache == "static"
                  else transformers.DynamicCache() for _ in range(2)]
        if family == "t5":
            encoded = model.encoder(input_ids=tokens)
            inputs = dict(encoder_outputs=encoded, cache=transformers.EncoderDecoderCache(*caches))
            step = torch.zeros(2, 1, dtype=torch.long)
        else:
            inputs, step = dict(cache=caches[0]), tokens
        steps = []
        for _ in range(5):
            out = compiled(**{("decoder_input_ids" if family == "t5" else "input_ids"): step}, **inputs,
                           use_cache=True).logits[:, -1]
            steps.append(out)
            step = out.argmax(-1, keepdim=True)
        return torch.stack(steps), counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    with torch.no_grad():
        theirs, their_graphs, their_breaks = decode(reference)
        ours, our_graphs, our_breaks = decode(patched)
    torch._dynamo.reset()
    torch.testing.assert_close(ours, theirs, atol=LOGITS_ATOL, rtol=0)
    assert our_graphs <= their_graphs and our_breaks == their_breaks == 0


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=40, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_fused_embeddings_match_hugging_face():
    reference = gpt2()
    patched, record = patched_copy(reference)
    tokens = torch.randint(3, VOCAB, (2, 13))
    mask = torch.ones_like(tokens)
    mask[0, :4] = 0
    for inputs in (dict(input_ids=tokens), dict(input_ids=tokens, attention_mask=mask,
                                                position_ids=(mask.cumsum(-1) - 1).clamp(min=0))):
        real = inputs.get("attention_mask", torch.ones_like(tokens)).bool()
        assert_same_model_outputs(reference, patched, inputs, dict(inputs, labels=tokens.masked_fill(~real, -100)),
                                  dict(input_ids=tokens, attention_mask=mask, max_new_tokens=10), real=real)
        counts = ops_of(lambda: patched(**inputs))
        assert counts["posenc.embed_learned.default"] == 1 and counts["aten.embedding.default"] == 0
        assert counts["aten.add.Tensor"] == ops_of(lambda: reference(**inputs))["aten.add.Tensor"] - 1  # wte + wpe


def test_gpt2_token_type_ids_and_inputs_embeds_keep_working():
    reference = gpt2()
    patched, _ = patched_copy(reference)
    tokens = torch.randint(3, VOCAB, (2, 9))
    types_ = torch.randint(0, 2, (2, 9))
    torch.testing.assert_close(logits(patched, input_ids=tokens, token_type_ids=types_),
                               logits(reference, input_ids=tokens, token_type_ids=types_), atol=LOGITS_ATOL, rtol=0)
    embeds = reference.transformer.wte(tokens).detach()  # no token ids: Hugging Face's own path, unfused
    torch.testing.assert_close(logits(patched, inputs_embeds=embeds), logits(reference, inputs_embeds=embeds),
                               atol=0, rtol=0)
    assert torch.equal(patched.transformer.wpe(torch.arange(5)), reference.transformer.wpe(torch.arange(5)))


@pytest.mark.parametrize("shape", [(7,), (2, 7), (2, 3, 7)], ids=["1d", "2d", "3d"])
def test_gpt2_input_ids_of_every_shape_match_hugging_face(shape):
    """GPT-2 takes input_ids [S], [B, S] and, for GPT2DoubleHeadsModel, [B, choices, S]: it flattens them to
    [-1, S] and gives its outputs the input's leading shape. The patched model gives the same shapes and values,
    with and without position_ids and a cache."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=40, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    reference = transformers.GPT2DoubleHeadsModel(config).eval()
    patched, _ = patched_copy(reference)
    tokens = torch.randint(3, VOCAB, shape)
    calls = [dict(input_ids=tokens), dict(input_ids=tokens, position_ids=torch.arange(3, 3 + shape[-1])[None])]
    if len(shape) == 3:  # the multiple-choice head reads one token per choice
        calls.append(dict(input_ids=tokens, mc_token_ids=torch.randint(0, shape[-1], shape[:-1])))
    with torch.no_grad():
        for inputs in calls:
            ours, theirs = patched(**inputs), reference(**inputs)
            assert ours.logits.shape == theirs.logits.shape == shape + (VOCAB,)
            assert ours.mc_logits.shape == theirs.mc_logits.shape
            torch.testing.assert_close(ours.logits, theirs.logits, atol=0, rtol=0)
            torch.testing.assert_close(ours.mc_logits, theirs.mc_logits, atol=0, rtol=0)
        # Decoding: the first 4 tokens, then the rest with the cache (positions continue at 4).
        first = [model(input_ids=tokens[..., :4], use_cache=True) for model in (patched, reference)]
        ours, theirs = [model(input_ids=tokens[..., 4:], cache=out.cache)
                        for model, out in zip((patched, reference), first)]
        assert ours.logits.shape == theirs.logits.shape == shape[:-1] + (3, VOCAB)
        torch.testing.assert_close(ours.logits, theirs.logits, atol=0, rtol=0)
    counts = ops_of(lambda: patched(input_ids=tokens))
    assert counts["posenc.embed_learned.default"] == 1 and counts["aten.embedding.default"] == 0


@pytest.mark.parametrize("build", [lambda: llama(SCALINGS["longrope"]), gpt2], ids=["llama", "gpt2"])
def test_patched_models_compile_fullgraph(build):
    """RotaryAngles and GPT-2's marker are traced by torch.compile: one graph, the eager logits."""
    reference = build()
    patched, _ = patched_copy(reference)
    tokens = torch.randint(3, VOCAB, (2, 20))
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=tokens).logits, logits(reference, input_ids=tokens),
                                   atol=LOGITS_ATOL, rtol=0)


# ---------------------------------------------------------------- rotary: q_norm/k_norm fused into the rotation

QK_NORM_CONVENTIONS = {"qwen3": "llama", "qwen3_moe": "llama", "gemma3_text": "gemma", "olmo2": "olmo2",
                       "olmo3": "olmo2"}


def qk_norm_model(model_type, **changes):
    """A tiny model with q_norm and k_norm whose weights are random: at their initial ones (zeros for Gemma's
    1 + w) a wrong weight convention would go unseen."""
    if model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=SEQ_LIMIT, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    else:
        config = dict(rotary_models())[model_type]
    for key, value in changes.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    return model


def fused_layers(record):
    return [c.target.rpartition(".")[0] for c in record.changes if "applied by the rotation" in c.replacement]


@pytest.mark.parametrize("model_type", list(QK_NORM_CONVENTIONS))
def test_qk_norm_models_fuse_the_norms_into_the_rotation(model_type):
    """Qwen3, Qwen3-MoE, Gemma 3, OLMo 2 and OLMo 3: each layer's q_norm, k_norm and rotation are one
    qk_norm_rope call (forward and backward) in the convention of the model's norm, with the unpatched logits,
    gradients (the norm weights' included) and greedy generation."""
    reference = qk_norm_model(model_type)
    patched, record = patched_copy(reference)
    attentions = [path for path, m in patched.named_modules() if hasattr(m, "q_norm")]
    assert fused_layers(record) == attentions and len(attentions) == 2 and not record.notes, record
    assert f"({QK_NORM_CONVENTIONS[model_type]} convention" in str(record)
    assert {f"{path}.{norm}.forward" for path in attentions for norm in ("q_norm", "k_norm")} <= {
        c.target for c in record.changes}
    tokens = torch.randint(3, VOCAB, (2, 20))
    prompt = tokens[:, :12]
    assert_same_model_outputs(reference, patched, dict(input_ids=tokens), dict(input_ids=tokens, labels=tokens),
                              dict(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10))
    step = ops_of(lambda: patched(input_ids=tokens, labels=tokens).loss.backward())
    assert step["posenc.qk_norm_rope.default"] == step["posenc.qk_norm_rope_backward.default"] == 2
    assert step["posenc.rope_qk.default"] == step["aten.cos.default"] == 0
    ours, theirs = [ops_of(lambda m=m: logits(m, input_ids=tokens)) for m in (patched, reference)]
    for op in ("aten.rsqrt.default", "aten.pow.Tensor_Scalar", "aten.mean.dim"):
        assert ours[op] == theirs[op] - 4, op  # two norms a layer run no more: the other RMSNorms still do


def test_fused_qk_norms_in_bfloat16():
    """A bfloat16 model with fused norms rounds differently from Hugging Face's (one rounding after the rotation
    where it rounds three times): its logits are within bfloat16's rounding of the unpatched ones, and no farther
    from the float32 model's."""
    for model_type in ("qwen3", "gemma3_text", "olmo2"):
        exact = qk_norm_model(model_type)
        reference = copy.deepcopy(exact).to(torch.bfloat16)
        patched, record = patched_copy(reference)
        assert len(fused_layers(record)) == 2 and not record.notes, record
        tokens = torch.randint(3, VOCAB, (2, 20))
        truth = logits(exact, input_ids=tokens)
        ours, theirs = logits(patched, input_ids=tokens).float(), logits(reference, input_ids=tokens).float()
        torch.testing.assert_close(ours, theirs, atol=0.01, rtol=0, msg=model_type)  # measured: 0.004
        assert (ours - truth).abs().mean() <= 1.25 * (theirs - truth).abs().mean(), model_type


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2"])
def test_fused_qk_norms_compile_fullgraph(model_type):
    """torch.compile(fullgraph=True) traces the fused layers: one graph holding one qk_norm_rope per layer, the
    eager logits, and a compiled training step gives the unpatched gradients."""
    reference = qk_norm_model(model_type)
    patched, _ = patched_copy(reference)
    tokens = torch.randint(3, VOCAB, (2, 20))
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.backends.debugging.aot_eager(graph, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=tokens).logits, logits(reference, input_ids=tokens),
                                   atol=LOGITS_ATOL, rtol=0)
    assert len(graphs) == 1
    calls = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum("qk_norm_rope" in call for call in calls) == 2 and not any("rope_qk" in call for call in calls)
    patched.train()
    compiled(input_ids=tokens, labels=tokens).loss.backward()
    ours = {name: p.grad for name, p in patched.named_parameters()}
    theirs = training_grads(reference, input_ids=tokens, labels=tokens)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)


def test_unpatch_restores_a_model_with_fused_qk_norms():
    """unpatch gives back the norm modules and attention forwards (no attribute left behind), the state dict is
    the same throughout, and a deep copy of the patched model stays fused on its own weights."""
    model = qk_norm_model("olmo2")
    tokens = torch.randint(3, VOCAB, (2, 9))
    expected = logits(model, input_ids=tokens)

    def state():
        return {name: (type(m), set(vars(m))) for name, m in model.named_modules()}

    before, weights = state(), {k: v.clone() for k, v in model.state_dict().items()}
    PT.patch(model)
    assert model.state_dict().keys() == weights.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    duplicate = copy.deepcopy(model)
    model(input_ids=tokens, labels=tokens).loss.backward()  # a call in between
    model.zero_grad(set_to_none=True)
    PT.unpatch(model)
    assert state() == before and torch.equal(logits(model, input_ids=tokens), expected)
    with torch.no_grad():  # the copy reads its own weights, not the original's
        model.model.layers[0].self_attn.q_norm.weight.mul_(3.0)
    counts = ops_of(lambda: logits(duplicate, input_ids=tokens))
    assert counts["posenc.qk_norm_rope.default"] == 2
    torch.testing.assert_close(logits(duplicate, input_ids=tokens), expected, atol=LOGITS_ATOL, rtol=0)
    PT.unpatch(duplicate)
    assert all("forward" not in vars(m) for m in duplicate.modules())


def _qwen3_attention_doubling_q_after_its_norm(self, hidden_states, position_embeddings, attention_mask=None,
                                               **kwargs):
    """Qwen3's attention, but q doubled between q_norm and the rotation: a norm moved into the rotation would
    normalize the doubling away."""
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2) * 2
    k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    q, k = transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb(q, k, *position_embeddings)
    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                           v.repeat_interleave(groups, 1), is_causal=True)
    return self.o_proj(out.transpose(1, 2).flatten(2)), None


def test_qk_norms_that_cannot_move_into_the_rotation_are_left_with_the_reason():
    """The probe call refuses a layer whose fused output is not the unfused one (the rest of the model is fused),
    and norms that are not RMSNorms (Cohere's LayerNorm per head) are left as they are; the record says why."""
    qwen3 = transformers.models.qwen3.modeling_qwen3
    reference = qk_norm_model("qwen3")
    reference.model.layers[1].self_attn.__class__ = type(
        "DoublingAttention", (qwen3.Qwen3Attention,),
        {"forward": _qwen3_attention_doubling_q_after_its_norm, "__module__": qwen3.__name__})
    patched, record = patched_copy(reference)
    assert fused_layers(record) == ["model.layers.0.self_attn"]
    assert len(record.notes) == 1 and re.fullmatch(
        r"q_norm/k_norm of model.layers.1.self_attn left to Hugging Face: the fused layer's probe output differs "
        r"from the unfused one by \d\.\de-0[12] \(relative\)", record.notes[0]), record.notes
    assert "_posenc_qk_norm" not in vars(patched.model.layers[1].self_attn)
    tokens = torch.randint(3, VOCAB, (2, 20))
    torch.testing.assert_close(logits(patched, input_ids=tokens), logits(reference, input_ids=tokens),
                               atol=LOGITS_ATOL, rtol=0)
    counts = ops_of(lambda: logits(patched, input_ids=tokens))
    assert counts["posenc.qk_norm_rope.default"] == counts["posenc.rope_qk.default"] == 1
    cohere = qk_norm_model("cohere", use_qk_norm=True)
    patched, record = patched_copy(cohere)
    assert not fused_layers(record) and record.notes == [
        "q_norm/k_norm of model.layers.0.self_attn, model.layers.1.self_attn left to Hugging Face: q_norm "
        "(CohereLayerNorm) has no 1-D weight"]
    torch.testing.assert_close(logits(patched, input_ids=tokens), logits(cohere, input_ids=tokens),
                               atol=LOGITS_ATOL, rtol=0)


def test_a_fused_attention_given_cos_sin_tables_runs_its_own_norms():
    """Angles carry the layer's norms; cos/sin tables from elsewhere cannot, so that call runs the norm modules."""
    reference = qk_norm_model("gemma3_text")
    patched, _ = patched_copy(reference)
    hidden = torch.randn(2, 6, 32)
    tables = reference.model.rotary_emb(hidden, torch.arange(6)[None], "sliding_attention")
    with torch.no_grad():
        ours = patched.model.layers[0].self_attn(hidden, tables, None)[0]
        theirs = reference.model.layers[0].self_attn(hidden, tables, None)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert "forward" in vars(patched.model.layers[0].self_attn.q_norm)  # fused again for the angles


# ---------------------------------------------------------------- unpatch, records, errors

LLAMA_FILE = "transformers.models.llama.modeling_llama"


def test_unpatch_restores_every_change_and_the_wrapper_spares_unpatched_models():
    gc.collect()  # patched models of earlier tests release the wrapper when collected
    assert LLAMA_FILE not in PT._ROTARY_WRAPPERS
    first, second = llama(SCALINGS["default"]), llama(SCALINGS["default"])
    modeling = transformers.models.llama.modeling_llama
    original_function, original_rotary = modeling.apply_rotary_pos_emb, second.model.rotary_emb
    tokens = torch.randint(0, VOCAB, (2, 10))
    expected_first, expected_second = logits(first, input_ids=tokens), logits(second, input_ids=tokens)
    state = {k: v.clone() for k, v in second.state_dict().items()}
    PT.patch(first)
    record = PT.patch(second)
    assert isinstance(second.model.rotary_emb, PT.RotaryPositions) and PT.is_patched(second)
    assert second.state_dict().keys() == state.keys()
    assert all(torch.equal(second.state_dict()[k], v) for k, v in state.items())
    PT.unpatch(first)  # the wrapper stays while `second` needs it; `first` is plain Hugging Face again
    assert modeling.apply_rotary_pos_emb is not original_function
    assert torch.equal(logits(first, input_ids=tokens), expected_first)
    assert PT.unpatch(second) is record and not PT.is_patched(second)
    assert modeling.apply_rotary_pos_emb is original_function and second.model.rotary_emb is original_rotary
    assert torch.equal(logits(second, input_ids=tokens), expected_second)


def test_a_patched_model_garbage_collected_releases_the_wrapper():
    gc.collect()
    original_function = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    model = llama(SCALINGS["default"])
    PT.patch(model)
    assert transformers.models.llama.modeling_llama.apply_rotary_pos_emb is not original_function
    del model
    gc.collect()
    assert transformers.models.llama.modeling_llama.apply_rotary_pos_emb is original_function


def bloom():
    return transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=2))


def t5():
    return transformers.T5Model(transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=16, num_heads=2,
                                                      num_layers=1, decoder_start_token_id=0))


@pytest.mark.parametrize("build", [gpt2, bloom], ids=["gpt2", "bloom"])
def test_patched_forward_keeps_its_signature(build):
    """The patched forward is an instance attribute with the class method's signature, name and docstring:
    transformers' test_inputs_embeds (and generation) read its parameters; without them it skips the model."""
    reference = build()
    patched, record = patched_copy(reference)
    for change in record.changes:
        owner, _, method = change.target.rpartition(".")
        ours, theirs = getattr(patched.get_submodule(owner), method), getattr(reference.get_submodule(owner), method)
        assert inspect.signature(ours) == inspect.signature(theirs), change.target
        assert ours.__name__ == theirs.__name__ and ours.__doc__ == theirs.__doc__, change.target
    base = patched.base_model
    assert "inputs_embeds" in inspect.signature(base.forward).parameters
    tokens = torch.randint(3, VOCAB, (2, 9))
    embeds = base.get_input_embeddings()(tokens).detach()
    with torch.no_grad():
        torch.testing.assert_close(base(inputs_embeds=embeds).last_hidden_state,
                                   reference.base_model(inputs_embeds=embeds).last_hidden_state,
                                   atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("build", [lambda: llama(SCALINGS["dynamic"]), bloom, t5, gpt2],
                         ids=["llama", "bloom", "t5", "gpt2"])
def test_unpatch_leaves_the_objects_as_they_were(build):
    model = build()
    tokens = torch.randint(3, VOCAB, (2, 7))
    inputs = dict(input_ids=tokens, decoder_input_ids=tokens) if isinstance(model, transformers.T5Model) else dict(
        input_ids=tokens)

    def state():
        return {name: (type(m), dict(vars(m)), len(m._forward_pre_hooks), len(m._forward_hooks))
                for name, m in model.named_modules()}

    before = state()
    PT.patch(model)
    model(**inputs)  # a call in between: nothing it leaves behind may survive unpatch
    PT.unpatch(model)
    after = state()
    assert before.keys() == after.keys()
    for name in before:
        assert before[name][0] is after[name][0] and before[name][2:] == after[name][2:], name
        assert before[name][1].keys() == after[name][1].keys(), name


@pytest.mark.parametrize("build", [lambda: llama(SCALINGS["default"]), gpt2], ids=["llama", "gpt2"])
def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own(build):
    gc.collect()
    model = build()
    tokens = torch.randint(3, VOCAB, (2, 9))
    expected = logits(model, input_ids=tokens)
    PT.patch(model)
    duplicate = copy.deepcopy(model)
    assert PT.is_patched(duplicate)
    PT.unpatch(model)  # the copy stays patched, and keeps the rotary wrapper it needs
    counts = ops_of(lambda: logits(duplicate, input_ids=tokens))
    assert counts["posenc.rope_qk.default"] + counts["posenc.embed_learned.default"] > 0
    torch.testing.assert_close(logits(duplicate, input_ids=tokens), expected, atol=LOGITS_ATOL, rtol=0)
    PT.unpatch(duplicate)
    assert torch.equal(logits(duplicate, input_ids=tokens), expected) and LLAMA_FILE not in PT._ROTARY_WRAPPERS


def test_record_lists_the_changes():
    record = PT.patch(gpt2())
    text = str(record)
    assert text.startswith("posenc patch of a gpt2 model (learned):")
    assert "transformer.forward" in text and "posenc.embed_learned" in text
    assert [c.target for c in record.changes] == ["transformer.wte.forward", "transformer.wpe.forward",
                                                  "transformer.forward"]


def test_errors():
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=VOCAB, hidden_size=16, ffn_dim=32,
                                                             num_hidden_layers=1, num_attention_heads=2,
                                                             word_embed_proj_dim=16))
    with pytest.raises(PT.NotRecognized, match='got model_type "opt", which is not recognized: no rotary module: '
                                               'this OPTForCausalLM has no \\*RotaryEmbedding submodule') as refused:
        PT.patch(opt)
    assert isinstance(refused.value, ValueError) and refused.value.category == "no rotary module"
    assert "known to work: llama, mistral, mixtral, qwen2, qwen3, gemma, gemma2, phi3, gpt_neox, stablelm, " \
           "bloom, t5, gpt2" in str(refused.value) and not PT.is_patched(opt)
    with pytest.raises(ValueError, match="got a Linear without a config.model_type"):
        PT.patch(torch.nn.Linear(2, 2))
    model = llama(SCALINGS["default"])
    with pytest.raises(ValueError, match="the model is not patched"):
        PT.unpatch(model)
    PT.patch(model)
    with pytest.raises(RuntimeError, match="this llama model is already patched; call unpatch"):
        PT.patch(model)
    PT.unpatch(model)


# ---------------------------------------------------------------- the documentation's example

def test_documentation_example_runs():
    """docs/integrations-transformers.md shows this file's first python block; it runs as written."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "integrations-transformers.md"
    example = re.search(r"```python\n(.*?)```", doc.read_text(), re.S).group(1)
    exec(compile(example, str(doc), "exec"), {})


# ---------------------------------------------------------------- DINOv3: rotary by patch centres

def dinov3(**overrides):
    from transformers import DINOv3ViTConfig, DINOv3ViTModel
    torch.manual_seed(0)
    config = DINOv3ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                             image_size=48, patch_size=8, num_register_tokens=4, pos_embed_shift=0.1,
                             pos_embed_jitter=1.5, pos_embed_rescale=2.0, **overrides)
    return DINOv3ViTModel(config).eval()


@pytest.mark.parametrize("training", [False, True])
def test_dinov3_matches_hugging_face(training):
    """A patched DINOv3 rotates q and k of its patch tokens with rope_qk by posenc's patch centres (the same
    augmentations drawn in training with the same seed), its cls and register tokens left alone: hidden states and
    gradients as Hugging Face's within the float32 rounding of its angles."""
    model = dinov3()
    patched = copy.deepcopy(model)
    modeling = transformers.models.dinov3_vit.modeling_dinov3_vit
    gc.collect()  # patched models of earlier tests release the wrapper when collected
    original = modeling.apply_rotary_pos_emb
    record = PT.patch(patched)
    assert modeling.apply_rotary_pos_emb is not original
    assert isinstance(patched.rope_embeddings, PT.PatchCenterAngles) and record.family == "rotary (patch centres)"
    pixels = torch.randn(2, 3, 48, 40)
    results = []
    for m in (model, patched):
        m.train(training)
        torch.manual_seed(7)
        out = m(pixel_values=pixels).last_hidden_state
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (expected, expected_grads), (actual, actual_grads) = results
    torch.testing.assert_close(actual, expected, atol=LOGITS_ATOL, rtol=0)
    assert actual_grads.keys() == expected_grads.keys() and len(actual_grads) > 10
    for name, grad in actual_grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)
    assert PT.unpatch(patched) is record
    assert type(patched.rope_embeddings).__name__ == "DINOv3ViTRopePositionEmbedding"
    assert modeling.apply_rotary_pos_emb is original
