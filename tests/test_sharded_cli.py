"""`flopcount count MODEL --fsdp N --tp M`: one rank on a fake process group, from the command line."""
from __future__ import annotations

import json

import pytest

from flopcount.cli import main

LLAMA = "hf:tests/fixtures/hf/llama-gqa-tiny"  # hidden 64, 2 layers, 8 heads, 2 key/value heads, vocabulary 512


def _rows(doc, op, phase=None):
    return [r for r in doc["ops"] if r["op"] == op and (phase is None or r["phase"] == phase)]


def test_count_tp_json_has_the_all_reduces_by_the_closed_form(capsys):
    pytest.importorskip("transformers")
    assert main(["count", LLAMA, "--seq-len", "16", "--tp", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # forward: the embedding's rows and the two row-wise linears of each of the 2 layers; 1 x 16 tokens x 64, fp32,
    # all-reduced over 2 ranks: 2 (2 - 1) / 2 x 4096 bytes each
    fwd = _rows(doc, "_c10d_functional.all_reduce", "forward")
    assert sum(r["calls"] for r in fwd) == 5 and sum(r["bytes"] for r in fwd) == 5 * 16 * 64 * 4
    assert doc["world"] == {"fsdp": 1, "tp": 2, "world": 2} and doc["rank"] == 0


def test_count_fsdp_alone_gathers_the_parameters(capsys):
    pytest.importorskip("transformers")
    assert main(["count", LLAMA, "--seq-len", "16", "--fsdp", "4", "--by", "family", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert "collective" in out


@pytest.mark.parametrize("flag, words", [("--cp", "context parallelism")])
def test_context_parallel_is_refused_in_one_line(flag, words, capsys):
    assert main(["count", LLAMA, "--seq-len", "16", flag, "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "not supported" in err and len(err.splitlines()) == 1


def test_fsdp_on_a_real_device_is_refused(capsys):
    assert main(["count", LLAMA, "--seq-len", "16", "--fsdp", "2", "--device", "cpu"]) == 2
    assert "fake process group" in capsys.readouterr().err
