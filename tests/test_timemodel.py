"""The time model worked by hand: a GEMM's waves and its time at 1 and 1.01 waves, the memory-bound time of a large
add, the launch floor of a step of tiny ops, the bound of each; the host's launches beside the GPU; the idle share
of a kernel timeline; the device table's SMs."""
import math

import pandas as pd
import pytest

from flopcount.device.datasheet import get_device
from flopcount.base.report import FlopReport
from flopcount.device.timemodel.core import COMPUTE, LAUNCH, MEMORY, Gemm, Params, Step, launches, op_time, tiling
from flopcount.analyses.prediction.predict import predict_report
from flopcount.analyses.prediction.versus import idle_share

# round parameters, so that every expected time below is a hand computation
P = Params(matrix_efficiency=0.5, k_overhead=0.0, bandwidth_efficiency=0.8, bandwidth_half_bytes=1e6,
           kernel_floor_s=4e-6, host_launch_s=10e-6, vector_efficiency=0.5, reduction_floor_s=8e-6)
SQUARE = ((128, 128),)  # one tile shape: the wave count is then the tile count over the SMs


def test_gemm_waves_at_one_and_one_point_zero_one():
    sms, peak = 100, 100e12
    per_sm = peak * P.matrix_efficiency / sms  # 5e11 FLOP/s per SM
    one_tile = 2 * 128 * 128 * 4096 / per_sm  # seconds of one 128x128 tile over K = 4096
    full = tiling(Gemm(m=128 * 100, n=128, k=4096), sms, peak, P, tiles=SQUARE)
    assert full.tiles == 100 and full.waves == pytest.approx(1.0) and full.split_k == 1
    assert full.seconds == pytest.approx(one_tile)
    # 101 tiles on 100 SMs: 1.01 waves, run as 2 (the last wave holds one tile but takes a whole wave's time)
    over = tiling(Gemm(m=128 * 101, n=128, k=4096), sms, peak, P, tiles=SQUARE)
    assert over.tiles == 101 and over.waves == pytest.approx(1.01)
    assert over.seconds == pytest.approx(2 * one_tile)
    # the FLOPs grew 1%, the time 100%: against the same FLOPs at the plain share of peak, 1.98x
    plain = Gemm(m=128 * 101, n=128, k=4096).flops / (peak * P.matrix_efficiency)
    assert over.seconds / plain == pytest.approx(200 / 101)


def test_gemm_tile_overhead_and_split_k():
    sms, peak = 100, 100e12
    p = Params(**{**vars(P), "k_overhead": 64.0})
    t = tiling(Gemm(m=128 * 100, n=128, k=4096), sms, peak, p, tiles=SQUARE)
    assert t.seconds == pytest.approx(2 * 128 * 128 * (4096 + 64) / (peak * 0.5 / sms))
    # one tile over K = 8192 fills 1 SM of 100: K is split in 32 parts of 256 (the least a split leaves)
    s = tiling(Gemm(m=128, n=128, k=8192), sms, peak, P, tiles=SQUARE)
    assert s.split_k == 32 and s.tiles == 32
    assert s.seconds == pytest.approx(2 * 128 * 128 * 256 / (peak * 0.5 / sms))


def test_large_gemm_is_compute_bound_and_chooses_the_faster_tile():
    spec = get_device("H100 SXM")
    g = Gemm(8192, 8192, 8192)
    t = op_time(g.flops, 3 * 8192 * 8192 * 2, peak=spec.peak("bf16"), bandwidth=spec.bandwidth, p=P, matrix=True,
                gemms=[g], sms=spec.sms)
    assert t.bound == COMPUTE
    ideal = g.flops / (spec.peak("bf16") * P.matrix_efficiency)
    # per tile shape, ceil(tiles / 132) waves of tiles of tm x tn: 256x128 -> 2048 tiles, 16 waves of 1 unit (a
    # unit: a 256x128 tile's time); 128x128 -> 4096, 32 waves of 1/2; 128x64 -> 8192, 63 of 1/4 (15.75);
    # 64x64 -> 16384 tiles, 125 waves of 1/8 (15.625): the least, against 16384 / 132 = 124.1 waves of work
    assert t.compute == pytest.approx(ideal * 125 / (16384 / 132))


