"""op_registry.py, the tests' one list of posenc's ops: the kinds it reads from the schemas, and that the coverage
tests built on it fail when a new op of their kind appears without coverage."""
import importlib

import pytest

import op_registry
from op_registry import Op

EXPECTED_KINDS = {
    "rope": "forward", "add_alibi": "forward", "relative_position_bucket": "forward",
    "rope_backward": "backward", "embedding_backward": "backward", "t5_bias_backward": "backward",
    "rope_": "inplace", "add_alibi_": "inplace",
    "rope_inv_freq": "configuration", "alibi_slopes": "configuration", "cpu_capability": "configuration",
    "rope_inv_freq_for_length": "configuration", "zigzag_positions_varlen": "configuration",
    "mrope_positions": "configuration", "make_positions": "configuration",
}


def test_known_ops_have_their_kind():
    kinds = {op.name: op.kind for op in op_registry.all_ops()}
    assert {name: kinds[name] for name in EXPECTED_KINDS} == EXPECTED_KINDS


def test_every_op_has_exactly_one_kind():
    by_kind = [name for kind in op_registry.KINDS for name in op_registry.ops(kind)]
    assert sorted(by_kind) == [op.name for op in op_registry.all_ops()]


def test_tensor_arguments_and_results_are_read_from_the_schema():
    ops = {op.name: op for op in op_registry.all_ops()}
    assert ops["cpu_capability"] == Op("cpu_capability", "configuration", takes_tensors=False, returns_tensors=False)
    assert ops["rope_"] == Op("rope_", "inplace", takes_tensors=True, returns_tensors=False)
    assert ops["mrope_positions"].takes_tensors and not ops["rope_inv_freq"].takes_tensors
    assert {"rope", "rope_", "zigzag_positions_varlen"} <= set(op_registry.tensor_ops())
    assert "alibi_slopes" not in op_registry.tensor_ops()


# Coverage tests cheap enough to call here: (module, test, the kind of new op it must notice, arguments).
COVERAGE_TESTS = [
    ("test_properties", "test_every_op_has_a_property_and_bad_input_cases", "forward", ()),
    ("test_determinism", "test_every_op_is_covered", "backward", ()),
    ("test_distributed", "test_every_posenc_op_with_tensor_arguments_has_a_rule", "inplace", ()),
    ("test_onnx", "test_every_op_of_an_exported_graph_has_a_translation", "configuration", ()),
    # In place of the `native` fixture: outputs that list every op the real registry holds as called.
    ("test_capabilities", "test_the_outputs_cover_every_op", "forward",
     ({"default": {"ops_called": op_registry.ops()}},)),
]


@pytest.mark.parametrize("module, test, kind, arguments", COVERAGE_TESTS, ids=[c[0] for c in COVERAGE_TESTS])
def test_a_coverage_test_fails_on_a_new_op(module, test, kind, arguments, monkeypatch):
    real = op_registry.all_ops()
    new_op = Op("new_op", kind, takes_tensors=kind != "configuration", returns_tensors=kind != "inplace")
    monkeypatch.setattr(op_registry, "all_ops", lambda: real + (new_op,))
    with pytest.raises(AssertionError):
        getattr(importlib.import_module(module), test)(*arguments)
