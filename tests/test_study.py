"""The study's grid runner, driven by a fake backend: no model runs, every number is set by the test."""
import os

import pandas as pd
import pytest
import torch

from flopcount import cli, study
from flopcount.base.errors import OutOfMemory
from flopcount.base.report import FlopReport
from flopcount.study import QUICK, StudyConfig, run_study
from flopcount.device.timing import Measurement

PEAK = 1e6


def tiny():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3, bias=False), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8, 2, bias=False))


class FakeBackend:
    """Per sample: conv forward 100, backward 100 (first layer), relu 10/10, linear 20/40; fvcore forward 110."""

    def __init__(self, fail=None, interrupt_after=None):
        self.calls, self.fail, self.interrupt_after = [], dict(fail or {}), interrupt_after

    def device_name(self):
        return "cpu"

    def estimators(self):
        return ["fvcore"]

    def _call(self, *key):
        self.calls.append(key)
        if self.interrupt_after is not None and len(self.calls) > self.interrupt_after:
            raise KeyboardInterrupt
        if key in self.fail:
            raise self.fail[key]

    def count(self, name, batch):
        self._call("count", name, batch)
        rows = []
        for module, fam, fw, bw in (("0", "conv", 100, 100), ("1", "pointwise", 10, 10), ("3", "matmul", 20, 40)):
            rows.append(dict(module=module, op="aten.x", phase="forward", family=fam, status="counted",
                             dtype="float32", flops=fw * batch, bytes=0, calls=1))
            rows.append(dict(module=module, op="aten.x_backward", phase="backward", family=fam, status="counted",
                             dtype="float32", flops=bw * batch, bytes=0, calls=1))
        return FlopReport.from_rows(rows, model=name, batch_size=batch), tiny()

    def forward_flops(self, estimator, name, batch):
        self._call(estimator, name, batch)
        return 110 * batch

    def step_time(self, name, batch):
        self._call("step", name, batch)
        # median 0.5 s per sample; the inclusive quartiles of three runs 0.01 apart are 0.01 apart too
        return Measurement([0.5 * batch - 0.01, 0.5 * batch, 0.5 * batch + 0.01])

    def epoch_time(self, name, batch, dataset):
        self._call("epoch", name, batch)
        return 0.25 * len(dataset), len(dataset)

    def peak(self, mix, refresh=False):
        self.mixes = getattr(self, "mixes", []) + [dict(mix)]  # what the study asked a peak for
        return PEAK, "fake"


CONFIG = StudyConfig(models=("m1", "m2"), batch_sizes=(1, 4), images=6)


