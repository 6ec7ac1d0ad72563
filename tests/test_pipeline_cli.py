"""`flopcount count MODEL --pp N [--rank R | --all-ranks]`: a pipeline rank and every distinct rank, from the
command line, on the tiny Llama fixture (2 layers, hidden 64, vocabulary 512)."""
from __future__ import annotations

import json

import pytest

from flopcount.cli import main

LLAMA = "hf:tests/fixtures/hf/llama-gqa-tiny"
ACT = 16 * 64 * 4  # one sample's hidden states, fp32, 16 tokens


def test_all_ranks_json_has_one_row_per_stage_and_the_worlds_sum(capsys):
    pytest.importorskip("transformers")
    assert main(["count", LLAMA, "--seq-len", "16", "--batch", "4", "--pp", "2", "--tp", "2", "--microbatches",
                 "2", "--all-ranks", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["ranks"]
    # PP 2 x TP 2: ranks 0-1 run stage 0, ranks 2-3 stage 1; one counted for each, standing for 2
    assert [(r["rank"], r["ranks_alike"], r["stages"]) for r in rows] == [(0, 2, [0]), (2, 2, [1])]
    assert doc["total"]["ranks"] == 4
    for phase in ("forward", "backward", "total"):
        assert doc["total"]["flops"][phase] == 2 * (rows[0]["flops"][phase] + rows[1]["flops"][phase])
    assert rows[0]["flops"] == doc["flops"]  # the rank the document is (rank 0) is the first row
    assert doc["pipeline"]["microbatches"] == 2 and doc["pipeline"]["bubble"] == 1 / 3  # (2-1) / (2+2-1)
    assert doc["world"]["pp"] == 2 and doc["world"]["world"] == 4


def test_rank_picks_a_later_stage(capsys):
    pytest.importorskip("transformers")
    assert main(["count", LLAMA, "--seq-len", "16", "--batch", "2", "--pp", "2", "--rank", "1", "--format",
                 "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rank"] == 1 and doc["pipeline"]["rank_stages"] == [1]
    # the last stage sends back the input gradient of each of its 2 microbatches of one sample
    sent = [r for r in doc["ops"] if r["op"] == "c10d.send"]
    assert [(r["phase"], r["bytes"], r["calls"]) for r in sent] == [("backward", 2 * ACT, 2)]


@pytest.mark.parametrize("args, words", [(["--pp", "2", "--rank", "2"], "not in a world of 2"),
                                         (["--microbatches", "2"], "apply to a pipeline"),
                                         (["--all-ranks"], "sharded layout")])
def test_bad_pipeline_arguments_fail_in_one_line(args, words, capsys):
    assert main(["count", LLAMA, "--seq-len", "16", "--batch", "2"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
