"""posenc.integrations.transformers on vision models whose learned position table is resized to the image's patch
grid (ViT, DINOv2, SigLIP, ...): tiny random models built from configs, nothing downloaded.

Each check runs a patched copy against the unpatched original: hidden states (float32, <= 1e-5 abs) at the configured
image size, at a non-square one and at a smaller one; the gradients of every parameter, the position table's
included (<= 1e-5 relative + 1e-6 of the parameter's largest gradient); bfloat16 within the distance of Hugging
Face's own bfloat16 model to its float32 one; unpatch; torch.compile(fullgraph=True); and, through a dispatch mode,
that one add_resampled_learned does the resize and the add (no F.interpolate).
"""
import collections
import copy
import importlib
import inspect
import typing
from pathlib import Path

import pytest
import torch

import posenc  # noqa: F401

from helpers import OpCounter

transformers = pytest.importorskip("transformers")
PT = pytest.importorskip("posenc.integrations.transformers")

ATOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5
IMAGE, PATCH = 32, 8  # a 4 x 4 grid of patches
SIZES = {"configured": (32, 32), "non-square": (40, 24), "smaller": (16, 16)}  # grids 4x4, 5x3, 2x2

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(config_class, model_class, **changes):
    torch.manual_seed(0)
    config = config_class(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE,
                          patch_size=PATCH, **changes)
    model = model_class(config).eval()
    with torch.no_grad():  # tables far from zero and from each other, so that a wrong resize shows
        for name, parameter in model.named_parameters():
            if "position_embedding" in name:
                parameter.normal_()
    return model


def vit():
    return tiny(transformers.ViTConfig, transformers.ViTModel, intermediate_size=64)


def dinov2():
    return tiny(transformers.Dinov2Config, transformers.Dinov2Model, mlp_ratio=2)


def dinov2_with_registers():  # bicubic with antialias, register tokens inserted after the add
    return tiny(transformers.Dinov2WithRegistersConfig, transformers.Dinov2WithRegistersModel, mlp_ratio=2,
                num_register_tokens=2)


def siglip():  # no cls row: the table is the grid alone, an nn.Embedding
    return tiny(transformers.SiglipVisionConfig, transformers.SiglipVisionModel, intermediate_size=64)


def clip():
    return tiny(transformers.CLIPVisionConfig, transformers.CLIPVisionModel, intermediate_size=64)


MODELS = {"vit": vit, "dinov2": dinov2, "dinov2_with_registers": dinov2_with_registers, "siglip": siglip,
          "clip": clip}
MODES = {"vit": ("bicubic", False), "dinov2": ("bicubic", False), "dinov2_with_registers": ("bicubic", True),
         "siglip": ("bicubic", False), "clip": ("bicubic", False)}


def takes_flag(model):
    return "interpolate_pos_encoding" in inspect.signature(type(model).forward).parameters


def run(model, pixels, interpolate=True):
    options = {"interpolate_pos_encoding": interpolate} if takes_flag(model) else {}
    return model(pixel_values=pixels, **options).last_hidden_state


def pixels_of(size, batch=2, dtype=torch.float32):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(sum(size))).to(dtype)


def gradients(model, pixels):
    model.zero_grad(set_to_none=True)
    out = run(model, pixels)
    head = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * head).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_hidden_states_and_gradients_match_hugging_face(build, size):
    reference = build()
    patched = copy.deepcopy(reference)
    record = PT.patch(patched)
    assert record.family == "learned (resized to the image grid)"
    pixels = pixels_of(SIZES[size])
    with torch.no_grad():
        ours, theirs = run(patched, pixels), run(reference, pixels)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    our_grads, their_grads = gradients(patched, pixels), gradients(reference, pixels)
    assert our_grads.keys() == their_grads.keys()
    assert any("position_embedding" in name for name in our_grads)
    largest = max(float(grad.abs().max()) for grad in their_grads.values())
    for name, grad in their_grads.items():
        if name.endswith("k_proj.bias"):
            # zero in exact arithmetic (softmax ignores a shift that every key shares), so both sides hold only the
            # rounding of the attention's gradients, which differs with the CPU's matrix kernels (SigLIP's reached
            # 1.3e-6 apart on a Zen 2): each bounded by the model's largest gradient instead of compared
            for side in (our_grads[name], grad):
                assert float(side.abs().max()) <= GRAD_ATOL * largest, name
            continue
        # the absolute part scales with the parameter's largest gradient: Hugging Face resizes in float32, posenc
        # in float64, and the 1e-7 between the tables reaches a gradient of 1000 (the register tokens') as 1e-4
        atol = GRAD_ATOL * max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(our_grads[name], grad, atol=atol, rtol=GRAD_RTOL, msg=name)