def run(tmp_path, backend, config=CONFIG, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("figures", False)
    return run_study(config, str(tmp_path), backend=backend, log=lambda m: None, **kw)


def rows(res):
    return {(r.model, int(r.batch_size), r.method): r for r in res.results.itertuples()}


def test_grid_rows_and_hand_computed_utilization(tmp_path):
    backend = FakeBackend()
    res = run(tmp_path, backend)
    r = rows(res)
    # per model: dispatch + fvcore at 2 batch sizes, one at batch 1, theory/batch/epoch at 2 batch sizes
    assert len(r) == 2 * (2 * 2 + 1 + 2 * 3)
    assert set(res.results["status"]) == {"ok"}
    # dispatch at batch 4: (100+10+20) forward + (100+10+40) backward per sample
    d = r[("m1", 4, "dispatch")]
    assert (d.flops_forward, d.flops_backward, d.flops) == (520, 600, 1120)
    # theory: fvcore forward x 3 over the step time (0.5 s/sample x 4)
    th = r[("m1", 4, "theory")]
    assert th.flops == 3 * 440 and th.seconds == 2.0
    assert th.seconds_spread == pytest.approx(0.01)  # the interquartile range of the step's timings
    assert th.peak_flops == PEAK
    # the peak is asked for the step's precision mix: its matrix work (conv 100 + 100, linear 20 + 40 per sample)
    assert {"fp32": 260.0 * 4} in backend.mixes and {"fp32": 260.0} in backend.mixes
    assert th.utilization == pytest.approx(1320 / 2.0 / PEAK)
    b = r[("m2", 4, "batch")]
    assert b.flops == 1120 and b.utilization == pytest.approx(1120 / 2.0 / PEAK)
    one = r[("m2", 1, "one")]
    assert one.flops == 280 and one.seconds == 0.5
    # epoch: 6 images x 280 FLOPs per sample over 0.25 s per image
    e = r[("m1", 4, "epoch")]
    assert (e.flops, e.samples, e.seconds) == (6 * 280, 6, 1.5)
    assert e.utilization == pytest.approx(6 * 280 / 1.5 / PEAK)


def test_theory_and_batch_share_one_timing(tmp_path):
    backend = FakeBackend()
    run(tmp_path, backend)
    steps = [c for c in backend.calls if c[0] == "step"]
    assert len(steps) == len(set(steps)) == 2 * 2  # one per (model, batch): m1/m2 x 1/4


def test_rerun_skips_every_row(tmp_path):
    first = run(tmp_path, FakeBackend())
    again = FakeBackend()
    res = run(tmp_path, again)
    assert again.calls == []
    assert res.ran == 0 and res.skipped == len(first.results)
    assert res.results.to_csv(index=False) == first.results.to_csv(index=False)


def test_interrupted_run_resumes_where_it_stopped(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, FakeBackend(interrupt_after=5))
    partial = pd.read_csv(tmp_path / "results.csv")
    assert 0 < len(partial) < 22
    backend = FakeBackend()
    res = run(tmp_path, backend)
    assert len(res.results) == 22 and set(res.results["status"]) == {"ok"}
    done_before = {(m, b, meth) for m, b, meth in zip(partial["model"], partial["batch_size"], partial["method"])}
    counted_again = {(c[1], c[2], "dispatch" if c[0] == "count" else c[0]) for c in backend.calls}
    assert not (done_before & counted_again)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]  # atomic writes leave no debris


def test_out_of_memory_and_error_are_recorded_and_the_rest_completes(tmp_path):
    fail = {("step", "m1", 4): OutOfMemory("CUDA out of memory at batch 4"),
            ("count", "m2", 4): ValueError("formula blew up\nsecond line")}
    res = run(tmp_path, FakeBackend(fail=fail))
    r = rows(res)
    assert len(r) == 22
    for meth in ("theory", "batch"):
        assert r[("m1", 4, meth)].status == "oom"
        assert "out of memory" in r[("m1", 4, meth)].message
    assert r[("m1", 4, "epoch")].status == "ok"
    assert r[("m2", 4, "dispatch")].status == "error"
    assert r[("m2", 4, "dispatch")].message == "ValueError: formula blew up"
    # rows that need the failed count say so; the others are unaffected
    assert r[("m2", 4, "batch")].status == "error" and "dispatch count" in r[("m2", 4, "batch")].message
    assert r[("m2", 4, "theory")].status == "ok"
    assert r[("m2", 1, "one")].status == "ok"
    ok = res.results[res.results["status"] == "ok"]
    assert len(ok) == 22 - 5
    # a rerun keeps the failures (finished rows) unless asked to retry errors
    backend = FakeBackend()
    run(tmp_path, backend)
    assert backend.calls == []
    backend = FakeBackend()
    res = run(tmp_path, backend, config=StudyConfig(models=("m1", "m2"), batch_sizes=(1, 4), images=6,
                                                  retry_errors=True))
    assert ("count", "m2", 4) in backend.calls and ("step", "m1", 4) not in backend.calls
    assert set(rows(res)[("m2", 4, "batch")].status for _ in [0]) == {"ok"}


def test_ratio_rows_and_first_layer(tmp_path):
    res = run(tmp_path, FakeBackend())
    rt = res.ratios
    m1 = rt[(rt["model"] == "m1") & (rt["batch_size"] == 1)].set_index(["level", "name"])["ratio"]
    assert m1[("layer_type", "Conv2d")] == 1.0
    assert m1[("layer_type", "Linear")] == 2.0
    assert m1[("layer_type", "ReLU")] == 1.0
    assert m1[("first_layer", "0")] == 1.0
    assert m1[("model", "model")] == pytest.approx(150 / 130)
    assert m1[("family", "matmul")] == 2.0


