"""Roofline: intensities, ridge points and verdicts checked against numbers worked out by hand below."""
import math

import pytest
import torch

from flopcount.device.datasheet import get_device, list_devices
from flopcount.device.spec import DeviceSpec
from flopcount.base.report import FlopReport
from flopcount.analyses.roofline import (COMPUTE, MEMORY, RooflineError, analyze, classify, intensity, ridge_point,
                                         roofline_time)
from flopcount.device.peak_policy import op_precision

# A made-up device with round numbers: 100 TFLOP/s fp16, 10 TFLOP/s fp32, 1 TB/s.
TOY = DeviceSpec(name="toy", peaks={"fp32": 10e12, "fp16": 100e12}, bandwidth=1e12, source="test")


def test_ridge_point_is_peak_over_bandwidth():
    assert ridge_point(TOY, "fp32") == pytest.approx(10.0)
    assert ridge_point(TOY, "fp16") == pytest.approx(100.0)
    # P100 PCIe datasheet: 9.3 TFLOP/s fp32, 732 GB/s -> 12.70 FLOP/byte
    assert ridge_point(get_device("P100 PCIe"), "fp32") == pytest.approx(9.3e12 / 732e9)


def test_elementwise_add_is_memory_bound_on_every_device():
    # fp32 add of n elements: n FLOPs; reads 2 x 4n bytes, writes 4n bytes -> 1/12 FLOP per byte
    n = 1 << 20
    flops, nbytes = n, 12 * n
    assert intensity(flops, nbytes) == pytest.approx(1 / 12)
    names = list(list_devices().index)
    assert len(names) >= 10
    for name in names:
        spec = get_device(name)
        assert classify(flops, nbytes, spec, "fp32") == MEMORY, name
        # fp16 add: n FLOPs over 6n bytes, still far below any ridge
        assert classify(n, 6 * n, spec, op_precision("float16", "pointwise", spec=spec)) == MEMORY, name


def test_big_fp16_matmul_is_compute_bound_on_a100():
    n = 4096
    flops = 2 * n ** 3                      # 1.374e11
    nbytes = 3 * n * n * 2                  # two inputs read, one output written, 2 bytes each
    assert intensity(flops, nbytes) == pytest.approx(4096 / 3)  # 2n^3 / 6n^2 = n/3 = 1365.3
    for name in ("A100 SXM 40GB", "A100 PCIe 40GB", "A100 SXM 80GB"):
        spec = get_device(name)
        assert op_precision("float16", "matmul", spec=spec) == "fp16"
        assert ridge_point(spec, "fp16") < 4096 / 3          # 312e12 / 1555e9 = 200.6
        assert classify(flops, nbytes, spec, "fp16") == COMPUTE
        # roofline time = compute time = 1.374e11 / 312e12 = 0.44 ms
        t = roofline_time(flops, nbytes, spec.peak("fp16"), spec.bandwidth)
        assert t == pytest.approx(2 * n ** 3 / 312e12)


def test_small_matmul_is_memory_bound():
    # (64 x 64) @ (64 x 64) fp32: 2*64^3 = 524288 FLOPs over 3*64*64*4 = 49152 bytes -> 10.67 FLOP/byte
    flops, nbytes = 2 * 64 ** 3, 3 * 64 * 64 * 4
    assert intensity(flops, nbytes) == pytest.approx(64 / 6)
    assert classify(flops, nbytes, get_device("A100 SXM 40GB"), "fp32") == MEMORY  # ridge 19.5e12/1555e9 = 12.5
    assert classify(flops, nbytes, TOY, "fp32") == COMPUTE                          # ridge 10


def test_precision_rules():
    a100 = get_device("A100 SXM 40GB")
    p100 = get_device("P100 PCIe")
    assert op_precision("float32", "conv", tf32=True, spec=a100) == "tf32"
    assert op_precision("float32", "conv", tf32=True, spec=p100) == "fp32"  # no TF32 before Ampere
    assert op_precision("bfloat16", "matmul", spec=a100) == "bf16"
    # pointwise kernels compute fp16/bf16 in fp32
    assert op_precision("bfloat16", "pointwise", spec=a100) == "fp32"
    assert op_precision("float32", "pointwise", tf32=True, spec=a100) == "fp32"
    assert op_precision("float64", "norm", spec=a100) == "fp64"
    assert math.isinf(intensity(5, 0)) and math.isnan(intensity(0, 0))


def _report(rows):
    return FlopReport.from_rows(rows, model="toy", batch_size=1, estimator="test")


