"""The length-generalization study (scripts/study.py) end to end, on its "quick" preset: the output
files, the table's shape and values, the plot, the exported models (TorchScript and torch.export) against a
float64 evaluation written here, cached decoding (decode_step, rope_qk_cache_) against the forward, the C++
program's agreement, and torchrun with two processes against one.

About 30-40 s: three short runs of the study in subprocesses (one process, two processes, the C++ program).
"""
import copy
import csv
import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posenc  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
STUDY_CPP = Path(os.environ.get("POSENC_STUDY_CPP", ROOT / "build" / "scripts" / "study_cpp" / "posenc_study"))
ENCODINGS = ["none", "sinusoidal", "learned", "rotary", "rotary+ntk", "alibi", "t5"]
TRAIN_LEN = 16  # the quick preset's
LENGTHS = [16, 32, 64, 128, 256]
# Two processes compute what one computes, up to float rounding: each process multiplies half the batch, so
# its matrix products round differently (about 1e-7 relative), and Adam carries that through the steps.
DDP_TOLERANCE = 1e-4
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load:DeprecationWarning")


def run_study(out: Path, *args: str, processes: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command = launcher + [str(ROOT / "scripts" / "study.py"), "--preset", "quick", "--out", str(out), *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    result = run_study(out, "--threads", "1")
    return out, result.stdout, json.loads((out / "results.json").read_text())


def bits_per_byte_float64(model, chunks: torch.Tensor, length: int) -> float:
    """Held-out bits per byte from the model's logits, the loss written out in float64."""
    inputs = chunks[:, :-1].reshape(-1, length)
    targets = chunks[:, 1:].reshape(-1, length)
    with torch.no_grad():
        logits = model(inputs).double()
    log_probs = logits - logits.exp().sum(-1, keepdim=True).log()
    nats = -log_probs.gather(-1, targets[..., None]).sum().item()
    return nats / targets.numel() / math.log(2)


@pytest.fixture(scope="module")
def program():
    return runpy.run_path(str(ROOT / "scripts" / "study.py"))  # a program, not a package module


def quick_model(program, encoding: str, layers: int = 2):
    """A model of the quick preset's sizes (two layers, so that a second layer reads its cache too), untrained
    but with a random T5 table, so that every bias is there."""
    preset = program["PRESETS"]["quick"]
    scaling = program["dynamic_ntk"](preset["train_len"]) if encoding == "rotary+ntk" else None
    torch.manual_seed(0)
    model = program["ByteLM"](encoding.split("+")[0], preset["dim"], layers, preset["heads"], preset["train_len"],
                              scaling)
    if encoding == "t5":
        torch.nn.init.normal_(model.bias.weight)
    return model.eval()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_decode_step_matches_the_forward(program, encoding):
    model = quick_model(program, encoding)
    # The learned table ends at the training length; the others run to 3 times it.
    length = TRAIN_LEN if encoding == "learned" else 3 * TRAIN_LEN
    tokens = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(1))
    if encoding == "rotary+ntk":
        # Its frequencies follow the length, so every cached key would go stale: it refuses a cache.
        assert not model.cached_decoding
        with pytest.raises(RuntimeError, match="depend on the length"), torch.no_grad():
            model.decode_step(tokens, 0, [], [])
        return
    reference = copy.deepcopy(model).double()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the masks too
    try:
        with torch.no_grad():
            expected = reference(tokens)
    finally:
        torch.set_default_dtype(default)
    scripted = torch.jit.script(model)
    for decoder in (model, scripted):
        layers, heads, head_dim = decoder.cache_shape()
        k_caches = [torch.zeros(2, heads, length, head_dim) for _ in range(layers)]
        v_caches = [torch.zeros(2, heads, length, head_dim) for _ in range(layers)]
        # A prompt, a few tokens at once after it (a mask inside the new ones), then one token per call.
        cuts = [0, 5, 8] + list(range(9, length + 1))
        with torch.no_grad():
            logits = torch.cat([decoder.decode_step(tokens[:, a:b], a, k_caches, v_caches)
                                for a, b in zip(cuts, cuts[1:])], 1)
        torch.testing.assert_close(logits.double(), expected, atol=1e-5, rtol=0)
    generate, generate_cached = program["generate"], program["generate_cached"]
    prompt, count = b"def ", length - 3  # the longest text whose every window holds all of it
    assert generate_cached(scripted, prompt, count, length) == generate(model, prompt, count, length)


def test_outputs_and_table(study):
    out, stdout, report = study
    for name in ("table.txt", "results.csv", "results.json", "settings.json", "bpb.png", "export/model.pt",
                 "export/model.pt2", "export/check.txt", "export/heldout.bin", "export/prompt.txt",
                 "export/generated_python.txt"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name

    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["encoding"], int(r["eval_length"])) for r in rows] == [(e, n) for e in ENCODINGS for n in LENGTHS]
    assert [r["factor"] for r in rows[:5]] == ["1", "2", "4", "8", "16"]
    for row in rows:
        if row["encoding"] == "learned" and int(row["eval_length"]) > TRAIN_LEN:
            # Past its table of TRAIN_LEN positions the learned model has no number, only posenc's own error.
            assert row["bits_per_byte"] == ""
            assert row["error"].startswith(f"posenc.embed_learned: position {TRAIN_LEN} is outside [0, L_max) "
                                           f"with L_max = {TRAIN_LEN}")
        else:
            # A barely trained byte model: better than 8 bits (uniform) and worse than 2.
            assert 2.0 < float(row["bits_per_byte"]) < 8.0 and row["error"] == ""

    # JSON, CSV and the printed table say the same.
    assert [(r["encoding"], r["eval_length"]) for r in report["results"]] == \
        [(r["encoding"], int(r["eval_length"])) for r in rows]
    for r, c in zip(report["results"], rows):
        assert (r["bits_per_byte"] is None) == (c["bits_per_byte"] == "")
        if r["bits_per_byte"] is not None:
            assert abs(r["bits_per_byte"] - float(c["bits_per_byte"])) < 1e-6
    table = (out / "table.txt").read_text()
    assert table.strip() in stdout
    body = [line.split() for line in table.splitlines()[3:3 + len(ENCODINGS)]]
    assert [cells[0] for cells in body] == ENCODINGS and all(len(cells) == 1 + len(LENGTHS) for cells in body)
    assert body[ENCODINGS.index("learned")][2:] == ["n/a"] * 4
    assert "n/a (learned): posenc.embed_learned: position 16 is outside" in table

    settings = json.loads((out / "settings.json").read_text())
    assert settings["train_len"] == TRAIN_LEN and settings["lengths"] == LENGTHS and settings["processes"] == 1
    assert settings["eval_predictions"] == settings["eval_chunks"] * LENGTHS[-1]
    assert "pydoc_data.topics" in settings["text"]


