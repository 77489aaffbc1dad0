"""docs/export.md, run: a model mixing four families exports with torch.export (dynamic batch and sequence,
saved and reloaded), is compiled and packaged by AOTInductor, and the package runs from Python and from the C++
program scripts/aoti_runner (AOTIModelPackageLoader) with outputs equal to eager PyTorch.

The AOTInductor compile is the expensive step (a C++ compile of the generated code): one package serves the
Python and the C++ runs."""
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import posenc
from helpers import rotate_pairs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "export.md"


def doc_blocks(language):
    """The fenced code blocks of docs/export.md in one language, in order."""
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)


def runner_path():
    build = Path(os.environ.get("POSENC_BUILD_DIR", ROOT / "build"))
    return build / "scripts" / "aoti_runner" / "posenc_aoti_run"


@pytest.fixture(scope="module")
def documented(tmp_path_factory):
    """Runs the doc's Python blocks up to the C++ step in a scratch folder; returns their namespace."""
    folder = tmp_path_factory.mktemp("export")
    model, torch_export, aoti = doc_blocks("python")[:3]
    namespace = {}
    previous = os.getcwd()
    os.chdir(folder)
    try:
        for block in (model, torch_export, aoti):
            exec(compile(block, str(DOC), "exec"), namespace)
    finally:
        os.chdir(previous)
    namespace["folder"] = folder
    return namespace


def test_exported_graph_keeps_each_posenc_op_as_one_node(documented):
    targets = {str(node.target) for node in documented["exported"].graph.nodes if node.op == "call_function"}
    assert {"posenc.embed_sinusoidal.default", "posenc.rope_qk.default", "posenc.add_alibi.default",
            "posenc.t5_bias.default"} <= targets


def test_exported_program_runs_at_other_sizes(documented):
    module, model = documented["exported"].module(), documented["model"]
    for shape in [(3, 2), (5, 40)]:
        tokens = torch.randint(0, 100, shape)
        torch.testing.assert_close(module(tokens), model(tokens))


def test_aoti_package_runs_from_cpp(documented):
    runner = runner_path()
    assert runner.exists(), (f"{runner} is missing: build with POSENC_BUILD_TESTS=1 (scripts/setup.sh), which "
                             "builds scripts/aoti_runner")
    folder = documented["folder"]
    result = subprocess.run([str(runner), "tiny_attention.pt2", "tiny_attention_inputs.pt",
                             "tiny_attention_outputs.pt"], cwd=folder, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "1 inputs -> 1 outputs" in result.stdout
    namespace = dict(documented)
    previous = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(doc_blocks("python")[3], str(DOC), "exec"), namespace)  # compares with eager
    finally:
        os.chdir(previous)


def test_aoti_package_of_every_remaining_op(tmp_path):
    """The ops the documented model does not use (qk_norm_rope among them), the in-place ones, ScalarType and SymInt
    arguments: one more package, run from Python (the C++ loader is the same code)."""
    from posenc import functional as PF

    class Rest(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Parameter(torch.randn(50, 16)), torch.nn.Parameter(torch.randn(80, 16))
            self.register_buffer("sin_freq", posenc.frequencies.sinusoidal(16))
            self.register_buffer("rope_freq", posenc.frequencies.rope(4)[0])  # partial rotary: 4 of 8 channels
            # QK-norm weights: per head (q, k) and over both heads of a token (OLMo 2)
            self.q_norm, self.k_norm = torch.nn.Parameter(torch.rand(8) + 0.5), torch.nn.Parameter(torch.rand(8))
            self.all_norm = torch.nn.Parameter(torch.rand(16) + 0.5)

        def forward(self, tokens, mask):
            s = tokens.shape[1]
            positions = PF.positions_from_mask(mask)
            h = PF.embed_learned(tokens, self.wte, self.wpe, positions, 1.0, None, 2)
            h = PF.add_sinusoidal(h, None, self.sin_freq, 0.5, "half")
            h = PF.add_learned(h, self.wpe, PF.make_positions(tokens, 1))
            h = h + PF.sinusoidal(positions, self.sin_freq, "interleaved", torch.float32)
            h = h + PF.learned(self.wpe, positions)
            x = h.view(2, s, 2, 8).contiguous()
            PF.rope_(x, positions, self.rope_freq, 1.0, "gptj")
            cos = torch.cos(positions[..., None] * self.rope_freq.float()).repeat_interleave(2, -1)
            y = PF.rope_cos_sin(PF.rope(x, None, self.rope_freq), cos, torch.sqrt(1 - cos * cos), "gptj")
            scores = torch.einsum("bshd,bthd->bhst", x, y)
            q, k = PF.qk_norm_rope(x, y, self.q_norm, self.k_norm, positions, self.rope_freq, 1e-5, "gemma", 0.5,
                                   "gptj")
            q_all, k_all = x * 2, y - 1
            PF.qk_norm_rope_(q_all, k_all, self.all_norm, self.k_norm, None, self.rope_freq, 1e-6, "olmo2")
            scores = scores + torch.einsum("bshd,bthd->bhst", q, k) + torch.einsum("bshd,bthd->bhst", q_all, k_all)
            PF.add_alibi_(scores, PF.alibi_slopes(2), "symmetric")
            buckets = PF.relative_position_bucket(torch.arange(s)[None] - torch.arange(s)[:, None], False, 8, 20)
            bias = PF.alibi_bias(PF.alibi_slopes(4), s, s, "causal", 2, None, torch.float32) + buckets / 8
            return scores + bias

    model = Rest().eval().requires_grad_(False)  # the in-place ops record no autograd
    tokens, mask = torch.randint(0, 50, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    seq = torch.export.Dim("seq", min=2, max=64)
    exported = torch.export.export(model, (tokens, mask), dynamic_shapes=({1: seq}, {1: seq}))
    graph = str(exported.graph)
    assert "posenc.qk_norm_rope.default" in graph and "posenc.qk_norm_rope_.default" in graph
    compiled = torch._inductor.aoti_load_package(
        torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "rest.pt2")))
    for s in (9, 21):
        tokens, mask = torch.randint(0, 50, (2, s)), torch.ones(2, s, dtype=torch.long)
        mask[0, :4] = 0
        # rtol: Inductor's generated einsum sums its products in another order than eager's.
        torch.testing.assert_close(compiled(tokens, mask), model(tokens, mask), rtol=1e-5, atol=1e-5)


