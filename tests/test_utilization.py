"""utilization(): FLOPs against hand computations, the peak following the precision, the CLI."""
import itertools
import json
import textwrap

import pytest
import torch

from flopcount import cli
from flopcount.device import cpu_probe
from flopcount.base.errors import FlopcountError, UnknownDevice, UnknownPeak
from flopcount.device.peak_policy import precision_mix, resolve_peak
from flopcount.base.report import FlopReport
from flopcount.device.timing import OutOfMemory
from flopcount.analyses.utilization import utilization

N, IN, OUT = 4, 16, 8
# Hand count of one step of Linear(16, 8, bias=False) on a (4, 16) batch with loss = output.sum():
#   forward   mm (4x16)@(16x8): 2*4*16*8 = 1024, sum over 4*8 outputs: 32          -> 1056
#   backward  grad W = grad_out^T (8x4) @ x (4x16): 2*8*4*16 = 1024 (x needs no grad) -> 1024
#   optimizer SGD p -= lr * g: one multiply and one add per weight, 2*128            -> 256
FORWARD, BACKWARD, OPTIMIZER = 2 * N * IN * OUT + N * OUT, 2 * OUT * N * IN, 2 * IN * OUT
MATMUL = 2 * N * IN * OUT + 2 * OUT * N * IN


def tiny():
    torch.manual_seed(0)
    return torch.nn.Linear(IN, OUT, bias=False)


def sum_loss(out):
    return out.sum()


def fake_clock(seconds_per_step):
    ticks = itertools.count()
    return lambda: seconds_per_step * next(ticks)


REAL_PROBES = (cpu_probe.probe_matmul, cpu_probe.probe_bandwidth)


@pytest.fixture(autouse=True)
def fake_cpu_probe(tmp_path, monkeypatch):
    """No real probe in these tests: a CPU 'measured' at 2 GFLOP/s and 10 GB/s, cached in a temp folder."""
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: 2e9)
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 1e10)


def test_flops_and_utilization_by_hand():
    u = utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, peak=1e9, clock=fake_clock(0.5))
    assert u.flops_by_phase == {"forward": FORWARD, "backward": BACKWARD, "optimizer": OPTIMIZER}
    assert u.flops_per_step == 1056 + 1024 + 256
    assert u.precision_mix == {"fp32": MATMUL}
    assert u.seconds_per_step == 0.5 and u.seconds_spread == 0.0 and u.steps == 5
    assert u.achieved_flops == pytest.approx(2336 / 0.5)
    assert u.utilization == pytest.approx(2336 / (0.5 * 1e9))
    assert (u.peak_flops, u.peak_source) == (1e9, "given")
    assert (u.batch_size, u.world_size, u.device, u.dtype) == (N, 1, "cpu", "float32")
    d = u.to_dict()
    assert d["utilization"] == u.utilization and d["flops_by_phase"]["backward"] == BACKWARD
    json.dumps(d)  # one JSON document, nothing unserialisable


def test_cpu_peak_is_measured_and_labelled():
    u = utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, clock=fake_clock(1e-3))
    assert u.peak_flops == 2e9
    assert "measured" in u.peak_source
    assert u.bandwidth == 1e10
    assert u.bandwidth_utilization == pytest.approx(u.bytes_per_step / 1e-3 / 1e10)
    assert 0 < u.utilization <= 1


def test_bf16_model_is_held_against_the_bf16_peak():
    u = utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, dtype="bfloat16", device_spec="A100 SXM 40GB",
                    clock=fake_clock(0.01))
    assert u.precision_mix == {"bf16": MATMUL}
    assert u.peak_flops == 312e12 and u.dtype == "bfloat16"


def test_autocast_is_held_against_the_bf16_peak():
    u = utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, autocast="bfloat16", device_spec="H100 SXM",
                    clock=fake_clock(0.01))
    assert u.precision_mix == {"bf16": MATMUL}
    assert u.peak_flops == pytest.approx(989e12, rel=1e-3)
    assert u.flops_by_phase["forward"] == FORWARD


def test_fp32_on_a_tf32_device_is_held_against_fp32_unless_allowed():
    u = utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, device_spec="A100 SXM 40GB",
                    clock=fake_clock(0.01))
    assert u.peak_flops == 19.5e12  # on the CPU no TF32 is in play


