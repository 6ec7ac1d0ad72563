"""The collectives of a sharded count through ``main()``: ``--by collective`` (kind, group, calls, bytes sent per
rank, the link and the time on it), a section under the default table, and ``--by family`` keeping the bytes sent
over links apart from memory traffic."""
import json
import re

import pytest

from flopcount.cli import main

pytest.importorskip("transformers")
LLAMA = "hf:tests/fixtures/hf/llama-gqa-tiny"  # hidden 64, 2 layers
TP = ["count", LLAMA, "--seq-len", "16", "--tp", "2"]
# forward: the embedding's rows and the two row-wise linears of each of the 2 layers, 16 tokens x 64 in fp32,
# all-reduced over 2 ranks (the ring sends 2 (2 - 1) / 2 of the buffer, and adds the half it receives)
FWD_CALLS, FWD_SENT, FWD_ADDS = 5, 5 * 16 * 64 * 4, 5 * 16 * 64 // 2


def test_by_collective_has_kind_group_bytes_link_and_time(capsys):
    from flopcount.device.datasheet import get_device

    assert main(TP + ["--by", "collective", "--device-spec", "H100 SXM", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {(r["kind"], r["group"], r["phase"]): r for r in doc["collectives"]}
    fwd = rows[("all-reduce", "tp", "forward")]
    assert (fwd["calls"], fwd["sent"], fwd["flops"]) == (FWD_CALLS, FWD_SENT, FWD_ADDS)
    # a TP group of 2 consecutive ranks is inside one node: NVLink, at its bandwidth per direction
    assert fwd["link"] == "nvlink"
    assert fwd["seconds"] == pytest.approx(FWD_SENT / get_device("H100 SXM").nvlink)
    assert not any("wait" in k[0] for k in rows)  # waiting on a result sends nothing
    assert sum(r["sent"] for r in doc["collectives"]) == sum(
        r["bytes"] for r in doc["ops"] if r["family"] == "collective")



def test_the_default_table_has_a_section_of_collectives_and_family_keeps_them_apart(capsys):
    assert main(TP) == 0
    out = capsys.readouterr().out
    assert "collectives of this rank:" in out
    section = out[out.index("collectives of this rank:"):]
    header = next(line for line in section.splitlines() if line.startswith("kind"))
    assert header.split()[:5] == ["kind", "group", "phase", "calls", "sent"]
    assert "all-reduce" in section and "--device-spec NAME adds the link" in section

    assert main(TP + ["--by", "family"]) == 0
    out = capsys.readouterr().out
    assert "sent over links" in out and "bytes: memory traffic" in out
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()
             if line.startswith(("family", "collective "))]  # columns are 2 spaces apart; "8.19 k" is one cell
    row = dict(zip(*cells))
    # the collective row moves no memory: its bytes are 0, its FLOP/B unknown ("-"); what it sends is apart
    assert (row["bytes"], row["FLOP/B"]) == ("0 B", "-") and row["sent over links"] != "0 B"


def test_collective_options_need_a_sharded_count(capsys):
    assert main(["count", LLAMA, "--seq-len", "16", "--by", "collective"]) == 2
    assert "--fsdp" in capsys.readouterr().err