def test_analyze_sums_roofline_time_and_overhead_share():
    rows = [
        # matmul, fp16: 2e12 FLOPs / 100e12 = 20 ms compute; 1e9 bytes / 1e12 = 1 ms memory -> 20 ms, compute
        dict(module="fc", op="aten.mm", phase="forward", dtype="float16", family="matmul", status="counted",
             flops=2_000_000_000_000, bytes=1_000_000_000, calls=1),
        # relu, fp16, held against fp32: 1e9 / 10e12 = 0.1 ms; 4e9 bytes / 1e12 = 4 ms -> 4 ms, memory
        dict(module="act", op="aten.relu", phase="forward", dtype="float16", family="pointwise", status="counted",
             flops=1_000_000_000, bytes=4_000_000_000, calls=2),
        # a view: nothing
        dict(module="act", op="aten.view", phase="forward", dtype="float16", family="memory", status="zero",
             flops=0, bytes=0, calls=3),
        # an integer op: bytes only, 1 ms
        dict(module="", op="aten.argmax", phase="forward", dtype="int64", family="reduction", status="counted",
             flops=0, bytes=1_000_000_000, calls=1),
    ]
    r = analyze(_report(rows), TOY, measured_seconds=0.050)
    ops = r.ops.set_index("op")
    assert list(ops["bound"]) == [COMPUTE, MEMORY, "-", MEMORY]
    assert ops.loc["aten.mm", "ridge"] == pytest.approx(100.0)
    assert ops.loc["aten.relu", "ridge"] == pytest.approx(10.0)
    assert ops.loc["aten.mm", "t_roofline"] == pytest.approx(0.020)
    assert ops.loc["aten.relu", "t_roofline"] == pytest.approx(0.004)
    assert r.seconds == pytest.approx(0.025)
    assert r.seconds_per_flop == pytest.approx(0.025 / 2_001_000_000_000)
    assert r.memory_bound_share == pytest.approx(0.005 / 0.025)
    assert r.unexplained_seconds == pytest.approx(0.025)
    assert r.unexplained_share == pytest.approx(0.5)
    # attainable 2.001e12 FLOPs / 25 ms = 80.04 TFLOP/s; the step's peak is its matrix work's: the mm in fp16,
    # 100 TFLOP/s (the same rule as utilization and the study); ceiling 80.04 / 100
    assert r.attainable_flop_per_s == pytest.approx(2.001e12 / 0.025)
    assert r.peak_flops == pytest.approx(100e12)
    assert r.utilization_ceiling == pytest.approx(0.8004)
    fam = r.by("family")
    assert list(fam.index[:2]) == ["matmul", "pointwise"]
    assert fam.loc["matmul", "share"] == pytest.approx(0.8)
    assert fam.loc["pointwise", "intensity"] == pytest.approx(0.25)
    assert fam.loc["pointwise", "bound"] == MEMORY and fam.loc["matmul", "bound"] == COMPUTE
    assert fam["share"].sum() == pytest.approx(1.0)


def test_mixed_family_and_errors():
    rows = [
        dict(module="a", op="aten.convolution", phase="forward", dtype="float32", family="conv", status="counted",
             flops=30e9, bytes=1e9, calls=1),   # 30 FLOP/B > 10: compute, 3 ms
        dict(module="b", op="aten.convolution", phase="forward", dtype="float32", family="conv", status="counted",
             flops=1e9, bytes=1e9, calls=1),    # 1 FLOP/B: memory, 1 ms
    ]
    r = analyze(_report(rows), TOY)
    g = r.by("family")
    assert g.loc["conv", "memory_share"] == pytest.approx(0.25)
    assert g.loc["conv", "bound"] == "mixed"
    assert r.unexplained_share is None
    with pytest.raises(RooflineError):
        analyze(_report(rows), DeviceSpec(name="nobw", peaks={"fp32": 1e12}, bandwidth=None, source="t"))
    with pytest.raises(RooflineError):
        analyze(_report([dict(rows[0], dtype="float16")]), DeviceSpec(name="no16", peaks={"fp32": 1e12},
                                                                      bandwidth=1e9, source="t"))


class _AddThenMatmul(torch.nn.Module):
    def forward(self, a, b):
        return (a + b) @ b


def test_counted_ops_on_a100():
    # forward only, fp16, 4096 x 4096 on meta tensors: the add reads 2 and writes 1 matrix (3 x 4096^2 x 2 bytes,
    # 4096^2 FLOPs): memory-bound; the matmul does 2 x 4096^3 FLOPs on the same 3 matrices: compute-bound
    import flopcount

    n = 4096
    a = torch.empty(n, n, dtype=torch.float16, device="meta")
    report = flopcount.count(_AddThenMatmul(), (a, a), backward=False)
    spec = get_device("A100 SXM 40GB")
    ops = analyze(report, spec).ops.set_index("op")
    assert ops.loc["aten.add", "intensity"] == pytest.approx(n * n / (3 * n * n * 2))
    assert ops.loc["aten.add", "bound"] == MEMORY and ops.loc["aten.add", "precision"] == "fp32"
    assert ops.loc["aten.mm", "intensity"] == pytest.approx(2 * n ** 3 / (3 * n * n * 2))
    assert ops.loc["aten.mm", "bound"] == COMPUTE and ops.loc["aten.mm", "precision"] == "fp16"
    assert ops.loc["aten.mm", "t_roofline"] == pytest.approx(2 * n ** 3 / 312e12)
    assert ops.loc["aten.add", "t_roofline"] == pytest.approx(3 * n * n * 2 / 1555e9)


def test_a_named_gpu_is_counted_with_its_kernels(monkeypatch):
    """``from_spec`` counts with the kernel choices of the device it is asked about (a GPU's attention and LSTM
    paths, not the CPU's that happens to run the count); a measured CPU spec keeps the CPU's."""
    import flopcount.counting as engine
    from flopcount.analyses import roofline

    seen = []
    real = engine.count_step
    monkeypatch.setattr(engine, "count_step", lambda *a, **k: seen.append(k.get("as_device")) or real(*a, **k))
    roofline.from_spec("alexnet", "A100 SXM 80GB", batch=1, input_shape=(3, 64, 64), num_classes=10)
    cpu = DeviceSpec(name="cpu (test)", peaks={"fp32": 1e11}, bandwidth=1e10, source="test", measured=True,
                     kernels="cpu")
    roofline.from_spec("alexnet", cpu, batch=1, input_shape=(3, 64, 64), num_classes=10)
    assert seen == ["cuda", "cpu"]
    assert get_device("A100 SXM 80GB").kernels == "cuda"