def test_precision_mix_tf32_per_family_and_effective_peak_by_hand():
    rows = [
        dict(module="c", op="aten.convolution", phase="forward", dtype="float32", family="conv", flops=100),
        dict(module="l", op="aten.mm", phase="forward", dtype="float32", family="matmul", flops=50),
        dict(module="l", op="aten.mm", phase="backward", dtype="bfloat16", family="matmul", flops=30),
        dict(module="r", op="aten.relu", phase="forward", dtype="float32", family="pointwise", flops=999),
    ]
    report = FlopReport.from_rows(rows)
    # cuDNN allows TF32 for convolutions by default, matmuls not: conv -> tf32, mm -> fp32; pointwise ignored
    mix = precision_mix(report, tf32={"conv": True, "matmul": False, "attention": False})
    assert mix == {"tf32": 100, "fp32": 50, "bf16": 30}
    peak, source, spec = resolve_peak(mix, device=torch.device("cpu"), device_spec="A100 SXM 40GB")
    # seconds per 1e12 FLOP/s: 100/156 + 50/19.5 + 30/312 = 0.641026 + 2.564103 + 0.096154 = 3.301282
    by_hand = 180 / (100 / 156e12 + 50 / 19.5e12 + 30 / 312e12)
    assert peak == pytest.approx(by_hand, rel=1e-12)
    assert peak == pytest.approx(180 / 3.301282 * 1e12, rel=1e-6)  # 54.524e12 FLOP/s
    assert spec.name == "A100 SXM 40GB" and "datasheet" in source


def test_unknown_gpu_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Z900")
    with pytest.raises(UnknownDevice) as exc:
        resolve_peak({"bf16": 1.0}, device=torch.device("cuda", 0))
    assert "NVIDIA Z900" in str(exc.value) and "--device-spec" in str(exc.value) and "--peak" in str(exc.value)


def test_known_gpu_by_reported_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100-PCIE-16GB")
    peak, source, spec = resolve_peak({"fp32": 1.0}, device=torch.device("cuda", 0))
    assert peak == 9.3e12 and spec.name == "P100 PCIe" and spec.bandwidth == 732e9


def test_missing_precision_on_the_device_is_an_error():
    with pytest.raises(UnknownPeak):
        utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, dtype="bfloat16", device_spec="P100 PCIe",
                    clock=fake_clock(0.01))


def test_scope_one_uses_one_sample():
    u = utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, peak=1e9, scope="one", clock=fake_clock(0.1))
    assert u.batch_size == 1
    assert u.flops_by_phase["forward"] == 2 * IN * OUT + OUT


def test_int_batch_uses_the_model_example_shape():
    model = tiny()
    model.example_input_shape = (IN,)
    u = utilization(model, N, loss_fn=sum_loss, peak=1e9, clock=fake_clock(0.1))
    assert u.flops_by_phase == {"forward": FORWARD, "backward": BACKWARD, "optimizer": OPTIMIZER}


def test_epoch_scope_total_flops_over_total_time():
    data = torch.utils.data.TensorDataset(torch.randn(10, IN))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # batches of 4, 4, 2
    u = utilization(tiny(), 4, loss_fn=sum_loss, peak=1e9, scope="epoch", loader=loader, clock=fake_clock(0.3))
    # forward of a batch of n: 2*n*16*8 + 8n = 264n; backward 256n; optimizer 256 per step
    total = 264 * 10 + 256 * 10 + 3 * 256
    assert u.steps == 3
    assert u.flops_per_step == pytest.approx(total / 3)
    # the fake clock is read twice around the whole epoch: 0.3 s, i.e. 0.1 s per step
    assert u.seconds_per_step == pytest.approx(0.1)
    assert u.utilization == pytest.approx(total / 0.3 / 1e9)


def test_out_of_memory_is_the_clear_error():
    model = tiny()
    model.example_input_shape = (IN,)
    with pytest.raises(OutOfMemory):
        utilization(model, 2 ** 42, loss_fn=sum_loss, peak=1e9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(scope="week"), "unknown scope 'week'"), (dict(dtype="float8"), "unknown dtype 'float8'"),
    (dict(peak=-1.0), "positive number"), (dict(peak="fast"), "number of FLOP/s"), (dict(device="tpu"), "unknown device"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(FlopcountError, match=match):
        utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, **{"peak": 1e9, **kwargs})


