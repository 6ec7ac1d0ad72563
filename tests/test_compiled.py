"""Compiled and fused work in a recorded profile: counted, or listed with its time, never a silent 0.

The Inductor format (``kernel_flop`` / ``kernel_num_gb`` in the args of the launch record PyTorch opens around each
generated kernel, ``torch/_inductor/runtime/triton_heuristics.py``, ``CachingAutotuner.get_profiler_kwargs``, filled
in from ``inductor_meta`` by ``torch/_inductor/codegen/triton.py``; copied onto kernel events by
``torch/_inductor/analysis/profile_analysis.py``, ``_augment_trace_helper``) is written by hand in
``inductor_trace_gen.py``, with every expected figure worked there.
"""
import json
import os
import sys
from pathlib import Path

import pytest

from flopcount.cli import main as cli
from flopcount.profiles import analyze_trace
from flopcount.profiles import compiled, trace_rules

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import inductor_trace_gen as gen  # noqa: E402

KINETO = Path(os.environ.get("FLOPCOUNT_KINETO_FIXTURES", HERE / "fixtures" / "kineto"))
A100 = KINETO / "a100_dlrm_train_control.json.gz"
MI250 = KINETO / "mi250_minitoy_train.json.gz"


@pytest.fixture(scope="module")
def inductor_trace(tmp_path_factory):
    return gen.write(tmp_path_factory.mktemp("ind") / "compiled_step.json")


def test_inductor_kernels_counted_per_kernel_in_their_region_and_phase(inductor_trace):
    a = analyze_trace(inductor_trace)
    ind = a.inductor.set_index("kernel")
    # from the launch record (forward), the kernel event (backward), the launch record (backward)
    assert ind.loc["triton_poi_fused_add_relu_0", ["phase", "region", "flops"]].tolist() == \
        ["forward", "CompiledFunction", 4096]
    assert ind.loc["triton_poi_fused_threshold_backward_2", ["phase", "region", "flops"]].tolist() == \
        ["backward", "CompiledFunctionBackward", 2048]
    assert ind.loc["triton_tem_fused_mm_3", ["phase", "flops"]].tolist() == ["backward", 65_536]
    assert ind.loc["triton_poi_fused_add_relu_0", "gb"] == pytest.approx(4.9e-5)
    # kernels without figures are not in the Inductor rows
    assert "triton_red_fused_sum_1" not in ind.index and "triton_poi_fused_mul_4" not in ind.index
    assert a.report.total("forward") == gen.FORWARD_FLOPS  # 4096 + the extern mm 2*64*32*16
    assert a.report.total("backward") == gen.BACKWARD_FLOPS
    assert a.report.total("optimizer") == gen.ADAM_FLOPS  # 110 elements x (13 + 2 weight decay)


def test_time_counted_or_listed(inductor_trace):
    a = analyze_trace(inductor_trace)
    assert a.time_shares[compiled.COUNTED] == pytest.approx(gen.COUNTED_US / gen.TOTAL_US)
    assert a.time_shares[compiled.UNCOUNTED] == pytest.approx((gen.UNCOUNTED_REGION_US + gen.UNCOUNTED_FBGEMM_US)
                                                              / gen.TOTAL_US)
    u = a.uncounted_time().set_index("what")
    # both forward graphs' kernels without figures, under the region's name, with the region's calls
    assert u.loc["CompiledFunction", "seconds"] == pytest.approx(gen.UNCOUNTED_REGION_US * 1e-6)
    assert u.loc["CompiledFunction", "calls"] == 2 and u.loc["CompiledFunction", "phase"] == "forward"
    assert u.loc["fbgemm::split_embedding_codegen_lookup_sgd_function", "seconds"] == pytest.approx(7e-6)
    assert u.loc["fbgemm::split_embedding_codegen_lookup_sgd_function", "calls"] == 1
    # every microsecond of device time is in exactly one row
    assert a.time_rows["seconds"].sum() == pytest.approx(gen.TOTAL_US * 1e-6)


