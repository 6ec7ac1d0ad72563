"""``flopcount trace --by module`` from a user's ``record_function`` ranges named by module path: a CPU trace
recorded here of a small Conv/ReLU/Linear model whose calls the test wraps in ranges, and a trace written by hand
with device activity (kernels, the device-side copy of the ranges, the autograd engine's thread). Each module's
FLOPs and device time are checked against the ops placed inside it, worked out by hand."""
import json

import pytest

from flopcount.cli import main as cli
from helpers import CONV, FC, LOSS, RELU, check_module_rows, module_rows, ranged_model

# The backward, in no range (the test opens none around it): the conv's weight gradient 2*8*27*(2*8*8) and its bias
# gradient (a sum over 1024 elements; the input needs no gradient), the linear's input and weight gradients (two
# mm of 2*2*5*512), its bias gradient (a sum over 2x5: 10), the ReLU's threshold_backward (1024), the mean's (a
# div over 10) and pow's (x**1, then two muls over 10).
BACKWARD = (2 * 8 * 27 * 128 + 1024) + 2 * (2 * 2 * 5 * 512) + 10 + 1024 + 10 + (10 + 2 * 10)


def _record(path, prefix=""):
    """A CPU trace of one training step, each chosen module's call wrapped in a record_function range."""
    torch = pytest.importorskip("torch")

    model, x = ranged_model()
    rf = torch.profiler.record_function

    def forward(x):
        with rf(prefix + "features"):
            with rf(prefix + "features.0"):
                x = model.features[0](x)
            x = model.features[1](x)
        x = model.flatten(x)
        with rf(prefix + "fc"):
            return model.fc(x)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        forward(x).pow(2).mean().backward()
    prof.export_chrome_trace(str(path))
    return str(path)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    return {"plain": _record(folder / "plain.json"), "prefixed": _record(folder / "prefixed.json", "module: ")}


def _rows(capsys, argv):
    return module_rows(cli, capsys, argv)


def _check(rows):
    check_module_rows(rows, BACKWARD)
    assert {m: r["calls"] for m, r in rows.items()} == {"": 0, "features": 1, "features.0": 1, "fc": 1}