def test_plot(study, program):
    import matplotlib.image

    figure = program["figure"]

    out, _, report = study
    image = matplotlib.image.imread(out / "bpb.png")
    assert image.shape[:2] == (460, 750) and image[..., :3].std() > 0.05
    # The figure the PNG was drawn from: one line per encoding through the table's numbers, a log-scaled
    # length axis, labelled axes.
    rows = {}
    for r in report["results"]:
        rows.setdefault(r["encoding"], {})[r["eval_length"]] = {"bpb": r["bits_per_byte"], "error": r["error"]}
    ax = figure(rows, LENGTHS, TRAIN_LEN, "title").axes[0]
    assert ax.get_xscale() == "log" and "evaluation length" in ax.get_xlabel() and "bits per byte" in ax.get_ylabel()
    lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    assert [line.get_label().split()[0] for line in lines] == ENCODINGS
    assert lines[ENCODINGS.index("learned")].get_label() == f"learned (n/a past {TRAIN_LEN})"
    for line, encoding in zip(lines, ENCODINGS):
        xs = [n for n in LENGTHS if rows[encoding][n]["bpb"] is not None]
        assert list(line.get_xdata()) == xs
        assert list(line.get_ydata()) == [rows[encoding][n]["bpb"] for n in xs]


def test_exported_models_match_the_table(study):
    out, _, report = study
    best = report["best_long_context"]
    check = (out / "export" / "check.txt").read_text()
    assert f"encoding {best}\n" in check
    chunk = int(check.split("chunk ")[1].split()[0])
    chunks = torch.frombuffer(bytearray((out / "export" / "heldout.bin").read_bytes()), dtype=torch.uint8)
    chunks = chunks.long().view(-1, chunk)
    table = {(r["encoding"], r["eval_length"]): r["bits_per_byte"] for r in report["results"]}
    scripted = torch.jit.load(str(out / "export" / "model.pt"))
    program = torch.export.load(str(out / "export" / "model.pt2")).module()
    for length in (LENGTHS[0], LENGTHS[-1]):
        expected = table[(best, length)]
        assert f"bpb {length} {expected:.10f}" in check
        assert abs(bits_per_byte_float64(scripted, chunks, length) - expected) < 1e-5
        assert abs(bits_per_byte_float64(program, chunks, length) - expected) < 1e-5
    # The best long-context model is the one with the lowest number at the longest length.
    longest = {e: table[(e, LENGTHS[-1])] for e in ENCODINGS if table[(e, LENGTHS[-1])] is not None}
    assert best == min(longest, key=longest.get)


