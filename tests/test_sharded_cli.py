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


def test_count_sequence_parallel_json_has_no_all_reduce(capsys):
    pytest.importorskip("transformers")
    assert main(["count", LLAMA, "--seq-len", "16", "--tp", "2", "--sp", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not _rows(doc, "_c10d_functional.all_reduce")
    # forward: the embedding, o_proj and down_proj of the 2 layers reduce-scatter 1 x 16 tokens x 64, fp32, over
    # 2 ranks: (2 - 1) / 2 x 4096 bytes each
    fwd = _rows(doc, "_c10d_functional.reduce_scatter_tensor", "forward")
    assert sum(r["calls"] for r in fwd) == 5 and sum(r["bytes"] for r in fwd) == 5 * 16 * 64 * 4 // 2
    assert doc["world"] == {"fsdp": 1, "tp": 2, "sp": True, "world": 2}


def test_sequence_parallel_without_tensor_parallel_is_refused(capsys):
    assert main(["count", LLAMA, "--seq-len", "16", "--fsdp", "2", "--sp"]) == 2
    assert "--tp 2 or more" in capsys.readouterr().err


def test_count_context_parallel_json_has_the_key_value_all_gathers(capsys):
    pytest.importorskip("transformers")
    assert main(["count", LLAMA, "--seq-len", "128", "--cp", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # each attention all-gathers its keys and values once: 64 tokens x 8 heads (the 2 key heads repeated) x 8 x 2,
    # fp32, half of the gathered buffer sent
    fwd = _rows(doc, "_c10d_functional.all_gather_into_tensor", "forward")
    assert sum(r["calls"] for r in fwd) == 2 and sum(r["bytes"] for r in fwd) == 2 * 64 * 8 * 8 * 2 * 4
    assert doc["world"] == {"fsdp": 1, "tp": 1, "cp": 2, "world": 2}
    # without TP or EP every functional collective is the ring's: its gathers and its gradients' all-to-all
    groups = {(r["kind"], r["group"]) for r in doc["collectives"]}
    assert {("all-gather", "cp"), ("all-to-all", "cp")} <= groups and not {g for _, g in groups} & {"tp", "ep"}


def test_count_fsdp_alone_gathers_the_parameters(capsys):
    pytest.importorskip("transformers")
    assert main(["count", LLAMA, "--seq-len", "16", "--fsdp", "4", "--by", "family", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert "collective" in out


def test_count_ep_json_states_its_routing_assumption(capsys):
    pytest.importorskip("transformers")
    mixtral = "hf:tests/fixtures/hf/mixtral-tiny"  # hidden 64, 4 experts, top-2, 2 layers
    assert main(["count", mixtral, "--seq-len", "16", "--fsdp", "2", "--ep", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world"] == {"fsdp": 2, "tp": 1, "world": 2, "ep": 2, "etp": 1}
    assert doc["assumptions"][0].startswith("balanced routing")
    # per layer, dispatch and combine each send half of the 16 x 2 routed rows x 64 x 4 bytes, plus the 4 experts'
    # row counts (int64), half of them sent
    a2a = _rows(doc, "_c10d_functional.all_to_all_single", "forward")
    assert sum(r["bytes"] for r in a2a) == 2 * (2 * 16 * 2 * 64 * 4 // 2 + 4 * 8 // 2)
    assert {r["group"] for r in doc["collectives"] if r["kind"] == "all-to-all"} == {"ep"}


def test_pipeline_options_without_a_pipeline_are_refused_in_one_line(capsys):
    assert main(["count", LLAMA, "--seq-len", "16", "--microbatches", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "apply to a pipeline" in err and len(err.splitlines()) == 1


def test_fsdp_on_a_real_device_is_refused(capsys):
    assert main(["count", LLAMA, "--seq-len", "16", "--fsdp", "2", "--device", "cpu"]) == 2
    assert "fake process group" in capsys.readouterr().err
