"""The table renderer: human units, widths that fit, colour only on a terminal; every command's table through it;
the module tree, its sums and parameters; csv and json untouched."""
import io
import json
import math
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
import torchvision

import flopcount
from flopcount.device import cpu_probe
from flopcount.cli import main
from flopcount.cli import render as R
from flopcount.base.report import OWN

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MLP_FILE = textwrap.dedent("""
    import torch

    def build():
        return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
""")


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(MLP_FILE)
    return f"{path}:build"


@pytest.fixture(autouse=True)
def fake_cpu_probe(tmp_path, monkeypatch):
    """No real CPU probe: utilization holds the step against a 'measured' 2 GFLOP/s and 10 GB/s."""
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: 2e9)
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 1e10)


def assert_fits(text: str, width: int):
    lines = text.splitlines()
    assert lines, "nothing printed"
    widest = max(lines, key=len)
    assert len(widest) <= width, f"{len(widest)} > {width}: {widest!r}"


def cli_table(capsys, monkeypatch, width, *argv):
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # not a terminal: no colour
    assert_fits(out, width)
    return out


# --- units -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, text", [
    (7_018_217_472, "7.02 G"), (10_686_381_309, "10.7 G"), (512, "512"), (0, "0"), (1000, "1.00 k"),
    (999_700, "1.00 M"),  # rounds up into the next prefix, never "1000 k"
    (9.3e12, "9.30 T"), (-2_500_000, "-2.50 M"), (float("nan"), "-"), (None, "-"), (float("inf"), "inf"),
])
def test_si_flops(value, text):
    assert R.si(value) == text


def test_si_bytes_and_rates():
    assert R.fmt(116e6, R.BYTES) == "116 MB"
    assert R.fmt(316_679_216, R.BYTES) == "317 MB"
    assert R.fmt(16, R.BYTES) == "16 B"
    assert R.fmt(732e9, R.RATE, unit="B/s") == "732 GB/s"
    assert R.fmt(1.55e12, R.RATE, unit="FLOP/s") == "1.55 TFLOP/s"


@pytest.mark.parametrize("value, text", [
    (0.001332, "1.33 ms"), (41e-6, "41.0 us"), (0.516689, "517 ms"), (2.5, "2.50 s"), (0, "0 s"),
    (6.94e-6, "6.94 us"), (5e-10, "500 ps"), (0.99996, "1.00 s"), (1234.5, "1,234 s"),
])
def test_seconds(value, text):
    assert R.seconds(value) == text


def test_shares_and_ratios():
    assert R.share(0.8593) == "85.9%" and R.share(1.0) == "100.0%" and R.share(1e-5) == "<0.1%"
    assert R.share(0) == "0.0%" and R.delta(0.034) == "+3.4%" and R.delta(-1) == "-100.0%"
    assert R.ratio(59.32) == "59.3" and R.ratio(0.6) == "0.600" and R.ratio(float("inf")) == "inf"
    assert R.fmt(1234567, R.INT) == "1,234,567"


# --- fitting and colour -----------------------------------------------------------------------------------------
def wide_frame():
    return pd.DataFrame({
        "name": ["aten._scaled_dot_product_flash_attention_for_cpu_backward", "aten.mm", "x"],
        "a": [7e9, 2e6, 1.0], "b": [1e8, 3e5, 2.0], "c": [5, 6, 7], "note": ["short", "a " * 60, ""],
    })


WIDE_COLS = [R.Col("name"), R.Col("a", R.FLOPS), R.Col("b", R.BYTES, drop=2), R.Col("c", R.INT, drop=1),
             R.Col("note", wrap=True)]


@pytest.mark.parametrize("width", [200, 100, 60, 40, 20, 8])
def test_no_line_wider_than_the_width(width):
    text = R.table(wide_frame(), WIDE_COLS, title=["a title line " * 12], notes=["a note " * 30],
                   total={"a": 7.002e9}, width=width, color=False)
    assert_fits(text, width)


def test_columns_are_left_out_lowest_first_and_said():
    frame = wide_frame().drop(columns="note")
    cols = WIDE_COLS[:4]
    full = R.table(frame, cols, width=200, color=False)
    assert "left out" not in full and full.splitlines()[0].split() == ["name", "a", "b", "c"]
    narrow = R.table(frame, cols, width=40, color=False)
    header = narrow.splitlines()[0].split()
    assert header[:2] == ["name", "a"] and "c" not in header  # c (drop=1) goes before b (drop=2)
    assert "left out to fit 40 columns: c" in narrow.replace("\n", " ")


