"""A torch.compile'd step recorded on the CPU: the matmuls and convolutions Inductor hands to aten (extern kernels)
are counted as in the eager trace of the same step; the compiled regions' time outside them (Inductor's C++
kernels, which the profiler does not record one by one) is listed as not known, never 0 with nothing said.

Slow: Inductor compiles a C++ module for each graph (minutes on two cores)."""
import shutil

import pytest

from flopcount.profiles import analyze_trace
from flopcount.profiles import compiled

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


def _record(model, x, path):
    from torch.profiler import ProfilerActivity, profile

    def step():
        model(x).sum().backward()

    step()  # compiles (a compiled model) and warms up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        step()
    p.export_chrome_trace(str(path))
    return path


def _eager_and_compiled(model, x, tmp_path):
    if not (shutil.which("g++") or shutil.which("cc")):
        pytest.skip("no C++ compiler on PATH: Inductor cannot build its CPU kernels")
    eager = analyze_trace(_record(model, x, tmp_path / "eager.json"))
    try:
        comp = _record(torch.compile(model), x, tmp_path / "compiled.json")
    except Exception as exc:  # a torch build without a working Inductor backend here
        pytest.skip(f"torch.compile is unavailable here: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return eager, analyze_trace(comp)


def _by_family(a, families=("matmul", "conv")):
    o = a.ops[a.ops["family"].isin(families)]
    return o.groupby(["op", "phase"])["flops"].sum().to_dict()


def _region_time_listed(a):
    u = a.uncounted_time()
    regions = u[u["what"].str.contains(compiled.GENERATED, regex=False)]
    assert len(regions) and (regions["seconds"] > 0).all()
    assert sum(a.time_shares.values()) == pytest.approx(1.0)
    return set(regions["phase"])


def test_compiled_transformer_step_matmuls_equal_eager(tmp_path):
    """d_model 32, 4 heads, feed-forward 64, a Linear(32, 8) head, batch 2 x 6 tokens (T = 12). Hand-worked: the
    products 2T(32*96 + 32*32 + 32*64 + 64*32 + 32*8) = 24 * 8448 = 202,752, plus the biases the addmms add
    T(32 + 64 + 32 + 8) = 1,632 (the input projection's bias is a separate add): 204,384 forward; backward, the
    weight gradients 202,752 and the input gradients of all but the input projection (its input is the step's,
    which needs none) 202,752 - 2T*32*96 = 129,024: 331,776."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(layer, torch.nn.Linear(32, 8))
    eager, comp = _eager_and_compiled(model, torch.randn(2, 6, 32), tmp_path)
    e, c = _by_family(eager), _by_family(comp)
    assert sum(v for (op, ph), v in e.items() if ph == "forward") == 204_384
    assert sum(v for (op, ph), v in e.items() if ph == "backward") == 331_776
    assert sum(v for (op, ph), v in c.items() if ph == "forward") == 204_384
    assert sum(v for (op, ph), v in c.items() if ph == "backward") == 331_776
    assert {"forward", "backward"} <= _region_time_listed(comp)


def test_compiled_resnet18_step_convs_and_matmuls_equal_eager(tmp_path):
    """resnet18 (10 classes) on 2 x 3 x 32 x 32: the fc addmm 2*2*512*10 + 2*10 = 20,500 by hand; the
    convolutions against the dispatch counter's count of the same step (an independent estimator). Inside the
    compiled graph no backward node is linked to a convolution: its output size comes from the recorded stride,
    padding and dilation."""
    import torchvision

    import flopcount

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    eager, comp = _eager_and_compiled(model, x, tmp_path)
    e, c = _by_family(eager), _by_family(comp)
    assert e[("aten.addmm", "forward")] == c[("aten.addmm", "forward")] == 20_500
    d = flopcount.count(model, x, loss_fn=lambda out, *_: out.sum()).frame
    conv_fwd = int(d.loc[(d["op"] == "aten.convolution") & (d["phase"] == "forward"), "flops"].sum())
    conv_bwd = int(d.loc[(d["op"] == "aten.convolution_backward") & (d["phase"] == "backward"), "flops"].sum())
    assert e[("aten.convolution", "forward")] == c[("aten.convolution", "forward")] == conv_fwd
    assert e[("aten.convolution_backward", "backward")] == c[("aten.convolution_backward", "backward")] == conv_bwd
    assert not [n for n in comp.notes if "not derived" in n and "convolution" in n]
    assert {"forward", "backward"} <= _region_time_listed(comp)