@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_the_record_names_the_table_and_its_interpolation(build):
    model = build()
    record = PT.patch(model)
    mode, antialias = MODES[next(k for k, v in MODELS.items() if v is build)]
    assert [change.target.rsplit(".", 1)[-1] for change in record.changes] == ["interpolate_pos_encoding", "forward"]
    described = record.changes[0].replacement
    assert f"grid 4x4, patch 8x8, mode={mode}" in described and ("antialias=True" in described) == antialias
    assert str(record).startswith(f"posenc patch of a {model.config.model_type} model (learned (resized to the "
                                  f"image grid)):")
    PT.unpatch(model)


@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_the_configured_size_is_bit_exact(build):
    """At the configured size the resize is the identity: the embeddings are Hugging Face's bit for bit, with
    interpolate_pos_encoding True and False."""
    reference = build()
    patched = copy.deepcopy(reference)
    PT.patch(patched)
    pixels = pixels_of(SIZES["configured"])
    for interpolate in ([True, False] if takes_flag(reference) else [True]):
        options = {"interpolate_pos_encoding": interpolate} if takes_flag(reference) else {}
        with torch.no_grad():
            ours, theirs = patched.embeddings(pixels, **options), reference.embeddings(pixels, **options)
        assert torch.equal(ours, theirs), interpolate
        counts = ops_of(lambda: patched.embeddings(pixels, **options))
        assert counts["posenc.add_resampled_learned.default"] == 1, interpolate


def ops_of(fn):
    with OpCounter() as counter:
        fn()
    return counter.counts


def resizes(counts):
    return {op: n for op, n in counts.items() if "upsample" in op or "interpolate" in op}


@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_one_posenc_op_resizes_and_adds(build):
    """The patched forward calls add_resampled_learned once and F.interpolate never, forward and backward."""
    reference = build()
    patched = copy.deepcopy(reference)
    PT.patch(patched)
    pixels = pixels_of(SIZES["non-square"])
    assert resizes(ops_of(lambda: run(reference, pixels)))  # Hugging Face resizes with F.interpolate
    counts = ops_of(lambda: run(patched, pixels).square().sum().backward())
    assert counts["posenc.add_resampled_learned.default"] == 1
    assert not resizes(counts)
    assert counts["posenc.resample_learned_backward.default"] == 1


def test_bfloat16_is_as_close_as_hugging_face():
    """bfloat16: the patched model is as far from the float32 model as Hugging Face's bfloat16 model is (posenc
    resizes in float64 and rounds once; ViT resizes in bfloat16, DINOv2 in float32)."""
    for build in MODELS.values():
        reference = build()
        pixels = pixels_of(SIZES["non-square"])
        with torch.no_grad():
            exact = run(reference, pixels)
            theirs = run(reference.to(torch.bfloat16), pixels.to(torch.bfloat16)).float()
            patched = copy.deepcopy(reference)
            PT.patch(patched)
            ours = run(patched, pixels.to(torch.bfloat16)).float()
        their_error, our_error = (theirs - exact).abs().max(), (ours - exact).abs().max()
        assert our_error <= 1.25 * their_error, (build.__name__, our_error, their_error)
        torch.testing.assert_close(ours, theirs, atol=4 * float(their_error), rtol=0)