def test_total_row_under_a_rule():
    frame = pd.DataFrame({"op": ["a", "b"], "flops": [3e9, 1e9]})
    text = R.table(frame, [R.Col("op"), R.Col("flops", R.FLOPS)], total={"flops": 4e9}, width=80, color=False)
    lines = text.splitlines()
    assert lines[-1].split() == ["total", "4.00", "G"] and set(lines[-2].replace(" ", "")) == {"-"}


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    assert R.use_color(Tty()) and not R.use_color(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not R.use_color(Tty())
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("TERM", "dumb")
    assert not R.use_color(Tty())
    frame = pd.DataFrame({"op": ["a", "other"], "flops": [3e9, 1e9]})
    painted = R.table(frame, [R.Col("op"), R.Col("flops", R.FLOPS)], total={"flops": 4e9}, width=30, color=True)
    assert "\x1b[1m" in painted and "\x1b[2m" in painted
    plain = R.table(frame, [R.Col("op"), R.Col("flops", R.FLOPS)], total={"flops": 4e9}, width=30, color=False)
    assert "\x1b" not in plain


def test_top_sums_the_rest():
    frame = pd.DataFrame({"total": [5, 1, 7, 2, 3], "bytes": [1, 1, 1, 1, 1]}, index=list("abcde"))
    t = R.top(frame, 2, "total", ["total", "bytes"])
    assert list(t.index) == ["a", "c", R.OTHER]
    assert t.loc[R.OTHER, "total"] == 1 + 2 + 3 and t.loc[R.OTHER, "bytes"] == 3
    assert R.top(frame, 5, "total", ["total"]) is frame


# --- the module tree ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resnet50():
    model = torchvision.models.resnet50()
    return model, flopcount.count(model, torch.randn(2, 3, 224, 224))


def _subtree(flat, path):
    """The flat per-module frame summed over a module and everything below it: the independent value."""
    if path == "":
        return flat.sum()
    return flat[[m == path or m.startswith(path + ".") for m in flat.index]].sum()


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4])
def test_tree_rows_sum_their_children_and_match_the_flat_frame(resnet50, depth):
    model, report = resnet50
    flat = report.by("module")
    tree = report.by("module", depth=depth)
    cols = ["forward", "backward", "total", "bytes", "calls", "params"]
    assert tree.loc["", "total"] == report.total() and tree.loc["", "bytes"] == report.total_bytes()
    assert tree.loc["", "params"] == sum(p.numel() for p in model.parameters())
    assert tree["depth"].max() == depth
    depths = list(tree["depth"])
    parents = 0
    for i, path in enumerate(tree.index):
        kids = []
        for j in range(i + 1, len(depths)):
            if depths[j] <= depths[i]:
                break
            if depths[j] == depths[i] + 1:
                kids.append(j)
        if kids:
            parents += 1
            assert (tree.iloc[kids][cols].sum() == tree.iloc[i][cols]).all(), path
        if not path.endswith(OWN):
            expect = _subtree(flat, path)
            for c in ("forward", "backward", "total", "bytes", "calls"):
                assert tree.loc[path, c] == expect[c], (path, c)
            mod = model.get_submodule(path)
            assert tree.loc[path, "params"] == sum(p.numel() for p in mod.parameters()), path
    assert parents >= (1 if depth else 0)


def test_own_rows_hold_what_a_module_does_itself(resnet50):
    _, report = resnet50
    tree = report.by("module", depth=3)
    flat = report.by("module")
    # a bottleneck's residual add and the loss run in the module itself, outside its submodules
    assert tree.loc["layer1.0." + OWN, "forward"] == flat.loc["layer1.0", "forward"] > 0
    assert tree.loc[OWN, "total"] == flat.loc["", "total"] > 0
    assert report.by("module").equals(flat)  # without depth: the flat frame, as before
    with pytest.raises(ValueError):
        report.by("op", depth=1)
    with pytest.raises(ValueError):
        report.by("module", depth=-1)


def test_tree_without_recorded_parameters():
    rows = [dict(module="a.b", op="aten.mm", phase="forward", flops=10, bytes=4, calls=1),
            dict(module="a", op="aten.add", phase="forward", flops=1, bytes=4, calls=1)]
    tree = flopcount.FlopReport.from_rows(rows, phases=("forward",)).by("module", depth=2)
    assert list(tree.index) == ["", "a", "a.b", "a." + OWN]
    assert tree["params"].isna().all() and list(tree["total"]) == [11, 11, 10, 1]


