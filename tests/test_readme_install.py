"""The README's quick start says how to take torch's CPU build on a CPU-only machine, before the project's install
(pip keeps a torch already there), and what it saves."""
import pathlib

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def test_quick_start_takes_torchs_cpu_build_first():
    start = README.index("## Quick start")
    quick = README[start:README.index("\n## ", start + 1)]
    block = quick[quick.index("```bash"):quick.index("```", quick.index("```bash") + 1)]
    lines = [line for line in block.splitlines() if line.startswith("pip install")]
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[0] and "torch" in lines[0]
    assert all('-e ".[all]"' in line for line in lines[1:])
    assert "3.2 GB" in quick and "CPU build" in quick  # what it saves, said