def reference_qk_norm_rope(x, weight, positions, inv_freq, eps, norm, attention_scale, layout):
    """float64 QK-norm + RoPE of bshd x, written from the definition: x / sqrt(mean(x^2) + eps) over each head (a
    [head_dim] weight) or over all heads of a token ([heads * head_dim]), times w (gemma: 1 + w), rotated by
    p * inv_freq."""
    x, w = x.double(), weight.double() + (1.0 if norm == "gemma" else 0.0)
    rows = x.flatten(-2) if w.numel() != x.shape[-1] else x
    normalized = (rows / (rows.square().mean(-1, keepdim=True) + eps).sqrt() * w).view(x.shape)
    return rotate_pairs(normalized, positions.double()[..., None] * inv_freq.double(), layout, attention_scale)


def test_qk_norm_rotary_module_scripts_saves_and_loads(tmp_path):
    """TorchScript: posenc.nn.QKNormRotaryEmbedding scripted, saved and reloaded computes what eager does, and both
    the norm and rotation written above (per head with Gemma's 1 + w and a scaled partial rotation; over all heads
    with OLMo 2's weights, gptj pairs and frequencies chosen per call)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}
    cases = [(dict(rotary_dim=12, scaling=yarn, norm="gemma", eps=1e-5), None, 0),
             (dict(layout="gptj", scaling=dynamic, norm="olmo2", q_norm_dim=64, k_norm_dim=32), None, 20),
             (dict(norm="llama", k_norm_dim=32), torch.randint(0, 1000, (2, 9)), 3)]
    for i, (config, positions, offset) in enumerate(cases):
        module = posenc.nn.QKNormRotaryEmbedding(16, **config)
        with torch.no_grad():
            module.q_weight.uniform_(-1.0, 2.0)
            module.k_weight.uniform_(-1.0, 2.0)
        path = tmp_path / f"qk_norm_rope_{i}.pt"
        torch.jit.save(torch.jit.script(module), str(path))
        loaded = torch.jit.load(str(path))
        q, k = torch.randn(2, 9, 4, 16) * 3, torch.randn(2, 9, 2, 16)
        actual = loaded(q, k, positions, offset)
        eager = module(q, k, positions, offset)
        p = positions + offset if positions is not None else torch.arange(offset, offset + 9)
        rotary = module.rotary
        # The frequencies of a sequence of max position + 1 tokens (dynamic NTK grows its base past 16).
        inv_freq = posenc.frequencies.rope(rotary.rotary_dim, rotary.base, config.get("scaling"), int(p.max()) + 1)[0]
        for a, e, x, w in zip(actual, eager, (q, k), (module.q_weight, module.k_weight), strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
            expected = reference_qk_norm_rope(x, w.detach(), p, inv_freq, module.eps, module.norm,
                                              rotary.attention_scale, rotary.layout)
            torch.testing.assert_close(a, expected.float(), atol=1e-5, rtol=1e-5)
        if config.get("scaling") is dynamic:  # beyond the context: frequencies of another base than inv_freq's
            assert not torch.equal(inv_freq, rotary.inv_freq)