def test_cli_depth_1_lists_the_children_with_their_parameters(resnet50, capsys, monkeypatch):
    model, _ = resnet50
    names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"]
    out = cli_table(capsys, monkeypatch, 100, "count", "resnet50", "--by", "module", "--depth", "1")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.startswith("  ")}
    for name in names:
        params = sum(p.numel() for p in model.get_submodule(name).parameters())
        assert rows[name][1] == type(model.get_submodule(name)).__name__  # the layer type, then its parameters
        assert " ".join(rows[name][3:5]).startswith(R.si(params)), (name, rows[name])
    assert main(["count", "resnet50", "--by", "module", "--depth", "1", "--format", "csv"]) == 0
    csv = pd.read_csv(io.StringIO(capsys.readouterr().out), keep_default_na=False).set_index("module")
    for name in names:
        assert csv.loc[name, "params"] == sum(p.numel() for p in model.get_submodule(name).parameters())
    assert list(csv[csv["depth"] == 1].index[:len(names)]) == names
    assert csv.loc["", "params"] == sum(p.numel() for p in model.parameters())


def test_tree_top_keeps_the_largest_leaves_and_sums_the_rest(capsys, monkeypatch):
    from flopcount.cli.count import tree_top

    report = flopcount.count(torchvision.models.resnet18(), torch.randn(1, 3, 224, 224))
    tree = report.by("module", depth=3)
    cols = ["forward", "backward", "total", "bytes", "calls", "params"]
    top = tree_top(tree, 4, cols)
    depths = list(top["depth"])
    leaves = [i for i in range(len(top) - 1) if depths[i + 1] <= depths[i] or math.isnan(depths[i + 1])]
    assert len(leaves) == 4 and top.index[-1].strip() == R.OTHER
    for c in cols:  # the leaves shown and "other" add up to the root
        assert top.iloc[leaves][c].sum() + top.iloc[-1][c] == tree.loc["", c], c
    out = cli_table(capsys, monkeypatch, 100, "count", "resnet18", "--depth", "3", "--top", "4")
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("---")) + 1  # after a header that may wrap
    # the last row is "other", above the legend (and the line naming the columns left out to fit, if any)
    rows = [line for line in lines if not line.startswith(("1 multiply-add", "(left out"))]
    assert lines[first].split()[0] == "resnet18" and rows[-1].startswith("other ")


def test_count_json_with_depth_adds_the_tree(capsys):
    assert main(["count", "resnet18", "--depth", "1", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["module"]: r for r in doc["modules"]}
    assert rows[""]["total"] == doc["flops"]["total"] and rows["fc"]["params"] == 512 * 1000 + 1000


# --- every command's table at width 100 ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["count", "resnet18"], ["count", "resnet18", "--by", "module"], ["count", "resnet18", "--by", "family"],
    ["count", "resnet18", "--by", "phase"], ["count", "resnet18", "--top", "5"],
    ["count", "vit_b_16", "--by", "module", "--depth", "4"],
    ["roofline", "resnet18", "--device-spec", "P100 PCIe", "--measured", "0.01"],
    ["roofline", "mobilenet_v2", "--device-spec", "A100 SXM 40GB", "--by", "op", "--top", "8"],
    ["roofline", "resnet18", "--device-spec", "P100 PCIe", "--by", "module"],
    ["peaks"], ["peaks", "--sources"],
])
def test_model_commands_fit_100_columns(argv, capsys, monkeypatch):
    cli_table(capsys, monkeypatch, 100, *argv)


def test_count_table_reads_in_human_units(capsys, monkeypatch):
    report = flopcount.count(torchvision.models.resnet18(), torch.randn(1, 3, 224, 224))
    out = cli_table(capsys, monkeypatch, 100, "count", "resnet18")
    conv_bwd = int(report.frame.query("op == 'aten.convolution_backward'")["flops"].sum())
    row = next(line for line in out.splitlines() if line.startswith("aten.convolution_backward"))
    assert R.si(conv_bwd) in row and str(conv_bwd) not in out
    assert R.share(conv_bwd / report.total()) in row
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert R.si(report.total()) in total and "100.0%" in total


def test_peaks_fit_120_columns_with_sources(capsys, monkeypatch):
    out = cli_table(capsys, monkeypatch, 120, "peaks", "--sources")
    assert "NVIDIA Tesla P100 datasheet" in out and "9.30 T" in out
    short = cli_table(capsys, monkeypatch, 120, "peaks")
    assert "datasheet" not in short


def test_compare_fits(mlp, capsys, monkeypatch):
    out = cli_table(capsys, monkeypatch, 100, "compare", mlp, "--batch", "4", "--input-shape", "10",
                    "--estimators", "dispatch,profiler")
    assert "linear" in out and "dispatch" in out


