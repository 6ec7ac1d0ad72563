"""CUDA-style generated profiles: the op names, nesting and argument layouts a CUDA training step records under
emit_nvtx (cudnn_convolution inside _convolution, cudnn_batch_norm, native_dropout, the fused attention ops and
their backwards), made from a real CPU run (see tests/cuda_style.py). The de-duplicated count must equal the
dispatch count of the same model, counted as CUDA dispatches, forward and backward."""
import sqlite3
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_style  # noqa: E402
import nvtx_profile_gen as gen  # noqa: E402

import flopcount  # noqa: E402
from flopcount.profiles import analyze, compare_dispatch  # noqa: E402

# the names each CUDA-style profile must hold, and the CPU ones it must not
EXPECT = {
    "resnet18": ({"aten::cudnn_convolution", "aten::cudnn_batch_norm", "CudnnBatchNormBackward0",
                  "aten::cudnn_batch_norm_backward", "aten::convolution_backward"},
                 {"aten::mkldnn_convolution", "aten::native_batch_norm", "NativeBatchNormBackward0"}),
    "mobilenet_v2": ({"aten::_conv_depthwise2d", "aten::cudnn_convolution", "aten::native_dropout",
                      "NativeDropoutBackward0", "aten::native_dropout_backward", "aten::cudnn_batch_norm"},
                     {"aten::bernoulli_", "aten::mkldnn_convolution", "aten::native_batch_norm"}),
    "efficient": ({"aten::_scaled_dot_product_efficient_attention", "aten::_efficient_attention_forward",
                   "ScaledDotProductEfficientAttentionBackward0", "aten::_efficient_attention_backward",
                   "aten::_scaled_dot_product_efficient_attention_backward", "aten::native_dropout"},
                  {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bernoulli_"}),
    "flash": ({"aten::_scaled_dot_product_flash_attention", "aten::_flash_attention_forward",
               "ScaledDotProductFlashAttentionBackward0", "aten::_flash_attention_backward",
               "aten::_scaled_dot_product_flash_attention_backward", "aten::native_dropout"},
              {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bernoulli_"}),
}


def _model(name):
    torch.manual_seed(0)
    if name in ("efficient", "flash"):
        return gen.transformer_block()
    tv = pytest.importorskip("torchvision")
    return getattr(tv.models, name)(weights=None), torch.randn(2, 3, 64, 64), None


def _names(path):
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    texts = [t for (t,) in con.execute("SELECT text FROM NVTX_EVENTS WHERE text IS NOT NULL")]
    con.close()
    return {t.split(",")[0].replace("autograd::engine::evaluate_function: ", "") for t in texts}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    out = {}
    for name in EXPECT:
        model, x, loss = _model(name)
        kind = name if name in ("efficient", "flash") else "efficient"
        path = gen.generate(model, x, str(tmp_path_factory.mktemp("cuda") / f"{name}.sqlite"), loss_fn=loss, cuda=kind)
        with cuda_style.cuda_dispatch():
            counted = flopcount.count(model, x, loss_fn=loss) if loss else flopcount.count(model, x)
        out[name] = (path, counted)
    return out


@pytest.mark.parametrize("name", list(EXPECT))
def test_cuda_style_deduplicated_equals_dispatch(profiles, name):
    path, counted = profiles[name]
    names = _names(path)
    present, absent = EXPECT[name]
    assert present <= names, present - names
    assert not absent & names, absent & names
    a = analyze(path)
    for phase in ("forward", "backward"):
        assert a.report.total(phase) == counted.total(phase) > 0, phase
    assert not [n for n in a.notes if "not derived" in n], a.notes
    # the inner ops carry formulas of their own, and are counted once, in the op that called them
    table = compare_dispatch(a, counted)
    inner = [op for op in ("aten.cudnn_convolution", "aten._conv_depthwise2d", "aten._efficient_attention_forward",
                           "aten._flash_attention_forward", "aten._efficient_attention_backward",
                           "aten._flash_attention_backward") if op in table.index.get_level_values(0)]
    for op in inner:
        assert (table.loc[op]["deduplicated"] == 0).all() and (table.loc[op]["naive"] > 0).all(), op


def test_cuda_dispatch_takes_native_dropout():
    """The count a CUDA-style profile is held to: dropout as at::dropout runs on CUDA, and nothing else changed."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.25))
    x = torch.randn(4, 8)
    plain = flopcount.count(model, x, loss_fn=lambda out: out.sum())
    with cuda_style.cuda_dispatch():
        cuda = flopcount.count(model, x, loss_fn=lambda out: out.sum())
    ops = set(cuda.frame["op"])
    assert "aten.native_dropout" in ops and "aten.native_dropout_backward" in ops and "aten.bernoulli_" not in ops
    assert "aten.bernoulli_" in set(plain.frame["op"])
    linear = lambda r: int(r.frame[r.frame["op"] == "aten.addmm"]["flops"].sum())  # noqa: E731
    assert linear(plain) == linear(cuda) > 0
    import torch.nn.functional as F
    assert F.dropout.__name__ == "dropout" and F.dropout.__module__ == "torch.nn.functional"  # restored


def test_conv_bias_and_depthwise_bias(tmp_path):
    """A convolution with a bias: cuDNN's op takes none, _convolution adds it (add_ on the output); a depthwise one
    takes it as an argument; the bias gradient is a sum inside convolution_backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, groups=8), torch.nn.Flatten(), torch.nn.Linear(8 * 12 * 12, 5))
    x = torch.randn(2, 3, 16, 16)
    path = gen.generate(model, x, str(tmp_path / "bias.sqlite"), cuda="efficient")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    texts = [t for (t,) in con.execute("SELECT text FROM NVTX_EVENTS WHERE text LIKE 'aten::%'")]
    con.close()
    assert any(t.startswith("aten::add_") and "sizes = [[2, 8, 14, 14], [1, 8, 1, 1]" in t for t in texts)
    assert any(t.startswith("aten::_conv_depthwise2d") and t.endswith("[8, 1, 3, 3], [], [8], [], [], []]") for t in texts)
    with cuda_style.cuda_dispatch():
        counted = flopcount.count(model, x)
    a = analyze(path)
    for phase in ("forward", "backward"):
        assert a.report.total(phase) == counted.total(phase) > 0, phase


def test_layouts_come_from_the_schemas():
    t = cuda_style.Tensor
    op = cuda_style.call("aten::cudnn_batch_norm_backward", input=t([2, 4, 6, 6]), grad_output=t([2, 4, 6, 6]),
                         weight=t([4]), reserveSpace=t([0]))
    sizes = gen.input_sizes(op.inputs)
    assert sizes == [[2, 4, 6, 6], [2, 4, 6, 6], [4], [], [], [], [], [], [0]]
    with pytest.raises(KeyError):
        cuda_style.call("aten::native_dropout", no_such_argument=1)
    with pytest.raises(ValueError):
        cuda_style.cuda_style([], attention="math")


MI250 = Path(__file__).parent / "fixtures" / "kineto" / "mi250_minitoy_train.json.gz"


@pytest.mark.skipif(not MI250.exists(), reason="Kineto fixtures missing (tests/fixtures/kineto)")
def test_the_cuda_style_profile_of_a_step_equals_a_real_gpu_recording_of_it(tmp_path):
    """One side held to a real recording: the MI250 fixture is one training step of Linear(128, 128), ReLU and an
    MSE loss on 5 samples, recorded on the GPU. The same step, recorded on the CPU and rewritten by cuda_style,
    must have the same ops with the same FLOPs and calls. (The recorded step accumulated into gradients that
    already existed, AccumulateGrad's add_, and took an optimizer step; the generated one starts without
    gradients and stops after backward, so those rows are the recording's alone.)"""
    import torch.nn.functional as F

    from flopcount.profiles import analyze_trace

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU())
    x, target = torch.randn(5, 128), torch.randn(5, 128)
    path = gen.generate(model, x, str(tmp_path / "toy.sqlite"), loss_fn=lambda out: F.mse_loss(out, target),
                        cuda="efficient")
    key = ["op", "phase"]
    generated = analyze(path).report.frame
    recorded = analyze_trace(MI250).report.frame
    recorded = recorded[(recorded.phase != "optimizer") & (recorded.op != "aten.add_")]
    work = lambda f: f[f.flops > 0].groupby(key)[["flops", "calls"]].sum()  # noqa: E731
    assert work(generated).equals(work(recorded)), (work(generated), work(recorded))
    # and the recording's totals are the hand count of test_gpuprof: addmm 164,480, relu 640, mse 1,920
    assert int(work(recorded).loc[("aten.addmm", "forward"), "flops"]) == 2 * 5 * 128 * 128 + 5 * 128
