"""The batch-doubling test, driven by fake timers whose times are written out here."""
import math

import pytest

from flopcount.device.timing import Measurement
from flopcount.analyses.overhead import OOM, OVERHEAD_BOUND, SCALES, LadderError, overhead_ladder, parse_batches


def test_fixed_cost_plus_per_sample_cost():
    # t(b) = 10 ms fixed + 0.1 ms per sample: doubling 1->2 adds 0.1/10.1 = 1%, ..., 64->128 adds 6.4/16.4 = 39%
    timer = lambda b: 0.010 + 0.0001 * b
    res = overhead_ladder(timer, [1, 2, 4, 8, 16, 32, 64, 128], threshold=0.10)
    f = res.frame.set_index("batch")
    assert math.isnan(f.loc[1, "growth"]) and f.loc[1, "verdict"] == ""
    assert f.loc[2, "added"] == pytest.approx(0.0001 / 0.0101)
    assert f.loc[128, "added"] == pytest.approx(0.0064 / 0.0164)
    # added(b) = 0.0001 (b/2) / (0.010 + 0.0001 b/2) < 0.1  <=>  b/2 < 11.1  <=>  b <= 22: doublings to 2..16
    assert [f.loc[b, "verdict"] for b in (2, 4, 8, 16)] == [OVERHEAD_BOUND] * 4
    assert [f.loc[b, "verdict"] for b in (32, 64, 128)] == [SCALES] * 3
    assert res.overhead_bound_up_to == 16
    assert "overhead-bound up to batch 16" in res.verdict and "10%" in res.verdict
    assert f.loc[8, "per_sample"] == pytest.approx(0.0108 / 8)
    assert any("not yet full" in n for n in res.notes)


def test_threshold_is_an_option():
    timer = lambda b: 1.0 + 0.2 * b          # 1->2 adds 0.2/1.2 = 16.7%, 2->4 0.4/1.4 = 28.6%
    assert overhead_ladder(timer, [1, 2, 4], threshold=0.10).overhead_bound_up_to is None
    assert overhead_ladder(timer, [1, 2, 4], threshold=0.20).overhead_bound_up_to == 2
    assert "not overhead-bound" in overhead_ladder(timer, [1, 2, 4]).verdict


def test_compute_bound_model_and_non_doubling_ladder():
    # time proportional to batch: every doubling doubles the time; a x4 step is two doublings
    res = overhead_ladder(lambda b: 0.5 * b, [1, 4, 8])
    assert list(res.frame["growth"][1:]) == pytest.approx([2.0, 2.0])
    assert res.overhead_bound_up_to is None


def test_measurements_and_out_of_memory():
    def timer(b):
        if b >= 8:
            raise MemoryError("too big")
        base = 1.0 + 0.01 * b
        return Measurement([base - 0.001, base, base, base + 0.001])  # inclusive quartiles: base -/+ 0.00025

    res = overhead_ladder(timer, [1, 2, 4, 8, 16])
    f = res.frame
    assert list(f["batch"]) == [1, 2, 4, 8]          # stops at the first out-of-memory rung
    assert f["verdict"].iloc[-1] == OOM and math.isnan(f["seconds"].iloc[-1])
    assert f["seconds"].iloc[0] == pytest.approx(1.01) and f["iqr"].iloc[0] == pytest.approx(0.0005)
    assert list(f["runs"][:3]) == [4, 4, 4]
    assert res.overhead_bound_up_to == 4


def test_timing_module_out_of_memory_is_caught():
    timing = pytest.importorskip("flopcount.device.timing")

    def timer(b):
        if b > 1:
            raise timing.OutOfMemory("no room")
        return 1.0

    assert overhead_ladder(timer, [1, 2]).frame["verdict"].iloc[-1] == OOM


@pytest.mark.parametrize("bad", ["", "4", "1,1", "2,1", "0,1", "a,b", "1,-2"])
def test_bad_ladders(bad):
    with pytest.raises(LadderError):
        parse_batches(bad)


def test_bad_timer_and_threshold():
    with pytest.raises(LadderError):
        overhead_ladder(lambda b: 0.0, [1, 2])
    with pytest.raises(LadderError):
        overhead_ladder(lambda b: 1.0, [1, 2], threshold=1.5)


def test_min_statistic_uses_the_fastest_step():
    T = Measurement
    # batch 1: steps of 1.0 s, one of them slowed to 3.0 by other work; batch 2: 1.05 s. The medians say 1.0 ->
    # 1.05 anyway; with a noisy majority at batch 1 only the minimum sees the step's own cost.
    ladder = {1: T([3.0, 3.0, 1.0]), 2: T([1.05, 1.05, 1.05])}
    by_min = overhead_ladder(lambda b: ladder[b], [1, 2], stat="min").frame
    by_median = overhead_ladder(lambda b: ladder[b], [1, 2], stat="median").frame
    assert by_min["growth"].iloc[1] == pytest.approx(1.05)
    assert by_median["growth"].iloc[1] == pytest.approx(0.35)
    with pytest.raises(LadderError):
        overhead_ladder(lambda b: 1.0, [1, 2], stat="mean")
