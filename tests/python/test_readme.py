"""The README's quick start and its integrations block run as pasted."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def run_first_python_block(heading, capsys):
    """Runs the first ```python block after the README's `heading` as pasted; returns the words it printed."""
    text = README.read_text()
    section = text[text.index(f"## {heading}"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    exec(compile(code, f"README.md {heading.lower()}", "exec"), {})
    return capsys.readouterr().out.split()


def test_quick_start_runs_as_pasted(capsys):
    printed = run_first_python_block("Quick start", capsys)
    assert printed[0] in ("default", "avx2", "avx512")
    assert printed[1:] == ["torch.Size([2,", "16,", "4,", "64])", "torch.Size([2,", "16,", "128])",
                           "torch.Size([2,", "16,", "128])", "torch.Size([2,", "8,", "16,", "16])",
                           "torch.Size([1,", "8,", "16,", "16])"]


def test_integrations_block_runs_as_pasted(capsys):
    printed = run_first_python_block("Integrations", capsys)
    assert printed[:4] == ["tensor(True)", "True", "True", "torch.bfloat16"]
    assert printed[4] == (Path(__file__).resolve().parents[2] / "VERSION").read_text().strip()
