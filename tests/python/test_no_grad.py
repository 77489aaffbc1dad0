"""Calls with nothing to record (grad mode off, or no input requiring grad) skip the autograd node: their
outputs carry no graph and equal, bit for bit, the outputs of the same call recorded for backward."""
import pytest
import torch

import posenc
from posenc import functional as PF

SEQ, WIDTH = 5, 8
POSITIONS = torch.tensor([0, 3, 7, 1, 300])


def float_inputs():
    """The differentiable inputs of every op, by name."""
    return {
        "x": torch.randn(2, SEQ, WIDTH),
        "qk": torch.randn(2, SEQ, 3, WIDTH),
        "table": torch.randn(400, WIDTH),
        "scores": torch.randn(2, 4, SEQ, SEQ),
        "slopes": PF.alibi_slopes(4),
        "t5": torch.randn(32, 4),
        "cos": torch.randn(SEQ, WIDTH),
        "sin": torch.randn(SEQ, WIDTH),
    }


TOKENS = torch.randint(0, 400, (2, SEQ))
CALLS = {
    "add_sinusoidal": (["x"], lambda t: PF.add_sinusoidal(t["x"], None, posenc.frequencies.sinusoidal(WIDTH), 2.0)),
    "embed_sinusoidal": (["table"], lambda t: PF.embed_sinusoidal(TOKENS, t["table"], None,
                                                                  posenc.frequencies.sinusoidal(WIDTH), 3.0)),
    "learned": (["table"], lambda t: PF.learned(t["table"], POSITIONS)),
    "add_learned": (["x", "table"], lambda t: PF.add_learned(t["x"], t["table"], POSITIONS)),
    "embed_learned": (["table"], lambda t: PF.embed_learned(TOKENS, t["table"], t["table"], POSITIONS)),
    "rope": (["qk"], lambda t: PF.rope(t["qk"], POSITIONS, posenc.frequencies.rope(WIDTH)[0], 0.5)),
    "rope_backward": (["qk"], lambda t: PF.rope_backward(t["qk"], None, posenc.frequencies.rope(WIDTH)[0])),
    "rope_qk": (["qk"], lambda t: PF.rope_qk(t["qk"], t["qk"] * 2, None, posenc.frequencies.rope(WIDTH)[0])),
    "rope_cos_sin": (["qk"], lambda t: PF.rope_cos_sin(t["qk"], t["cos"], t["sin"])),
    "alibi_bias": (["slopes"], lambda t: PF.alibi_bias(t["slopes"], SEQ, SEQ)),
    "add_alibi": (["scores", "slopes"], lambda t: PF.add_alibi(t["scores"], t["slopes"], "symmetric")),
    "alibi_backward": (["scores", "slopes"], lambda t: PF.alibi_backward(t["scores"], t["slopes"])),
    "t5_bias": (["t5"], lambda t: PF.t5_bias(t["t5"], SEQ, SEQ, True, 32, 128)),
    "t5_bias_backward": (["scores"], lambda t: PF.t5_bias_backward(t["scores"][:1], True, 32, 128)),
}


def outputs(call, inputs):
    out = call(inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("name", CALLS)
def test_unrecorded_calls_carry_no_graph_and_equal_recorded_ones(name):
    differentiable, call = CALLS[name]
    inputs = float_inputs()
    recorded = {k: v.clone().requires_grad_(k in differentiable) for k, v in inputs.items()}
    expected = outputs(call, recorded)
    assert all(out.grad_fn is not None for out in expected)
    with torch.no_grad():
        grad_off = outputs(call, recorded)
    nothing_requires_grad = outputs(call, inputs)
    for got in (grad_off, nothing_requires_grad):
        assert all(not out.requires_grad and out.grad_fn is None for out in got)
        assert all(torch.equal(a, b.detach()) for a, b in zip(got, expected))