def test_memory_bound_time_of_a_large_add():
    spec = get_device("H100 SXM")
    n = 1 << 30  # fp32 elements: two inputs read, one output written
    nbytes = 3 * 4 * n
    t = op_time(n, nbytes, peak=spec.peak("fp32"), bandwidth=spec.bandwidth, p=P)
    assert t.bound == MEMORY
    assert t.seconds == pytest.approx((nbytes + 1e6) / (3.35e12 * 0.8))
    assert t.compute == pytest.approx(n / (67e12 * 0.5))


def _tiny_report(ops: int, calls: int) -> FlopReport:
    rows = [dict(module=f"m{i}", op="aten.add", phase="forward", dtype="float32", family="pointwise",
                 status="counted", flops=16 * calls, bytes=3 * 64 * calls, calls=calls) for i in range(ops)]
    return FlopReport(frame=pd.DataFrame(rows), model="tiny", phases=["forward"])


def test_launch_floor_of_a_step_of_tiny_ops():
    spec = get_device("H100 SXM")
    pred = predict_report(_tiny_report(ops=50, calls=4), spec, params=P)
    kernels = 50 * 4
    assert set(pred.ops["bound"]) == {LAUNCH}
    assert pred.step.gpu_seconds == pytest.approx(kernels * 4e-6)
    # the host launches each kernel at 10 us: the host, not the GPU, sets the step, and says so
    assert pred.step.host_seconds == pytest.approx(kernels * 10e-6)
    assert pred.step.host_bound and pred.seconds == pytest.approx(kernels * 10e-6)
    assert pred.roofline_seconds < 1e-3 * pred.seconds  # the bare roofline is 3 orders below
    # one CUDA graph launch per step: the GPU's floor is what is left
    graph = predict_report(_tiny_report(ops=50, calls=4), spec, params=P, mode="graph")
    assert graph.step.launches == 1 and not graph.step.host_bound
    assert graph.seconds == pytest.approx(kernels * 4e-6)


def test_a_view_launches_nothing():
    spec = get_device("H100 SXM")
    rep = FlopReport(frame=pd.DataFrame([dict(module="", op="aten.view", phase="forward", dtype="float32",
                                              family="view", status="zero", flops=0, bytes=0, calls=7)]),
                     model="v", phases=["forward"])
    pred = predict_report(rep, spec, params=P)
    assert int(pred.ops["kernels"].sum()) == 0 and pred.seconds == 0


def test_step_and_launch_modes():
    assert Step(1e-3, 50, 10e-6).seconds == pytest.approx(1e-3)
    assert Step(1e-3, 200, 10e-6).host_bound
    assert launches(100, 20, "eager") == 100 and launches(100, 20, "compiled") == 20 + 40
    assert launches(100, 20, "graph") == 1
    with pytest.raises(ValueError):
        launches(1, 0, "lazy")


def test_idle_share_between_kernels():
    k = pd.DataFrame({"start": [0, 5, 20], "end": [10, 8, 30], "device": [0, 0, 0]})
    assert idle_share(k) == pytest.approx(10 / 30)  # [0, 10] covers [5, 8]; the gap is 10..20
    assert math.isnan(idle_share(k.iloc[:0]))


def test_device_table_gives_sms_with_a_source():
    h100 = get_device("H100 SXM")
    assert h100.sms == 132 and h100.l2_bytes == 50e6 and "whitepaper" in h100.arch_source
    assert get_device("NVIDIA A100-PG509-200").name == "A100 SXM 40GB"
    assert get_device("MI250").vendor == "amd" and h100.vendor == "nvidia"