def test_record_function_ranges_named_by_module_path_are_modules(traces, capsys):
    _check(_rows(capsys, ["trace", traces["plain"], "--by", "module"]))
    # the per-op reading of the same trace has the same totals: the ranges move FLOPs, they add none
    assert cli(["trace", traces["plain"], "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["flops"]["forward"] == CONV + RELU + FC + LOSS and doc["flops"]["backward"] == BACKWARD


def test_a_prefix(traces, capsys):
    _check(_rows(capsys, ["trace", traces["prefixed"], "--by", "module", "--module-ranges", "module: "]))


def test_the_table_says_where_the_modules_come_from(traces, capsys):
    assert cli(["trace", traces["plain"], "--by", "module"]) == 0
    out = capsys.readouterr().out
    assert "record_function ranges named like a module path" in out
    assert "CPU time of the ops inside" in out  # no device activity in a CPU trace
    assert next(line for line in out.splitlines() if line.startswith("features.0"))


@pytest.mark.parametrize("which, argv, fragment", [
    # "module: fc" is no module path without the rule that strips the prefix
    ("prefixed", ["--by", "module"], "no record_function range (user_annotation) named like a module path"),
    ("plain", ["--by", "module", "--module-ranges", "nope"], "named 'nope' + a module path"),
    ("plain", ["--by", "op", "--module-ranges", "module: "], "--module-ranges applies to --by module"),
])
def test_refusals_are_one_line(traces, capsys, which, argv, fragment):
    assert cli(["trace", traces[which]] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err
    if "--by" in argv and argv[argv.index("--by") + 1] == "module":  # and says what would work
        assert "torch.profiler.record_function" in err and "--module-ranges PREFIX" in err


def _event(cat, name, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def test_a_device_trace_by_hand(tmp_path, capsys):
    # fc's forward on thread 1 inside its range: an addmm (2x512 @ 512x5 + bias) launching a 30 us kernel; the
    # kernel's device-side range copy (gpu_user_annotation) is not a second call. A cpu_op named like a module path
    # is an op, never a module. The backward on the autograd engine's thread 2, in no range: an mm (2x5 @ 5x512)
    # launching a 40 us kernel, the root's.
    events = [
        _event("user_annotation", "fc", 0, 100, 1),
        _event("cpu_op", "aten::addmm", 10, 50, 1, **{
            "Input Dims": [[5], [2, 512], [512, 5], [], []], "Input type": ["float", "float", "float", "Scalar",
                                                                           "Scalar"],
            "Concrete Inputs": ["", "", "", "1", "1"], "Sequence number": 3}),
        _event("cuda_runtime", "cudaLaunchKernel", 20, 5, 1, correlation=7),
        _event("kernel", "gemm", 200, 30, 7, correlation=7, device=0, stream=7),
        _event("gpu_user_annotation", "fc", 200, 30, 7),
        _event("cpu_op", "fc.1", 110, 20, 1),
        _event("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 300, 60, 2),
        _event("cpu_op", "AddmmBackward0", 301, 58, 2, **{"Sequence number": 3, "Fwd thread id": 1}),
        _event("cpu_op", "aten::mm", 305, 40, 2, **{"Input Dims": [[2, 5], [5, 512]], "Input type": ["float", "float"],
                                                    "Concrete Inputs": ["", ""]}),
        _event("cuda_runtime", "cudaLaunchKernel", 310, 5, 2, correlation=8),
        _event("kernel", "gemm", 400, 40, 7, correlation=8, device=0, stream=7),
    ]
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = _rows(capsys, ["trace", str(path), "--by", "module"])
    assert set(rows) == {"", "fc"}
    assert (rows["fc"]["calls"], rows["fc"]["forward"], rows["fc"]["backward"]) == (1, 2 * 2 * 512 * 5 + 2 * 5, 0)
    assert rows["fc"]["gpu_s"] == pytest.approx(30e-6, rel=1e-12)
    assert (rows[""]["forward"], rows[""]["backward"]) == (0, 2 * 2 * 5 * 512)
    assert rows[""]["gpu_s"] == pytest.approx(40e-6, rel=1e-12)
    assert rows[""]["gpu_s_incl"] == pytest.approx(70e-6, rel=1e-12)


def test_ops_and_autograd_nodes_named_like_modules_are_not_modules(tmp_path, capsys):
    # only user_annotation events stand for modules: a trace whose only module-like names are ops' is refused
    events = [_event("cpu_op", "fc", 0, 10, 1), _event("cpu_op", "aten::relu", 1, 5, 1, **{
        "Input Dims": [[4]], "Input type": ["float"], "Concrete Inputs": [""]})]
    path = tmp_path / "ops.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert cli(["trace", str(path), "--by", "module"]) == 2
    assert "no record_function range (user_annotation) named like a module path" in capsys.readouterr().err


def test_the_optimizer_step_is_in_no_modules_columns_and_a_note_says_so(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.profiler.record_function("0"):  # a Sequential's first child: a module path of one number
            y = model[0](x)
        y.sum().backward()
        opt.step()
    path = str(tmp_path / "opt.json")
    prof.export_chrome_trace(path)
    assert cli(["trace", path, "--by", "module", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["module"]: r for r in doc["rows"]}
    # "0": addmm, 2*2*4*3 + 2*3 (the bias). The root: the sum over 2x3 (6) forward; backward the weight gradient
    # (an mm of 2*3*2*4; the input needs none) and the bias gradient (a sum over 2x3)
    assert (rows["0"]["forward"], rows["0"]["backward"]) == (2 * 2 * 4 * 3 + 2 * 3, 0)
    assert (rows[""]["forward"], rows[""]["backward"]) == (6, 2 * 3 * 2 * 4 + 6)
    # SGD without momentum: p.add_(grad, alpha=-lr), a multiply and an add per element of 4*3 + 3 parameters
    assert any(n.startswith(f"{2 * (4 * 3 + 3)} FLOPs of the optimizer step") for n in doc["notes"])
