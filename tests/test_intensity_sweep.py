"""The intensity sweep's bookkeeping, with a fake timer that follows a known roofline; and one real compiled run
(slow)."""
import json

import pytest
import torch

from flopcount.analyses.sweep import SweepError, crossover, intensity_sweep, repeated_mul, rungs

N = 4096
BW = 100e9       # fake device: 100 GB/s
PEAK = 800e9     # and 800 GFLOP/s: the fp32 kernel moves 8 bytes per element, so r* = 8 x 800e9 / 100e9 = 64


def _fake(seen):
    def compile_fn(f):
        seen.append(getattr(f, "r", None))
        return f  # eager: same results, no compile

    def timer(fn, device):
        fn()
        r = seen[-1]
        if r is None:  # the fusion demo: eager and compiled take 2 and 1 passes over memory
            return 1e-3
        return max(2 * N * 4 / BW, N * r / PEAK)

    return compile_fn, timer


def test_sweep_follows_the_fake_roofline():
    seen = []
    compile_fn, timer = _fake(seen)
    sw = intensity_sweep(size=N, max_r=256, compile_fn=compile_fn, timer=timer)
    f = sw.frame.set_index("r")
    assert list(f.index) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert f.loc[1, "bytes"] == 2 * N * 4 and f.loc[256, "flops"] == N * 256
    # memory-bound below 64: bandwidth at its ceiling, FLOP/s = r x 100e9 / 8
    assert f.loc[8, "bytes_per_s"] == pytest.approx(BW)
    assert f.loc[8, "flop_per_s"] == pytest.approx(8 * BW / 8)
    # compute-bound above: FLOP/s at its ceiling, bandwidth falls as 1/r
    assert f.loc[256, "flop_per_s"] == pytest.approx(PEAK)
    assert f.loc[256, "bytes_per_s"] == pytest.approx(BW * 64 / 256)
    assert sw.crossover_r == pytest.approx(64)
    assert list(f["bound"]) == ["memory"] * 6 + ["compute"] * 3
    assert sw.reached and not sw.notes
    assert f.loc[4, "intensity"] == pytest.approx(4 / 8)


def test_sweep_that_stops_short_says_so():
    seen = []
    compile_fn, timer = _fake(seen)
    sw = intensity_sweep(size=N, max_r=32, compile_fn=compile_fn, timer=timer, fusion=False)
    assert sw.crossover_r == pytest.approx(32)  # the best FLOP/s seen is still on the bandwidth slope
    assert not sw.reached and "raise --max-r" in sw.notes[0]


def test_fusion_demo_bytes():
    seen = []
    compile_fn, timer = _fake(seen)
    sw = intensity_sweep(size=N, max_r=1, compile_fn=compile_fn, timer=timer)
    fus = sw.fusion.set_index("mode")
    # eager cos(cos(x)): read x, write t, read t, write out = 4 x N x 4 bytes; fused: read x, write out
    assert fus.loc["eager", "bytes"] == 4 * N * 4
    assert fus.loc["compiled", "bytes"] == 2 * N * 4
    assert fus.loc["eager", "kernels"] == 2 and fus.loc["compiled", "kernels"] == 1


def test_repeated_mul_and_errors():
    x = torch.ones(3)
    out = torch.empty(3)
    repeated_mul(5)(x, out)
    assert torch.equal(out, torch.full((3,), 32.0))
    assert rungs(256)[-1] == 256 and rungs(100)[-1] == 64 and rungs(1) == [1]
    with pytest.raises(SweepError):
        rungs(0)
    with pytest.raises(SweepError):
        intensity_sweep(size=0)
    with pytest.raises(SweepError):
        intensity_sweep(size=8, dtype="int32")
    if not torch.cuda.is_available():
        with pytest.raises(SweepError):
            intensity_sweep(size=8, device="cuda")


def test_wrong_kernel_is_caught():
    def broken(f):
        return lambda x, out: out.copy_(x)  # "folds" the chain into nothing

    with pytest.raises(SweepError, match="wrong results"):
        intensity_sweep(size=N, max_r=2, compile_fn=broken, timer=lambda fn, d: 1.0)


def test_crossover_formula():
    import pandas as pd

    f = pd.DataFrame({"flop_per_s": [1e9, 4e9], "bytes_per_s": [8e9, 4e9]})
    assert crossover(f, 4) == pytest.approx(8 * 4e9 / 8e9)


@pytest.mark.slow
def test_real_compiled_sweep_script(tmp_path):
    from experiments.intensity_sweep import main

    out = tmp_path / "sweep"
    assert main(["--out", str(out), "--size", str(1 << 20), "--max-r", "16", "--repeats", "3"]) == 0
    for name in ("sweep.csv", "fusion.csv", "summary.json", "intensity_sweep.png"):
        assert (out / name).exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["crossover_r"] > 0