@pytest.mark.parametrize("build", [vit, siglip], ids=["vit", "siglip"])
def test_interpolate_pos_encoding_false_behaves_as_hugging_face(build):
    """interpolate_pos_encoding=False at another size: ViT raises its error, SigLIP adds the table unresized when
    the token count is the table's (a 2 x 8 grid for a 4 x 4 table) and fails to broadcast otherwise."""
    reference = build()
    patched = copy.deepcopy(reference)
    PT.patch(patched)
    same_count = pixels_of((16, 64))
    other = pixels_of((40, 24))
    if build is vit:
        for pixels in (same_count, other):
            for model in (reference, patched):
                with pytest.raises(ValueError, match=r"Input image size \(\d+\*\d+\) doesn't match model \(32\*32\)"):
                    run(model, pixels, interpolate=False)
    else:
        with torch.no_grad():
            torch.testing.assert_close(run(patched, same_count, interpolate=False),
                                       run(reference, same_count, interpolate=False), atol=0, rtol=0)
        for model in (reference, patched):
            with pytest.raises(RuntimeError, match="must match the size of tensor b"):
                run(model, other, interpolate=False)


@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_unpatch_restores_hugging_face(build):
    model = build()
    pixels = pixels_of(SIZES["non-square"])
    with torch.no_grad():
        expected = run(model, pixels)
    before = dict(vars(model.embeddings))
    record = PT.patch(model)
    with torch.no_grad():
        run(model, pixels)
    assert PT.unpatch(model) is record and not PT.is_patched(model)
    assert dict(vars(model.embeddings)).keys() == before.keys()
    with torch.no_grad():
        assert torch.equal(run(model, pixels), expected)
    assert resizes(ops_of(lambda: run(model, pixels)))


@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_a_direct_call_of_interpolate_pos_encoding_returns_the_table(build):
    """Called outside the embeddings' forward, the patched method returns the resized table, as Hugging Face's."""
    reference = build()
    patched = copy.deepcopy(reference)
    PT.patch(patched)
    embeddings = torch.zeros(1, 64, 32)
    with torch.no_grad():
        ours = patched.embeddings.interpolate_pos_encoding(embeddings, 40, 24)
        theirs = reference.embeddings.interpolate_pos_encoding(embeddings, 40, 24)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("build", MODELS.values(), ids=list(MODELS))