def test_unavailable_cuda_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FlopcountError, match="not available"):
        utilization(tiny(), torch.randn(N, IN), device="cuda", peak=1e9)


# --- CLI ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tiny_net.py"
    path.write_text(textwrap.dedent("""
        import torch

        def make():
            net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 10))
            net.example_input_shape = (3, 4, 4)
            return net
    """))
    return f"{path}:make"


# The CLI's step for model_file (Linear(48, 10) on a batch of 2, cross-entropy against class 0, SGD), by hand:
#   forward   addmm 2*2*48*10 + bias 2*10 = 1940; log_softmax 5 per element + 1 log per row = 102; nll_loss mean
#             2 per target = 4                                                                   -> 2046
#   backward  grad W 2*10*2*48 = 1920 (the input needs no gradient); grad bias 1 per grad element 20;
#             log_softmax backward 4 per element 80; nll_loss backward 2 per target 4            -> 2024
#   optimizer SGD p -= lr * g: 2 per parameter, 2 * 490                                         -> 980
CLI_PHASES = {"forward": 2046, "backward": 2024, "optimizer": 980}
CLI_STEP = sum(CLI_PHASES.values())  # 5050


@pytest.fixture
def half_second_steps(monkeypatch):
    """The timer's host clock ticks 0.5 s per reading: every timed step takes exactly 0.5 s."""
    import types

    from flopcount.device import timing

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=fake_clock(0.5)))


def test_cli_json(model_file, capsys, half_second_steps):
    rc = cli.main(["utilization", model_file, "--batch", "2", "--steps", "2", "--warmup", "1", "--format", "json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert "measured" in doc["peak_source"] and doc["peak_flops"] == 2e9
    assert doc["flops_by_phase"] == CLI_PHASES and doc["flops_per_step"] == CLI_STEP
    assert doc["batch_size"] == 2 and doc["seconds_per_step"] == 0.5
    assert doc["achieved_flops"] == pytest.approx(CLI_STEP / 0.5)
    assert doc["utilization"] == pytest.approx(CLI_STEP / (0.5 * 2e9))  # 5.05e-06


def test_cli_table(model_file, capsys, half_second_steps):
    assert cli.main(["utilization", model_file, "--batch", "2", "--steps", "1", "--warmup", "0"]) == 0
    lines = {line.strip().split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["utilization"].split()[1] == "5.05e-06"  # 5050 / (0.5 s x 2 GFLOP/s)
    assert "5.05 k (forward 2.05 k, backward 2.02 k, optimizer 980)" in lines["FLOPs per step"]
    assert lines["seconds per step"].split()[3:5] == ["500", "ms"]
    assert "10.1 kFLOP/s" in lines["achieved"] and "2.00 GFLOP/s" in lines["peak"] and "measured" in lines["peak"]


def test_cli_unknown_device_spec(model_file, capsys):
    rc = cli.main(["utilization", model_file, "--batch", "2", "--device-spec", "Z900"])
    err = capsys.readouterr().err
    assert rc == 2 and "--peak" in err and len(err.strip().splitlines()) == 1


def test_cli_peaks(capsys):
    assert cli.main(["peaks", "--format", "json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["P100 PCIe"]["fp32"] == 9.3e12 and rows["P100 PCIe"]["source"]
    assert cli.main(["peaks"]) == 0
    assert "A100 SXM 40GB" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_resnet18_real(capsys, monkeypatch):
    # the real probes (in the test's own cache folder): a real step is held against a real peak
    monkeypatch.setattr(cpu_probe, "probe_matmul", REAL_PROBES[0])
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", REAL_PROBES[1])
    rc = cli.main(["utilization", "resnet18", "--batch", "2", "--steps", "2", "--warmup", "1", "--format", "json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert 0 < doc["utilization"] <= 1


def test_a_step_faster_than_the_cached_cpu_peak_remeasures_it(monkeypatch):
    readings = iter([1e3, 1e12])  # the first probe ran on a busy machine
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: next(readings))
    u = utilization(tiny(), torch.randn(N, IN), loss_fn=sum_loss, clock=fake_clock(0.5))
    # 2336 FLOPs in 0.5 s = 4672 FLOP/s beats 1e3: measured again, and the best reading kept
    assert u.peak_flops == 1e12
    assert any("measured again" in n for n in u.notes)
    assert cpu_probe.cpu_spec().peak("fp32") == 1e12  # the cache holds the best figure