def test_readme_parameter_table_is_the_fitted_one():
    import os
    import re

    from flopcount.device.timemodel.params import document

    nv, amd = document()["params"]["nvidia"], document()["params"]["amd"]
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "guide", "predict.md"),
              encoding="utf-8") as fh:
        text = fh.read()
    us = lambda s: f"{s * 1e6:.1f} us"  # noqa: E731
    for line, values in (("| matrix_efficiency |", [f"{nv['matrix_efficiency']:.3f}"]),
                         ("| fma_efficiency |", [f"{nv['fma_efficiency']:.3f}"]),
                         ("| k_overhead |", [f"{nv['k_overhead']:.1f}"]),
                         ("| unaligned_efficiency |", [f"{nv['unaligned_efficiency']:.3f}"]),
                         ("| matrix_setup_s |", [us(nv["matrix_setup_s"])]),
                         ("| broadcast_efficiency |", [f"{nv['broadcast_efficiency']:.3f}"]),
                         ("| kernel_floor_s, reduction_floor_s |",
                          [us(nv["kernel_floor_s"]), us(nv["reduction_floor_s"]), us(amd["kernel_floor_s"]),
                           us(amd["reduction_floor_s"])]),
                         ("| host_launch_s |", [us(nv["host_launch_s"]), us(amd["host_launch_s"])])):
        row = next(r for r in text.splitlines() if r.startswith(line))
        for v in values:
            assert re.search(re.escape(v) + r"\b", row), (v, row)


def test_an_nsys_export_names_its_gpu(tmp_path):
    import sqlite3

    from flopcount.device.timemodel.trace_device import nsys_gpus, profile_device

    db = tmp_path / "gpu.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE TARGET_INFO_GPU (id INTEGER, name TEXT, smCount INTEGER)")
    con.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 'NVIDIA H100 80GB HBM3', 132)")
    con.commit()
    con.close()
    names, sms = nsys_gpus(str(db))
    assert names == ["NVIDIA H100 80GB HBM3"] and sms == [132]
    spec, notes = profile_device(names, None, sms)
    assert spec.name == "H100 SXM" and not notes
    half, notes = profile_device(["MI250"], None, [104])  # one die of the 208-CU module
    assert half.sms == 104 and half.bandwidth == pytest.approx(3.2768e12 / 2) and notes
    assert nsys_gpus(str(tmp_path / "missing.sqlite")) == ([], [])


def test_product_shapes_are_noted_during_a_count():
    import torch

    from flopcount.counting import count_step
    from flopcount.device.timemodel.record import as_rates, shapes_noted

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    with shapes_noted() as log:
        count_step(model, torch.randn(8, 64))
    rates = as_rates(log)
    # forward: x[8,64] @ W1^T and h[8,256] @ W2^T; backward: the weights' gradients (dW = dY^T @ X) and the input
    # gradient of the second layer only (the first layer's input needs none)
    assert rates[("aten.addmm", False)] == {Gemm(8, 256, 64): 1, Gemm(8, 10, 256): 1}
    assert rates[("aten.mm", True)] == {Gemm(10, 256, 8): 1, Gemm(8, 256, 10): 1, Gemm(256, 64, 8): 1}


def test_a_reducing_op_has_one_reducing_kernel():
    # a loss of 14 small kernels (BCE with logits on CUDA): one of them reduces, 13 are elementwise
    t = op_time(100, 400, peak=67e12, bandwidth=3.35e12, p=P, kernels=14, reducing=True)
    assert t.bound == LAUNCH and t.seconds == pytest.approx(13 * 4e-6 + 8e-6)


def test_bytes_of_a_profiled_call():
    import json

    from flopcount.analyses.prediction.calls import call_facts

    text = json.dumps([[[1024, 256], [1024, 256]], ["float", "float"], [None, None]])
    nbytes, dtype, gemms = call_facts("aten.add", text, 1024 * 256, "kineto")
    assert nbytes == 3 * 1024 * 256 * 4 and dtype == "float32" and gemms is None  # two read, one written
    zeros = json.dumps([[[1024, 256]], ["c10::BFloat16"], [None]])
    assert call_facts("aten.zeros_like", zeros, 0, "kineto")[:2] == (1024 * 256 * 2, "bfloat16")  # written only
    mm = json.dumps([[[64, 128], [128, 32]], ["float", "float"], [None, None]])
    nbytes, _, gemms = call_facts("aten.mm", mm, 2 * 64 * 128 * 32, "kineto")
    assert gemms == [Gemm(64, 32, 128)] and nbytes == (64 * 128 + 128 * 32 + 64 * 32) * 4


