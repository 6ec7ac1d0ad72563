"""The docs' example plug-in, installed through the entry-point group as a package would install it, then used
by name in count and compare: third-party estimators get the same request and the same checks as the built-ins."""
import math
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from torch import nn

import flopcount
from flopcount.analyses.compare import TOTAL
from flopcount.estimators import available

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide" / "compare.md"
NAME = "linear-only"


def _example_code() -> str:
    """The python block of the "Comparing estimators" guide page that defines the example plug-in."""
    section = GUIDE.read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "class LinearOnly" in b]
    assert len(blocks) == 1, "the guide's example plug-in is missing"
    return blocks[0]


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The example as an installed distribution: its module and a dist-info with the entry point."""
    info = tmp_path / "flopcount_linear_only-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flopcount-linear-only\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[flopcount.estimators]\n{NAME} = linear_only_example:LinearOnly\n")
    (tmp_path / "linear_only_example.py").write_text(_example_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "linear_only_example", raising=False)
    return tmp_path


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


# batch 4: 4 x 6 x 5 + 4 x 5 x 3 = 180 multiply-adds in the two linear layers, bias adds not counted
MACS = 4 * 6 * 5 + 4 * 5 * 3


def test_found_through_the_entry_point_group(installed):
    assert NAME in [ep.name for ep in metadata.entry_points(group="flopcount.estimators")]
    assert NAME in available()


def test_count_by_name(installed):
    rep = flopcount.count(_model(), torch.randn(4, 6), estimator=NAME)
    assert rep.estimator == NAME and rep.phases == ("forward",) and rep.batch_size == 4
    assert rep.total() == rep.total("forward") == 2 * MACS
    assert dict(zip(rep.frame["module"], rep.frame["flops"])) == {"0": 2 * 4 * 6 * 5, "2": 2 * 4 * 5 * 3}


def test_same_checks_as_the_built_ins(installed):
    with pytest.raises(flopcount.EstimatorError, match=f"^{NAME} cannot run on device 'cuda'; it runs on cpu$"):
        flopcount.count(_model(), torch.randn(4, 6), estimator=NAME, device="cuda")
    with pytest.raises(flopcount.EstimatorError, match=f"^{NAME} cannot honour loss_fn"):
        flopcount.count(_model(), torch.randn(4, 6), estimator=NAME, loss_fn=lambda out: out.sum())
    with torch.device("meta"):
        meta = _model()
    with pytest.raises(flopcount.EstimatorError, match="needs real weights"):
        flopcount.count(meta, torch.randn(4, 6), estimator=NAME)


def test_compare_by_name(installed):
    table = flopcount.compare(_model(), torch.randn(4, 6), estimators=("fvcore", NAME))
    row = table[(table["op"] == "linear") & (table["phase"] == "forward")].iloc[0]
    assert row[NAME] == row["fvcore"] == 2 * MACS
    assert row["dispatch"] == 2 * MACS + 4 * 5 + 4 * 3  # dispatch adds 1 per output element for each bias
    assert f"{NAME}: bias add not counted" in row["reason"]
    back = table[(table["op"] == TOTAL) & (table["phase"] == "backward")].iloc[0]
    assert math.isnan(back[NAME]) and f"{NAME}: does not see the backward phase" in back["reason"]
    assert table.attrs["phases"][NAME] == ["forward"] and table.attrs["native"][NAME] == {"forward": MACS}