def test_cli_footer_and_json(inductor_trace, capsys):
    assert cli(["trace", str(inductor_trace)]) == 0
    out = capsys.readouterr().out
    assert "GPU time with FLOPs: 66.7% counted, 0.0% in zero-FLOP ops, 33.3% not known" in out
    assert "CompiledFunction (forward, 2 call(s), 17.8%)" in out  # 8 of 45 us
    assert "3 Inductor kernel launch(es) counted from their own kernel_flop" in out
    assert cli(["trace", str(inductor_trace), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["time_shares"]["counted"] == pytest.approx(30 / 45)
    assert {r["what"] for r in doc["uncounted_time"]} == {"CompiledFunction",
                                                         "fbgemm::split_embedding_codegen_lookup_sgd_function"}
    assert sum(r["flops"] for r in doc["inductor_kernels"]) == 4096 + 2048 + 65_536
    assert cli(["trace", str(inductor_trace), "--by", "phase"]) == 0
    assert "66.7% counted" in capsys.readouterr().out


def test_figures_on_records_only_where_they_are_numbers():
    assert trace_rules.amount(4096) == 4096.0
    for bad in (0, -1, None, "12", float("nan"), float("inf"), True, 2.0 ** 63):
        assert trace_rules.amount(bad) != trace_rules.amount(bad)  # NaN: absent


@pytest.mark.skipif(not A100.exists(), reason="Kineto fixtures missing (tests/fixtures/kineto)")
def test_a100_every_region_and_kernel_counted_or_listed():
    """The A100 DLRM step: fbgemm's embedding ops, NCCL, and apex's FusedAdam (multi_tensor_apply kernels launched
    from Python, under no aten op) were 0 FLOPs with nothing said; each is now listed with its time, and the shares
    add up to all of the device time."""
    a = analyze_trace(A100)
    shares = a.time_shares
    assert sum(shares.values()) == pytest.approx(1.0)
    assert a.time_rows["seconds"].sum() == pytest.approx(a.kernel_groups["gpu_s"].sum())
    u = a.uncounted_time()
    listed = set(u["what"])
    assert "Optimizer.step#FusedAdam.step" in listed  # the optimizer phase: no longer a silent 0
    assert u.loc[u["what"] == "Optimizer.step#FusedAdam.step", "phase"].tolist() == ["optimizer"]
    assert "fbgemm::split_embedding_codegen_lookup_rowwise_adagrad_function" in listed
    assert any(w.startswith("nccl:") for w in listed)
    # every compiled region (none in this recording) would be a row of its own or inside a counted op
    names = set(a.op_ranges["op"]) | listed
    regions = [n for n in names if compiled.is_region(n)]
    assert all(r in listed or (a.time_rows["what"] == r).any() for r in regions)
    # every kernel charged to a range that is no aten op is uncounted time, none is 0 with nothing said
    foreign = a.ops[(a.ops["calls"] == 0) & (a.ops["kernels"] > 0)]
    assert set(foreign["op"]) <= listed | {compiled.OUTSIDE}
    assert 0.25 < shares["counted"] < 0.40  # the matmuls and pointwise ops: 30.9% of the GPU time


@pytest.mark.skipif(not A100.exists(), reason="Kineto fixtures missing (tests/fixtures/kineto)")
def test_a100_optimizer_phase_is_not_a_silent_zero(capsys):
    assert cli(["trace", str(A100), "--by", "phase"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("optimizer"))
    assert row.split()[1:3] == ["-", "-"]  # FLOPs and naive: not known, not 0
    assert "Optimizer.step#FusedAdam.step (optimizer, 6 call(s), 1.5%)" in out


@pytest.mark.skipif(not MI250.exists(), reason="Kineto fixtures missing (tests/fixtures/kineto)")
def test_compare_inductor_explains_each_difference(capsys):
    """profile_analysis, called on the same trace: the MLP's Linear(128, 128) on 5 rows. Hand-worked: mm
    2*5*128*128 = 163,840 both; addmm flopcount 163,840 + 640 bias adds, profile_analysis 163,840 on each of the
    op's 2 kernels (the GEMM and the bias copy) = 327,680; pointwise ops: not in torch's flop registry."""
    pytest.importorskip("torch._inductor.analysis.profile_analysis")
    assert cli(["trace", str(MI250), "--compare-inductor", "--format", "json"]) == 0
    rows = {(r["op"], r["phase"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    mm = rows[("aten.mm", "backward")]
    assert (mm["flopcount"], mm["profile_analysis"], mm["why"]) == (163_840, 163_840, "same")
    addmm = rows[("aten.addmm", "forward")]
    assert (addmm["flopcount"], addmm["profile_analysis"]) == (164_480, 327_680)
    assert "bias" in addmm["why"] and "2 kernels per call, 2x" in addmm["why"]
    relu = rows[("aten.relu", "forward")]
    assert (relu["flopcount"], relu["profile_analysis"]) == (640, 0) and "registry" in relu["why"]
    assert cli(["trace", str(MI250), "--compare-inductor"]) == 0
    assert "[1]" in capsys.readouterr().out


def test_compare_inductor_reads_kernel_flop_as_flopcount_does(inductor_trace, capsys):
    """On the hand-written compiled step, Inductor's figures (on the launch record, which the kernels' External id
    names, or on the kernel event) are read alike by both, and so is the extern mm (2*64*32*16)."""
    pytest.importorskip("torch._inductor.analysis.profile_analysis")
    assert cli(["trace", str(inductor_trace), "--compare-inductor", "--format", "json"]) == 0
    rows = {r["op"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for op, flops in [("triton_poi_fused_threshold_backward_2", 2048), ("triton_poi_fused_add_relu_0", 4096),
                      ("triton_tem_fused_mm_3", 65_536), ("aten.mm", 65_536)]:
        assert (rows[op]["flopcount"], rows[op]["profile_analysis"], rows[op]["why"]) == (flops, flops, "same")
    adam = rows["aten._fused_adam_"]
    assert (adam["flopcount"], adam["profile_analysis"]) == (gen.ADAM_FLOPS, 0) and "registry" in adam["why"]
    assert rows["triton_red_fused_sum_1"]["flopcount"] is None
    fbgemm = rows["fbgemm::split_embedding_codegen_lookup_sgd_function"]
    assert fbgemm["flopcount"] is None and "no formula" in fbgemm["why"]


def test_compare_inductor_only_by_op_and_with_kernels(inductor_trace, capsys):
    assert cli(["trace", str(inductor_trace), "--compare-inductor", "--by", "phase"]) == 2
    cpu_only = KINETO / "cpu_only_rank34.json.gz"
    if cpu_only.exists():
        assert cli(["trace", str(cpu_only), "--compare-inductor"]) == 2
        assert "no device kernels" in capsys.readouterr().err


def test_count_of_a_compiled_model_is_the_eager_graph():
    """Linear(8, 4) + ReLU, batch 2, forward only: addmm 2*2*8*4 + 2*4 = 136, relu 8, and the default loss's FLOPs,
    the same for the compiled module as for the plain one; the note says so."""
    torch = pytest.importorskip("torch")
    import flopcount

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    x = torch.randn(2, 8)
    eager = flopcount.count(model, x, backward=False)
    comp = flopcount.count(torch.compile(model), x, backward=False)
    f = comp.frame
    assert int(f.loc[f["op"] == "aten.addmm", "flops"].sum()) == 136
    assert int(f.loc[f["op"] == "aten.relu", "flops"].sum()) == 8
    assert comp.total() == eager.total()
    assert flopcount.COMPILED_NOTE in comp.notes and flopcount.COMPILED_NOTE not in eager.notes


def test_count_cli_of_a_compiled_factory(tmp_path, capsys):
    pytest.importorskip("torch")
    src = tmp_path / "compiled_model.py"
    src.write_text("import torch\n\ndef factory():\n"
                   "    return torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()))\n")
    assert cli(["count", f"{src}:factory", "--input-shape", "8", "--batch", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ops = {(r["op"], r["phase"]): r["flops"] for r in doc["ops"]}
    assert ops[("aten.addmm", "forward")] == 136
    assert any("torch.compile" in n for n in doc.get("notes", []))


def test_nsight_compiled_regions_counted_or_listed(tmp_path):
    """An emit_nvtx export of a compiled step: the extern mm (64,32)@(32,16) = 65,536 counted (800 ns), the Triton
    kernel launched under ``CompiledFunction`` (200 ns) and the one under ``CompiledFunctionBackward`` (500 ns)
    listed under their regions: 800 of 1500 ns counted."""
    from nvtx_profile_gen import global_tid, write_sqlite

    from flopcount.profiles import analyze

    strings = {}
    sid = lambda s: strings.setdefault(s, len(strings) + 1)
    main, bwd = global_tid(1, 1), global_tid(1, 2)
    nvtx = [(1000, 2000, 59, "CompiledFunction, seq = 3", main),
            (1100, 1300, 59, "aten::mm, seq = 4, sizes = [[64, 32], [32, 16]]", main),
            (3000, 4000, 59, "CompiledFunctionBackward, seq = 3", bwd)]
    launches = [(1150, 1153, main, 1), (1500, 1503, main, 2), (3100, 3103, bwd, 3)]
    runtime = [(s, e, 1, t, c, sid("cudaLaunchKernel_v7000"), 0) for s, e, t, c in launches]
    kernels = []
    for (start, _, _, corr), name, dur in zip(launches, ["sm80_xmma_gemm_f32f32", "triton_poi_fused_add_relu_0",
                                                         "triton_poi_fused_threshold_backward_1"], [800, 200, 500]):
        kernels.append((start + 10, start + 10 + dur, 0, 1, 7, corr, 1 << 24, sid(name), sid(name), 1, 1, 1, 256, 1, 1))
    path = write_sqlite(str(tmp_path / "compiled.sqlite"), nvtx, runtime, kernels, strings)
    a = analyze(path)
    assert a.report.total("forward") == 2 * 64 * 32 * 16
    assert a.time_shares[compiled.COUNTED] == pytest.approx(800 / 1500)
    u = a.uncounted_time().set_index("what")
    assert u.loc["CompiledFunction", ["phase", "calls", "seconds"]].tolist() == ["forward", 1, pytest.approx(2e-7)]
    assert u.loc["CompiledFunctionBackward", ["phase", "seconds"]].tolist() == ["backward", pytest.approx(5e-7)]