def test_cpp_program_agrees_with_python(study):
    out, _, report = study
    assert STUDY_CPP.is_file(), f"{STUDY_CPP} is missing: build it with bash scripts/setup.sh"
    result = subprocess.run([str(STUDY_CPP), str(out / "export")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    values = {int(w[0]): (float(w[1]), float(w[2])) for w in
              (line.split() for line in result.stdout.splitlines()) if len(w) == 4 and w[0].isdigit()}
    table = {r["eval_length"]: r["bits_per_byte"] for r in report["results"]
             if r["encoding"] == report["best_long_context"]}
    assert sorted(values) == [LENGTHS[0], LENGTHS[-1]]
    for length, (cpp, python) in values.items():
        assert abs(cpp - table[length]) < 1e-4 and abs(python - table[length]) < 1e-9  # Python's, as written
    generated = (out / "export" / "generated_python.txt").read_bytes()
    assert len(generated) == 200
    assert "generated text equals Python's" in result.stdout
    # Greedy decoding with the caches (decode_step) gives the same 200 bytes, and both rates are printed.
    cacheable = report["best_long_context"] != "rotary+ntk"
    assert report["export"]["cached_generation_equal"] is (True if cacheable else None)
    rates = [line.split(": ")[1].split()[:2] for line in result.stdout.splitlines()
             if line.startswith("generation with")]
    assert "generation without cache: " in result.stdout and len(rates) == 2
    if cacheable:
        assert "cached text equals the uncached text" in result.stdout
        assert all(float(rate) > 0 and unit == "tokens/s" for rate, unit in rates)


def test_two_processes_reach_the_loss_of_one(study, tmp_path):
    _, _, single = study
    result = run_study(tmp_path, "--encodings", "rotary,t5", "--no-export", processes=2)
    double = json.loads((tmp_path / "results.json").read_text())
    assert double["settings"]["processes"] == 2 and double["settings"]["threads_per_process"] >= 1
    assert "processes: 2 x" in result.stdout
    for encoding in ("rotary", "t5"):
        one, two = single["training"][encoding]["losses"], double["training"][encoding]["losses"]
        assert len(one) == len(two) == single["settings"]["steps"]
        assert max(abs(a - b) for a, b in zip(one, two)) < DDP_TOLERANCE
        assert one[0] != one[-1]  # it trained
    pairs = [(r["bits_per_byte"], s["bits_per_byte"]) for r in double["results"] for s in single["results"]
             if (r["encoding"], r["eval_length"]) == (s["encoding"], s["eval_length"])]
    assert len(pairs) == 3 * len(LENGTHS)  # rotary, rotary+ntk, t5
    assert max(abs(a - b) for a, b in pairs) < DDP_TOLERANCE