def test_report_and_figures(tmp_path):
    res = run(tmp_path, FakeBackend(), figures=True)
    text = (tmp_path / "REPORT.md").read_text()
    for needle in ("## 1. Forward FLOPs", "## 2. FLOPs per sample", "## 3. Backward / forward", "## 4. Utilization",
                   "What matches", "0.3 to 0.75", "below 0.04", "epochai.org", "generated images"):
        assert needle in text
    for name in ("estimates", "per_sample", "ratios", "utilization"):
        assert os.path.getsize(tmp_path / "figures" / f"{name}.png") > 1000
        assert f"figures/{name}.png" in text
    # the fake backend cannot count for the roofline: said so, not silently missing
    assert "figure `roofline` not drawn" in text
    assert res.meta["data"].startswith("generated images")


def test_generated_images_are_reproducible_and_shaped():
    ds = study.GeneratedImages(5, (3, 8, 8), num_classes=3)
    x, y = ds[4]
    assert x.shape == (3, 8, 8) and y == 1 and len(ds) == 5
    assert torch.equal(ds[2][0], study.GeneratedImages(5, (3, 8, 8))[2][0])
    with pytest.raises(IndexError):
        ds[5]


def test_missing_cifar_falls_back_to_generated_images_and_says_so(tmp_path):
    ds, desc = study.make_dataset(StudyConfig(images=7, data_root=str(tmp_path)))
    assert len(ds) == 7 and desc.startswith("generated images") and "CIFAR-10 not found" in desc


