"""The examples of the README and the docs run as written, and their figures are the ones the code gives."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


COUNT_GUIDE = os.path.join(ROOT, "docs", "guide", "count.md")
LM_GUIDE = os.path.join(ROOT, "docs", "guide", "utilization.md")


def _python_blocks(path=COUNT_GUIDE):
    with open(path, encoding="utf-8") as fh:
        return re.findall(r"```python\n(.*?)```", fh.read(), flags=re.S)


def test_the_counting_snippet_runs_as_written(monkeypatch):
    block = next(b for b in _python_blocks() if "report = flopcount.count(model" in b)
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository
    exec(compile(block, COUNT_GUIDE, "exec"), {})  # a name it does not define (x, ids) fails here


def test_palm_is_5_1_percent_under_the_count_on_llama_gqa_tiny_as_the_docs_say():
    from flopcount.analyses.compare import compare
    from flopcount.model.specs import build

    with open(LM_GUIDE, encoding="utf-8") as fh:
        assert "llama-gqa-tiny 5.1%" in fh.read()
    model, inputs, name = build(os.path.join("hf:" + ROOT, "tests", "fixtures", "hf", "llama-gqa-tiny"),
                                seq_len=64, device="cpu", random=True)
    table = compare(model, inputs, estimators=("dispatch", "palm"))
    totals = table[table["op"] == "(total)"]
    count, palm = totals["dispatch"].sum(), totals["palm"].sum()
    assert f"{(count - palm) / count:.1%}" == "5.1%"