def test_unaligned_operands_and_the_setup_of_a_product_kernel():
    sms, peak = 100, 100e12
    p = Params(**{**vars(P), "unaligned_efficiency": 0.25, "matrix_setup_s": 10e-6})
    # fp32: rows start on 16 bytes when m, n and k are multiples of 4 elements; bf16: of 8
    assert Gemm(128, 128, 4096).aligned and not Gemm(128, 125, 4096).aligned
    assert not Gemm(128, 4, 4096, element_bytes=2).aligned and Gemm(128, 8, 4096, element_bytes=2).aligned
    # attention's m and k count queries and keys (one query in a decode step): only the head size is a row length
    assert Gemm(1, 128, 2177, 32, element_bytes=2, rows="n").aligned and not Gemm(1, 128, 2177, 32, 2).aligned
    # a convolution's implicit GEMM: m counts output pixels (7 x 7), k = 3 input channels x 7 x 7 is a row length
    assert Gemm(49, 64, 576, rows="nk").aligned and not Gemm(12544, 64, 3 * 7 * 7, rows="nk").aligned
    one_tile = 2 * 128 * 128 * 4096  # FLOPs of one 128x128 tile over K = 4096
    # 100 tiles, one wave: the setup once, then one tile at half the per-SM peak (aligned) or a quarter (not)
    aligned = tiling(Gemm(128 * 100, 128, 4096), sms, peak, p, tiles=SQUARE)
    assert aligned.seconds == pytest.approx(10e-6 + one_tile / (peak * 0.5 / sms))
    # n = 125 still needs one 128-wide tile per row of tiles: the same tiles, at the unaligned share
    unaligned = tiling(Gemm(128 * 100, 125, 4096), sms, peak, p, tiles=SQUARE)
    assert unaligned.tiles == 100 and unaligned.seconds == pytest.approx(10e-6 + one_tile / (peak * 0.25 / sms))
    # the FMA units load one element at a time anyway: an fp32 product there keeps its own share
    fma = Params(**{**vars(p), "fma_efficiency": 0.9})
    t = tiling(Gemm(128 * 100, 125, 4096), sms, peak, fma, tiles=SQUARE, fma=True)
    assert t.seconds == pytest.approx(10e-6 + one_tile / (peak * 0.9 / sms))


def test_a_broadcasting_elementwise_op_moves_its_bytes_slower():
    p = Params(**{**vars(P), "broadcast_efficiency": 0.5})
    nbytes = 3 * 4 * (1 << 28)
    plain = op_time(1 << 28, nbytes, peak=67e12, bandwidth=3.35e12, p=p)
    wide = op_time(1 << 28, nbytes, peak=67e12, bandwidth=3.35e12, p=p, broadcast=True)
    assert plain.memory == pytest.approx((nbytes + 1e6) / (3.35e12 * 0.8))
    assert wide.memory == pytest.approx((nbytes + 1e6) / (3.35e12 * 0.5)) and wide.bound == MEMORY


def test_a_loss_backward_does_not_reduce():
    from flopcount.device.timemodel.core import reduces

    assert reduces("aten.mse_loss", "loss") and not reduces("aten.mse_loss_backward", "loss")
    assert reduces("aten.native_layer_norm_backward", "norm") and not reduces("aten.add", "pointwise")


def test_bytes_of_copies_lists_and_broadcasts():
    import json

    from flopcount.analyses.prediction.calls import broadcasts, call_facts

    # copy_ writes its destination without reading it: the source read, the destination written, once each
    copy = json.dumps([[[1024, 256], [1024, 256], []], ["float", "float", "Scalar"], [None, None, None]])
    assert call_facts("aten.copy_", copy, 0, "kineto")[0] == 2 * 1024 * 256 * 4
    # a list of tensors is recorded without their sizes: no bytes
    cat = json.dumps([[[], []], ["TensorList", "Scalar"], [None, None]])
    assert math.isnan(call_facts("aten.cat", cat, 0, "kineto")[0])
    # [1024, 256] / [1024, 1]: the second broadcasts; against a Scalar nothing does
    div = json.dumps([[[1024, 256], [1024, 1]], ["float", "float"], [None, None]])
    same = json.dumps([[[1024, 256], []], ["float", "Scalar"], [None, None]])
    assert broadcasts("aten.div", div, "kineto") and not broadcasts("aten.div", same, "kineto")
    assert not broadcasts("aten.mm", json.dumps([[[64, 128], [128, 32]], ["float", "float"], [None, None]]),
                          "kineto")
