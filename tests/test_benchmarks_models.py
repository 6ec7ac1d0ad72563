"""The model benchmarks run at a tiny size and print their figures (no time is asserted: speed lives in
benchmarks/)."""
import csv
import re

import pytest

from helpers import run_benchmark as run

pytestmark = pytest.mark.bench  # `-m 'not bench'` leaves the benchmarks' smoke tests out


def test_lm_count_speed_prints_the_ratio_with_its_spread():
    pytest.importorskip("transformers")
    out = run("lm_count_speed.py", "--rounds", "2", "--layers", "1", "--batch", "1", "--seq", "32", "--skip-llama")
    assert re.search(r"ratio flopcount / FlopCounterMode = \d+\.\d\d \(median; range \d+\.\d\d-\d+\.\d\d over 2", out)


@pytest.mark.slow
def test_lm_count_speed_counts_the_llama_shaped_model():
    pytest.importorskip("transformers")
    out = run("lm_count_speed.py", "--skip-gpt2", "--llama-seq", "64")  # GPT-2's part: the test above
    line = [l for l in out.splitlines() if l.startswith("Llama-3-8B-shaped")][0]
    assert "8.03 B parameters" in line and "on meta" in line and " 0 uncounted ops" in line
    assert "GPT-2" not in out and "ratio" not in out  # --skip-gpt2 ran the Llama count alone


def test_infer_speed_prints_the_ratios_with_their_spread():
    pytest.importorskip("transformers")
    out = run("infer_speed.py", "--rounds", "2", "--steps", "2", "--layers", "1", "--prompt", "32", "--batch", "1",
              "--skip-llama")
    for peer in ("remember=False", "FlopCounterMode"):
        assert re.search(rf"ratio flopcount / {peer} = \d+\.\d\d \(median; range \d+\.\d\d-\d+\.\d\d over 2", out)


@pytest.mark.slow
def test_infer_speed_counts_the_llama_shaped_generation():
    pytest.importorskip("transformers")
    out = run("infer_speed.py", "--skip-peers", "--prompt", "64", "--new", "3", "--batch", "1")  # peers: above
    line = [l for l in out.splitlines() if l.startswith("Llama-3-8B-shaped (32 layers)")][0]
    assert "(2 decode steps)" in line and " 0 uncounted ops" in line
    assert "ratio" not in out  # --skip-peers ran the example alone


@pytest.mark.slow
def test_plan_speed_counts_the_405b_shape_exactly():
    pytest.importorskip("transformers")
    out = run("plan_speed.py", "--cases", "train405b", "--repeat", "1")
    assert re.search(r"train405b +median \d+\.\d\d s .* +\d+ +True", out), out


def test_torchvision_table_writes_rows_with_reasons(tmp_path):
    out_csv = tmp_path / "t.csv"
    out = run("torchvision_table.py", "--out", str(out_csv), "--models", "resnet18,fcn_resnet50")
    assert "2 models: 2 counted" in out
    rows = {r["model"]: r for r in csv.DictReader(open(out_csv))}
    assert rows["resnet18"]["ratio"] == "1.0" and rows["resnet18"]["downloaded"] == "no"
    assert "auxiliary classifier" in rows["fcn_resnet50"]["reason"]
