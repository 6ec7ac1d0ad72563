"""The README's quick start keeps its two commands, and says how to take torch's CPU build on a CPU-only machine
before them (pip keeps a torch already there), and what it saves."""
import pathlib

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def test_quick_start_has_two_commands_and_says_how_to_take_torchs_cpu_build():
    start = README.index("## Quick start")
    quick = README[start:README.index("\n## ", start + 1)]
    block = quick[quick.index("```bash"):quick.index("```", quick.index("```bash") + 1)]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("```")]
    assert len(lines) == 2 and all(line.startswith('pip install -e ".[all]" && ') for line in lines)
    after = quick[quick.index("```", quick.index("```bash") + 1):]
    assert "pip install torch torchvision\n--index-url" in after or "pip install torch torchvision --index-url" in after
    assert "3.2 GB" in after and "CPU build" in after  # what it saves, said
