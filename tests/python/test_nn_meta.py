"""Every module of posenc.nn survives the meta device: built under ``torch.device("meta")`` or moved there with
``.to("meta")``, then materialised with ``to_empty(device="cpu")`` and given the state dict of a module built
normally, it computes the same bits as that module (frequencies are recomputed from the configuration, parameters
come from the state dict). The classes are found by walking posenc.nn, so a new module fails here until it has a
case below."""
import inspect

import pytest
import torch

import posenc

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [3.0, 4.0, 5.0, 6.0],
            "original_max_position_embeddings": 8, "max_position_embeddings": 32}


def qk(heads=2, dim=16, seq=12):
    return torch.randn(2, seq, heads, dim), torch.randn(2, seq, 1, dim)


def trained(module):
    """The module with weights away from their initial ones (zeros for gemma), so that the state dict carries them."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.uniform_(0.5, 2.0)
    return module


# Per class: (construction, inputs of forward) pairs; inputs are drawn after construction.
CASES = {
    "SinusoidalPositionalEncoding": [
        (lambda: posenc.nn.SinusoidalPositionalEncoding(17, shift=1, layout="half", x_scale=2.0),
         lambda: (torch.randn(2, 9, 17), torch.randint(0, 5000, (9,))))],
    "SinusoidalGridEncoding": [
        (lambda: posenc.nn.SinusoidalGridEncoding(32, "mae", num_prefix_tokens=1, base_size=4, interpolation_scale=2.0),
         lambda: (torch.randn(2, 1 + 5 * 6, 32), [5, 6])),
        (lambda: posenc.nn.SinusoidalGridEncoding(32, "cogvideox", interpolation_scale=[1.0, 1.875]),
         lambda: (torch.randn(2, 2 * 3 * 4, 32), [2, 3, 4]))],
    "SinusoidalEmbedding": [
        (lambda: posenc.nn.SinusoidalEmbedding(30, 16, padding_idx=1), lambda: (torch.randint(0, 30, (2, 9)),))],
    "LearnedPositionalEmbedding": [
        (lambda: posenc.nn.LearnedPositionalEmbedding(20, 8, offset=2), lambda: (torch.randn(2, 9, 8), None, 3))],
    "LearnedEmbedding": [
        (lambda: posenc.nn.LearnedEmbedding(30, 20, 8, padding_idx=0), lambda: (torch.randint(0, 30, (2, 9)),))],
    "ALiBi": [(lambda: posenc.nn.ALiBi(8, head_offset=2, num_local_heads=4), lambda: (torch.randn(2, 4, 5, 7),)),
              (lambda: posenc.nn.ALiBi(4, "symmetric", learnable=True), lambda: (torch.randn(2, 4, 5, 7),))],
    "T5RelativeBias": [(lambda: posenc.nn.T5RelativeBias(4, 16, 40, bidirectional=False), lambda: (5, 9, 4))],
    "RotaryEmbedding": [
        (lambda: posenc.nn.RotaryEmbedding(16, 12, scaling=YARN), lambda: qk()),
        (lambda: posenc.nn.RotaryEmbedding(16, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                        "max_position_embeddings": 8}),
         lambda: (*qk(), None, 20)),
        (lambda: posenc.nn.RotaryEmbedding(8, scaling=LONGROPE), lambda: (*qk(dim=8), torch.arange(40, 52)))],
    "MultimodalRotaryEmbedding": [
        (lambda: posenc.nn.MultimodalRotaryEmbedding(16, [2, 3, 3], 5e5, interleaved=True, scaling=YARN),
         lambda: (*qk(), torch.randint(0, 300, (3, 2, 12))))],
    "QKNormRotaryEmbedding": [
        (lambda: trained(posenc.nn.QKNormRotaryEmbedding(16, 12, scaling=YARN, norm="gemma")), lambda: qk()),
        # OLMo 2: weights over all heads; frequencies chosen per call
        (lambda: trained(posenc.nn.QKNormRotaryEmbedding(16, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                                      "max_position_embeddings": 8},
                                                         norm="olmo2", q_norm_dim=32, k_norm_dim=16)),
         lambda: (*qk(), None, 20))],
    "AxialRotaryEmbedding": [
        (lambda: posenc.nn.AxialRotaryEmbedding(16, 2), lambda: (*qk(), torch.randint(0, 64, (2, 12)))),
        (lambda: posenc.nn.AxialRotaryEmbedding(16, axes_dim=[4, 6, 4], layout="gptj"),
         lambda: (*qk(), torch.randint(0, 64, (3, 12))))],
}


def module_classes():
    return sorted(name for name, value in vars(posenc.nn).items()
                  if inspect.isclass(value) and issubclass(value, torch.nn.Module) and not name.startswith("_")
                  and value.__module__ == posenc.nn.__name__)


def outputs(module, inputs):
    result = module(*inputs)
    result = list(result) if isinstance(result, tuple) else [result]
    if isinstance(module, posenc.nn.ALiBi):
        result.append(module.bias(5, 7))
    return result


def test_the_walk_finds_the_modules():
    assert {"RotaryEmbedding", "MultimodalRotaryEmbedding", "AxialRotaryEmbedding", "QKNormRotaryEmbedding",
            "ALiBi"} <= set(module_classes())


@pytest.mark.parametrize("how", ["built on meta", "moved to meta"])
@pytest.mark.parametrize("name", module_classes())
def test_meta_then_to_empty_computes_what_a_module_built_normally_does(name, how):
    assert name in CASES, f"posenc.nn.{name} has no case in CASES: add its construction and inputs"
    for make, inputs in CASES[name]:
        torch.manual_seed(0)
        expected_module = make()
        if how == "built on meta":
            with torch.device("meta"):
                module = make()
        else:
            module = make().to("meta")
            assert all(t.device.type == "meta" for t in module.parameters())
        module.to_empty(device="cpu")
        module.load_state_dict(expected_module.state_dict())
        values = inputs()
        for actual, expected in zip(outputs(module, values), outputs(expected_module, values), strict=True):
            assert actual.device.type == "cpu"
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        for attribute, value in vars(expected_module).items():
            if isinstance(value, torch.Tensor):  # the exact frequencies and slopes (plain attributes)
                assert torch.equal(getattr(module, attribute), value), attribute