def test_utilization_fits(mlp, capsys, monkeypatch):
    out = cli_table(capsys, monkeypatch, 100, "utilization", mlp, "--batch", "4", "--input-shape", "10",
                    "--steps", "1", "--warmup", "0")
    assert "utilization" in out and "seconds per step" in out and "2.00 GFLOP/s" in out


def test_overhead_fits(mlp, capsys, monkeypatch):
    out = cli_table(capsys, monkeypatch, 100, "overhead", mlp, "--input-shape", "10", "--batches", "1,2,4",
                    "--steps", "1", "--warmup", "0", "--min-seconds", "0")
    assert "s/step" in out and "batch" in out


def test_overhead_table_units():
    from flopcount.cli.roofline import overhead_table
    from flopcount.analyses.overhead import overhead_ladder

    res = overhead_ladder(lambda b: 0.002 * b, [1, 2, 4], model="m", device="cpu")
    text = overhead_table(res, "cpu", "median", width=100, color=False)
    assert_fits(text, 100)
    assert "2.00 ms" in text and "8.00 ms" in text and "+100.0%" in text


def test_nsys_fits(tmp_path, capsys, monkeypatch):
    import nvtx_profile_gen as gen

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    path = gen.generate(model, torch.randn(2, 3, 2, 2), str(tmp_path / "p.sqlite"))
    out = cli_table(capsys, monkeypatch, 100, "nsys", path)
    assert "aten.addmm" in out and "GPU time" in out
    out = cli_table(capsys, monkeypatch, 100, "nsys", path, "--top", "3")
    assert any(line.startswith("other ") for line in out.splitlines())


@pytest.mark.skipif(not (HERE / "fixtures" / "nsys" / "mfu_2gpu_before.sqlite").exists(), reason="fixture missing")
def test_nsys_without_shapes_fits(capsys, monkeypatch):
    out = cli_table(capsys, monkeypatch, 100, "nsys", str(HERE / "fixtures" / "nsys" / "mfu_2gpu_before.sqlite"))
    assert "flash_attn::_flash_attn_forward" in out


def test_study_summary_fits(tmp_path):
    from test_study import FakeBackend, run

    from flopcount.cli.study import study_table

    res = run(tmp_path, FakeBackend())
    text = study_table(res, width=100, color=False)
    assert_fits(text, 100)
    u = res.results.query("model == 'm1' and method == 'batch' and batch_size == 4")["utilization"].iloc[0]
    assert R.ratio(float(u)) in text and "batch b=4" in text


def test_mismatch_table_keeps_exact_counts():
    from flopcount.cli.count import mismatch_table

    frame = pd.DataFrame([dict(module="m", op="aten.x", phase="forward", flops_1=1_000_000_001,
                               flops_n=8_000_000_000, expected=8_000_000_008, ratio=7.99999)])
    text = mismatch_table(frame)
    assert "8,000,000,000" in text and "8,000,000,008" in text


# --- csv and json keep the exact numbers ------------------------------------------------------------------------
@pytest.mark.parametrize("by", ["op", "module", "phase", "family"])
def test_count_csv_is_the_frame_unrounded(by, capsys):
    report = flopcount.count(torchvision.models.resnet18(), torch.randn(1, 3, 224, 224))
    assert main(["count", "resnet18", "--by", by, "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert out == report.by(by).to_csv()
    parsed = pd.read_csv(io.StringIO(out))
    col = "flops" if by == "phase" else "total"
    assert parsed[col].sum() == report.total()  # whole numbers, nothing rounded
    if by == "module":
        assert list(parsed.columns) == ["module", "forward", "backward", "total", "bytes", "calls"]
        assert len(parsed) == report.frame["module"].nunique()


def test_count_json_has_no_new_keys(capsys):
    report = flopcount.count(torchvision.models.resnet18(), torch.randn(1, 3, 224, 224))
    assert "params" in report.meta
    assert main(["count", "resnet18", "--format", "json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)
    # "input": one sample's shape and where it came from (no silent default); "tied" only for a model that has any
    assert set(doc) == {"model", "batch_size", "estimator", "phases", "flops", "bytes", "uncounted", "notes", "ops",
                        "device", "input"}
    assert doc["flops"]["total"] == report.total() and not math.isnan(doc["bytes"])
    assert out == json.dumps(dict(report.to_dict(), model="resnet18",
                                  input={"shape": "3x224x224", "source": "family"}), indent=2, default=str) + "\n"