def test_patched_embeddings_compile_fullgraph(build):
    """ResampledTable is traced by torch.compile: one graph (fullgraph=True), with the posenc op and no
    resize, giving the eager output at two sizes."""
    reference = build()
    patched = copy.deepcopy(reference)
    PT.patch(patched)
    ops = collections.Counter()

    def backend(graph, example_inputs):
        ops.update(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(patched.embeddings, fullgraph=True, backend=backend)
    options = {"interpolate_pos_encoding": True} if takes_flag(reference) else {}
    for size in ("configured", "non-square"):
        pixels = pixels_of(SIZES[size])
        with torch.no_grad():
            torch.testing.assert_close(compiled(pixels, **options), reference.embeddings(pixels, **options),
                                       atol=ATOL, rtol=0)
    assert any("add_resampled_learned" in op for op in ops), ops
    assert not any("interpolate" in op or "upsample" in op for op in ops), ops
    torch._dynamo.reset()


def test_a_table_used_other_than_added_is_refused_unchanged():
    """BLIP slices and casts the resized table before adding it: refused with that reason, nothing changed."""
    torch.manual_seed(0)
    config = transformers.BlipVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64, image_size=IMAGE, patch_size=PATCH)
    model = transformers.BlipVisionModel(config).eval()
    before = dict(vars(model.embeddings))
    with pytest.raises(PT.NotRecognized, match="resized learned table: embeddings.forward uses the resized table "
                                               "other than adding it") as refused:
        PT.patch(model)
    assert refused.value.category == "resized learned table" and not PT.is_patched(model)
    assert dict(vars(model.embeddings)).keys() == before.keys()


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_dual_encoders_patch_their_vision_tables(family):
    """CLIPModel and SiglipModel: the vision embeddings are patched, the text model (a learned table it does not
    resize) stays Hugging Face's; the image-text logits are the unpatched ones."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    config_class, model_class = {"clip": (transformers.CLIPConfig, transformers.CLIPModel),
                                 "siglip": (transformers.SiglipConfig, transformers.SiglipModel)}[family]
    config = config_class(text_config=dict(sizes, vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=1),
                          vision_config=dict(sizes, image_size=IMAGE, patch_size=PATCH))
    reference = model_class(config).eval()
    patched = copy.deepcopy(reference)
    record = PT.patch(patched)
    assert [change.target for change in record.changes] == ["vision_model.embeddings.interpolate_pos_encoding",
                                                            "vision_model.embeddings.forward"]
    inputs = dict(input_ids=torch.randint(2, 64, (2, 7)), pixel_values=pixels_of(SIZES["non-square"]),
                  interpolate_pos_encoding=True)
    with torch.no_grad():
        ours, theirs = patched(**inputs), reference(**inputs)
    torch.testing.assert_close(ours.logits_per_image, theirs.logits_per_image, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.image_embeds, theirs.image_embeds, atol=ATOL, rtol=0)
    assert torch.equal(ours.text_embeds, theirs.text_embeds)


def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own():
    model = vit()
    pixels = pixels_of(SIZES["non-square"])
    with torch.no_grad():
        expected = run(model, pixels)
    PT.patch(model)
    duplicate = copy.deepcopy(model)
    PT.unpatch(model)
    assert PT.is_patched(duplicate)
    counts = ops_of(lambda: run(duplicate, pixels))
    assert counts["posenc.add_resampled_learned.default"] == 1
    with torch.no_grad():
        torch.testing.assert_close(run(duplicate, pixels), expected, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- every interpolate_pos_encoding of transformers

# The modeling directories whose embeddings module the probe recognizes (tiny configs below); docs list them.
RECOGNIZED = {"altclip", "beit", "bridgetower", "chinese_clip", "clip", "clipseg", "data2vec", "deit", "dinov2",
              "dinov2_with_registers", "flava", "git", "granite_docling", "groupvit", "ijepa", "internvl", "janus",
              "kosmos2", "metaclip_2", "owlv2", "owlvit", "pixio", "qianfan_ocr", "rf_detr", "siglip", "step3p7",
              "swin", "tipsv2", "vit", "vit_msn", "x_clip"}
# Refused, with the start of the reason patch gives.
REFUSED = {
    "blip": "uses the resized table other than adding it", "blip_2": "uses the resized table other than adding it",
    "instructblip": "uses the resized table other than adding it",
    "instructblipvideo": "uses the resized table other than adding it",
    "vit_mae": "uses the resized table other than adding it",
    "hunyuan_vl": "differs from resample_learned in every mode",
    "hy_v4_vl": "differs from resample_learned in every mode",
    "donut": "does not take pixels of its image size", "swinv2": "does not take pixels of its image size",
    "maskformer": "takes pixels [1, C, H, W] of no size tried", "vivit": "are not a few prefix rows and a square grid",
    "phi4_multimodal": "does not take pixels of its image size",
    "unlimited_ocr": "does not take pixels of its image size",
    "videoprism": "does not take pixels of its image size",
    "pvt": "interpolate_pos_encoding raised",
}
TINY = dict(hidden_size=32, image_size=32, patch_size=8, num_channels=3, num_attention_heads=2, intermediate_size=64)


def modules_with_interpolate_pos_encoding():
    """(directory, class) of every nn.Module of transformers' modeling files that defines interpolate_pos_encoding."""
    root = Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        if "def interpolate_pos_encoding" not in path.read_text():
            continue
        modeling = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        for cls in vars(modeling).values():
            if inspect.isclass(cls) and issubclass(cls, torch.nn.Module) and cls.__module__ == modeling.__name__ \
                    and "interpolate_pos_encoding" in cls.__dict__:
                yield path.parent.name, modeling, cls


