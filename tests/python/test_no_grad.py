"""Calls with nothing to record (grad mode off, or no input requiring grad) skip the autograd node: their
outputs carry no graph and equal, bit for bit, the outputs of the same call recorded for backward. Every
differentiable op runs its registry sample (op_registry.SAMPLES, size "small": those whose sample has inputs
gradients flow to)."""
import pytest
import torch

from helpers import same_bits
from op_registry import SAMPLES, tensor_ops

DIFFERENTIABLE = [name for name in sorted(SAMPLES) if SAMPLES[name](requires_grad=True).inputs]


def test_every_op_is_covered():
    assert set(tensor_ops()) <= set(SAMPLES), set(tensor_ops()) - set(SAMPLES)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_unrecorded_calls_carry_no_graph_and_equal_recorded_ones(name):
    recorded = SAMPLES[name](requires_grad=True)
    expected = recorded.run()
    assert all(out.grad_fn is not None for out in expected)
    with torch.no_grad():
        grad_off = recorded.run()
    nothing_requires_grad = SAMPLES[name](requires_grad=False).run()
    for got in (grad_off, nothing_requires_grad):
        assert len(got) == len(expected)
        assert all(not out.requires_grad and out.grad_fn is None for out in got)
        assert all(same_bits(a, b.detach()) for a, b in zip(got, expected))
