"""The communication roofline: a collective takes the bytes a rank sends / the bandwidth of the link its group
crosses (NVLink inside a node, the node's network / its GPUs across nodes), from the device table."""
from __future__ import annotations

import pytest
import torch

import flopcount
from flopcount.device.datasheet import get_device
from flopcount.analyses.roofline import RooflineError, analyze


def _llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def rank_of_16():
    pytest.importorskip("transformers")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    return flopcount.count(_llama(), {"input_ids": ids, "labels": ids}, world={"fsdp": 4, "tp": 4})


def test_the_table_has_the_links_of_an_h100_node():
    spec = get_device("H100 SXM")
    # NVLink 900 GB/s both directions = 450 GB/s each way; DGX H100: 8 x 400 Gb/s = 400 GB/s per node of 8 GPUs
    assert spec.nvlink == 450e9 and spec.network == 400e9 and spec.gpus_per_node == 8 and spec.link_source


def test_collectives_take_bytes_over_their_link(rank_of_16):
    roof = analyze(rank_of_16, get_device("H100 SXM"))
    ops = roof.ops[roof.ops["family"] == "collective"]
    tp = ops[ops["op"].str.startswith("_c10d_functional")]
    fsdp = ops[ops["op"].str.startswith("c10d.")]
    assert not tp.empty and not fsdp.empty
    # TP 4: ranks 0-3, one node: NVLink. FSDP 4 ranks 4 apart: ranks 0-12, two nodes: 400e9 / 8 per GPU
    assert set(tp["link"]) == {"nvlink"} and set(fsdp["link"]) == {"network"}
    assert tp["t_roofline"].sum() == pytest.approx(tp["bytes"].sum() / 450e9)
    assert fsdp["t_roofline"].sum() == pytest.approx(fsdp["bytes"].sum() / 50e9)
    assert roof.communication_seconds == pytest.approx(tp["bytes"].sum() / 450e9 + fsdp["bytes"].sum() / 50e9)
    # this tiny model sends more than it computes: no overlap could hide its communication
    rest = roof.seconds - roof.communication_seconds
    assert roof.communication_seconds > rest and roof.verdict == "communication"
    assert roof.by("family").loc["collective", "bound"] == "communication"


def test_a_device_without_link_figures_is_an_error(rank_of_16):
    with pytest.raises(RooflineError, match="no link bandwidths"):
        analyze(rank_of_16, get_device("A10"))


def test_a_step_without_collectives_is_unchanged():
    report = flopcount.count(torch.nn.Linear(64, 64), torch.randn(32, 64))
    roof = analyze(report, get_device("H100 SXM"))
    assert roof.communication_seconds == 0 and roof.verdict in ("compute", "memory")