def test_config_validation_errors_are_study_errors():
    for bad in (dict(batch_sizes=(0,)), dict(methods=("nope",)), dict(models=()), dict(images=0)):
        with pytest.raises(study.StudyError):
            StudyConfig(**bad).validate()


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["study", "--batch-sizes", "0,4", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flopcount: error:")
    assert cli.main(["study", "--methods", "theory,bogus", "--out", str(tmp_path)]) == 2


def test_corrupt_results_file_is_a_clear_error(tmp_path):
    (tmp_path / "results.csv").write_text("not,a,study\n1,2,3\n")
    with pytest.raises(study.StudyError, match="not a study results file"):
        run(tmp_path, FakeBackend())


def test_quick_preset_and_cli_options():
    args = cli.build_parser().parse_args(["study", "--quick", "--batch-sizes", "2,4", "--no-resume"])
    cfg = study.study_config(args)
    assert cfg.models == QUICK.models and cfg.batch_sizes == (2, 4) and cfg.images == QUICK.images
    assert args.resume is False


def test_published_facts_match_the_data_file():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f = pd.read_csv(os.path.join(here, "data", "p100_study_published.csv"))
    peak = f[f["quantity"] == "peak_fp32"].iloc[0]
    assert float(peak["high"]) == study.PUBLISHED["peak_fp32"] == 9.3e12
    util = f[f["quantity"] == "utilization"]
    most = util[util["models"].str.startswith("most")].iloc[0]
    assert (float(most["low"]), float(most["high"])) == study.PUBLISHED["utilization_most"]
    out = util[util["models"].str.contains("mobilenet_v2")].iloc[0]
    assert float(out["high"]) == study.PUBLISHED["utilization_outliers_below"]
    assert tuple(out["models"].split(";")) == study.PUBLISHED["utilization_outliers"]
    ratio = f[f["quantity"] == "backward_to_forward"].iloc[0]
    assert float(ratio["high"]) == study.PUBLISHED["backward_to_forward"]


def test_experiment_script_holds_the_package_defaults():
    from experiments.p100_study import STUDY

    assert STUDY == StudyConfig()
    assert len(STUDY.models) == 13 and STUDY.batch_sizes == (1, 64, 128) and STUDY.images == 10_000


def test_unknown_model_fails_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["study", "--models", "resnet18,no_such_model", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_model" in err[0]
    assert not out.exists()


class ProfilingBackend(FakeBackend):
    """A GPU machine with nsys: the NVTX estimator records one profile per (model, batch) and counts it twice.
    Per sample the de-duplicated count is set 4 forward FLOPs off dispatch's 130 (134 forward, 150 backward), so
    that a runner that copied dispatch's numbers, or mixed up the two counts, fails; the naive one counts the
    conv's kernels under both of their enclosing ranges (+100 each way)."""

    def estimators(self):
        return ["fvcore", "nvtx", "nvtx-naive"]

    def profile_flops(self, method, name, batch):
        self._call(method, name, batch)
        extra = 100 if method == "nvtx-naive" else 0
        return (134 + extra) * batch, (150 + extra) * batch, 0.01 * batch


def test_nvtx_estimator_rows_record_each_estimators_own_count(tmp_path):
    res = run(tmp_path, ProfilingBackend())
    r = rows(res)
    dedup, naive, dispatch = r[("m1", 1, "nvtx")], r[("m1", 1, "nvtx-naive")], r[("m1", 1, "dispatch")]
    assert (dispatch.flops_forward, dispatch.flops_backward) == (130, 150)
    assert (dedup.flops_forward, dedup.flops_backward, dedup.flops) == (134, 150, 284)
    assert (naive.flops_forward, naive.flops_backward, naive.seconds) == (234, 250, 0.01)
    assert dedup.status == naive.status == "ok"
    # like the other peers, only at the smallest batch
    assert ("m1", 4, "nvtx") not in r
    # the report gives each estimator's difference from dispatch, and its verdict follows from the spread: fvcore's
    # 110 against nvtx-naive's 234 is far outside the 5% tolerance on both models
    text = (tmp_path / "REPORT.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("  m1:"))
    for name, value in (("fvcore", 110), ("nvtx", 134), ("nvtx-naive", 234)):
        assert f"{name} {value / 130 - 1:+.1%}" in line
    assert f"{234 / 110 - 1:.1%} apart" in line
    assert "**Forward counting: does not match.**" in text


def test_verdicts_follow_the_numbers():
    from flopcount.study import findings

    # forward GFLOPs: m3's estimators are 11% apart, outside the 5% tolerance; the old report said "matches" here
    est = pd.DataFrame({"dispatch": [1.0, 2.0, 0.9], "fvcore": [1.01, 2.02, 1.0]}, index=["m1", "m2", "m3"])
    text = "\n".join(findings.forward_counting(est))
    assert "**Forward counting: matches for 2 of 3 models.**" in text
    assert "m3: 11.1% apart" in text and "fvcore +11.1%" in text
    assert "**Forward counting: matches.**" in "\n".join(findings.forward_counting(est.loc[["m1", "m2"]]))
    assert "does not match" in findings.forward_counting(est.loc[["m3"]])[0]
    # backward:forward: within 10% of the study's 2:1 or not, model by model
    res = study.StudyResult(out="", results=pd.DataFrame(), ratios=pd.DataFrame(), meta={})
    rat = pd.DataFrame({"Conv2d": [1.85, 1.95], "Linear": [2.0, 1.7]}, index=["m1", "m2"])
    text = "\n".join(findings.ratios(res, rat))
    assert "matches for 1 of 2 ratios the study stated" in text
    assert "*Within 10%:* Conv2d 1.85 to 1.95 (study 2)." in text
    assert "*Not within 10%:* Linear 1.7 to 2 (study 2)." in text


def test_log_bars_start_at_a_round_decade_well_below_the_smallest_bar():
    from flopcount.analyses.plots import log_bars_bottom

    assert log_bars_bottom([0.63, 4.1, 1.8]) == pytest.approx(0.1)  # not 0.6: the bars' lengths stay honest
    assert log_bars_bottom([1.0, 3.0]) == pytest.approx(0.1)  # a bar exactly on a decade keeps a length
    assert log_bars_bottom([250.0]) == pytest.approx(100.0)
