"""The README's quick start and its integrations block run as pasted."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quick_start_runs_as_pasted(capsys):
    text = README.read_text()
    quick_start = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", quick_start, re.DOTALL).group(1)
    exec(compile(code, "README.md quick start", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert printed[0] in ("default", "avx2", "avx512")
    assert printed[1:] == ["torch.Size([2,", "16,", "4,", "64])", "torch.Size([2,", "16,", "128])",
                           "torch.Size([2,", "16,", "128])", "torch.Size([2,", "8,", "16,", "16])",
                           "torch.Size([1,", "8,", "16,", "16])"]


def test_integrations_block_runs_as_pasted(capsys):
    text = README.read_text()
    section = text[text.index("## Integrations"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    exec(compile(code, "README.md integrations", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert printed[:4] == ["tensor(True)", "True", "True", "torch.bfloat16"]
    assert printed[4] == (Path(__file__).resolve().parents[2] / "VERSION").read_text().strip()