def build_tiny(modeling, cls):
    """The module from its config class (its __init__'s annotation, else the modeling file's vision config) with
    TINY's values where the config takes them, an absolute position table switched on, and the sizes its __init__
    asks for beside the config; None where that does not build."""
    config_class = typing.get_type_hints(cls.__init__).get("config")
    if not hasattr(config_class, "model_type"):
        configs = sorted((c for n, c in vars(modeling).items() if n.endswith("Config") and "Text" not in n
                          and inspect.isclass(c) and hasattr(c, "model_type")),
                         key=lambda c: ("Vision" not in c.__name__, c.__name__))
        config_class = configs[0] if configs else None
    if config_class is None:
        return None
    config = None
    for values in (TINY, {k: TINY[k] for k in ("hidden_size", "patch_size", "num_channels")}, {}):
        try:
            config = config_class(**values)
            break
        except Exception:  # noqa: BLE001 - a config that validates values of other kinds: fewer of TINY's
            continue
    if config is None:
        return None
    for name, value in (("use_absolute_position_embeddings", True), ("use_absolute_embeddings", True),
                        ("tubelet_size", [1, PATCH, PATCH])):
        if hasattr(config, name):
            setattr(config, name, value)
    sizes = dict(TINY, stride=PATCH, num_patches=(IMAGE // PATCH) ** 2)
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]
    extra = {p.name: sizes[p.name] for p in parameters if p.default is inspect.Parameter.empty and p.name in sizes}
    try:
        return cls(config, **extra)
    except Exception:  # noqa: BLE001 - the row says "not built"
        return None


class Holder(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.embeddings = module


def test_every_interpolate_pos_encoding_of_transformers_is_recognized_or_refused_with_a_reason():
    """Each embeddings module of transformers with interpolate_pos_encoding and a learned table is probed: the
    recognized ones are RECOGNIZED (the docs list them), each refused one says why."""
    recognized, refused = set(), {}
    for directory, modeling, cls in modules_with_interpolate_pos_encoding():
        module = build_tiny(modeling, cls)
        if module is None or not PT._has_resized_table(module):
            continue
        found, reasons = PT.recognize_resized_tables(Holder(module))
        if found:
            recognized.add(directory)
        else:
            assert len(reasons) == 1 and reasons[0], directory
            refused[directory] = reasons[0]
    assert recognized == RECOGNIZED
    assert refused.keys() == REFUSED.keys()
    for directory, reason in refused.items():
        assert REFUSED[directory] in reason, (directory, reason)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations-transformers.md").read_text()
    for directory in RECOGNIZED | REFUSED.keys():
        assert f"`{directory}`" in doc, directory


# ---------------------------------------------------------------- Qwen3-VL: left to Hugging Face

def qwen3_vl_positions(weight, grid_thw, side, merge):
    """Qwen3-VL's position rows for packed images and videos from posenc: per entry (t, h, w) the table resampled
    to (h, w) (bilinear, aligned corners), put in spatial-merge-block order, repeated over the t frames."""
    rows = []
    for t, h, w in grid_thw.tolist():
        table = posenc.functional.resample_learned(weight, [side, side], [h, w], mode="bilinear", align_corners=True)
        blocks = table.view(h // merge, merge, w // merge, merge, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)
        rows.append(blocks.repeat(t, 1))
    return torch.cat(rows)


def test_qwen3_vl_interpolation_is_resample_learned_but_is_left_to_hugging_face():
    """Qwen3-VL's gather of four rows per patch equals resample_learned per image followed by the merge reorder
    (so the maths is posenc's); patch leaves its vision tower to Hugging Face (docs: why)."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights
    torch.manual_seed(0)
    config = transformers.Qwen3VLVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                              patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                                              out_hidden_size=32, num_position_embeddings=36,
                                              deepstack_visual_indexes=[])
    model = modeling_qwen3_vl.Qwen3VLVisionModel(config).eval()
    grid_thw = torch.tensor([[1, 4, 8], [2, 6, 6], [1, 2, 2], [1, 10, 4]])  # images, a video; up, down, square
    side, merge = model.num_grid_per_side, config.spatial_merge_size
    assert (model.interpolation_mode, model.interpolation_align_corners) == ("bilinear", True)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, side, mode="bilinear", align_corners=True, spatial_merge_size=merge)
    weight = model.pos_embed.weight.detach()
    theirs = (torch.nn.functional.embedding(indices, weight) * weights[:, :, None]).sum(1)
    torch.testing.assert_close(qwen3_vl_positions(weight, grid_thw, side, merge), theirs, atol=1e-6, rtol=0)
    with pytest.raises(PT.NotRecognized):  # its rotary module (rope_type "axial") is not posenc's either
        PT.patch(model)
    assert not PT.is_patched(model) and "forward" not in vars(model) and "forward" not in vars(model.pos_embed)
