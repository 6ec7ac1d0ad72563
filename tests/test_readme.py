"""The README's examples run as written, and its figures are the ones the code gives."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return re.findall(r"```python\n(.*?)```", fh.read(), flags=re.S)


def test_the_counting_snippet_runs_as_written(monkeypatch):
    block = next(b for b in _python_blocks() if "report = flopcount.count(model" in b)
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository
    exec(compile(block, "README.md", "exec"), {})  # a name it does not define (x, ids) fails here


def test_palm_is_5_1_percent_under_the_count_on_llama_gqa_tiny_as_the_readme_says():
    from flopcount.analyses.compare import compare
    from flopcount.model.specs import build

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        assert "llama-gqa-tiny 5.1%" in fh.read()
    model, inputs, name = build(os.path.join("hf:" + ROOT, "tests", "fixtures", "hf", "llama-gqa-tiny"),
                                seq_len=64, device="cpu", random=True)
    table = compare(model, inputs, estimators=("dispatch", "palm"))
    totals = table[table["op"] == "(total)"]
    count, palm = totals["dispatch"].sum(), totals["palm"].sum()
    assert f"{(count - palm) / count:.1%}" == "5.1%"
