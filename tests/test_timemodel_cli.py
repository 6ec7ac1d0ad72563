"""``trace FILE --predict`` (measured beside predicted per op, json fields, the plot, its one-line errors),
``predict MODEL`` and ``infer``'s prediction beside its roofline."""
import json
from pathlib import Path

import pytest

from flopcount.device.timemodel.params import document
from helpers import one_error_line, run_cli

KINETO = Path(__file__).parent / "fixtures" / "kineto"
MI250 = KINETO / "mi250_minitoy_train.json.gz"
SAMPLED = KINETO / "sampled_rank0_train.json.gz"
pytestmark = pytest.mark.skipif(not MI250.exists(), reason="Kineto fixtures missing (tests/fixtures/kineto)")


def test_trace_predict_json_on_a_launch_bound_profile(capsys):
    code, out, _ = run_cli(capsys, "trace", str(MI250), "--predict", "--device-spec", "MI250", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    rows = doc["per_op"]
    assert rows and all("predicted_s" in r and "gpu_s" in r for r in rows)
    priced = [r for r in rows if r["predicted_s"] is not None]
    assert doc["predicted_gpu_seconds"] == pytest.approx(sum(r["predicted_s"] for r in priced))
    assert doc["gpu_seconds"] == pytest.approx(sum(r["gpu_s"] for r in rows))
    # a 128-wide MLP: every op is microseconds of launch floor, nanoseconds of roofline; one die of the module
    amd = document()["params"]["amd"]
    relu = next(r for r in priced if r["op"] == "aten.relu")
    assert relu["bound"] == "launch" and relu["predicted_s"] == pytest.approx(amd["kernel_floor_s"])
    total = next(r for r in priced if r["op"] == "aten.sum")  # a reduction: its own floor
    assert total["predicted_s"] == pytest.approx(max(amd["kernel_floor_s"], amd["reduction_floor_s"]))
    assert "104 SMs" in doc["device"]
    assert 0.5 < doc["idle_share"] < 1  # the tiny step's GPU waits on the host most of the time
    lost = [r["lost_s"] for r in doc["lost"]]
    assert lost == sorted(lost, reverse=True)


def test_trace_predict_table_and_plot(capsys, tmp_path):
    png = tmp_path / "versus.png"
    code, out, _ = run_cli(capsys, "trace", str(MI250), "--predict", "--device-spec", "MI250", "--plot", str(png))
    assert code == 0 and "measured" in out and "predicted" in out and "GPU idle between kernels" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_trace_predict_errors(capsys):
    code, _, err = run_cli(capsys, "trace", str(SAMPLED), "--predict")
    assert code == 2
    one_error_line(err, "--device-spec")
    code, _, err = run_cli(capsys, "trace", str(MI250), "--device-spec", "MI250")
    assert code == 2
    one_error_line(err, "--predict")


MLP = """
from torch import nn
def make():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
"""


def test_predict_command_json(capsys, tmp_path):
    f = tmp_path / "mlp.py"
    f.write_text(MLP)
    code, out, _ = run_cli(capsys, "predict", f"{f}:make", "--input-shape", "64", "--batch", "8", "--device-spec",
                           "H100 SXM", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert set(doc["phases"]) >= {"forward", "backward"}
    assert doc["seconds"] == pytest.approx(max(doc["gpu_seconds"], doc["host_seconds"]))
    assert doc["gpu_seconds"] == pytest.approx(sum(r["predicted_s"] for r in doc["ops"]), rel=1e-5)
    # batch 8 of a 64-256-10 MLP: 15 kernels (2 addmm, relu, log_softmax, nll_loss, zeros; 3 mm, 2 sums for the
    # biases, relu's, log_softmax's and nll_loss's backward, ones_like), their launches outlast the GPU's work
    assert doc["launches"] == 15 == sum(r["kernels"] for r in doc["ops"])
    assert doc["host_bound"] and doc["host_seconds"] == pytest.approx(15 * doc["params"]["host_launch_s"])
    assert doc["bound_seconds"]["launch"] > 0.5 * doc["gpu_seconds"]
    assert doc["roofline_seconds"] < doc["gpu_seconds"]


HF = Path(__file__).parent / "fixtures" / "hf" / "gpt2-tiny"


@pytest.mark.slow
@pytest.mark.skipif(not HF.exists(), reason="transformers config fixtures missing")
def test_infer_predicts_no_more_tokens_than_launches_allow(capsys):
    pytest.importorskip("transformers")
    code, out, _ = run_cli(capsys, "infer", f"hf:{HF}", "--prompt", "16", "--new", "4", "--device-spec", "H100 SXM",
                           "--format", "json")
    assert code == 0
    doc = json.loads(out)
    pred, roof = doc["prediction"], doc["roofline"]
    dec = pred["phases"]["decode"]
    # kernels of the decode steps, counted here from the rows: one per call of an op that moves or computes
    kernels = sum(r["calls"] for r in doc["traffic"] if r["phase"] == "decode" and (r["flops"] or r["bytes"]))
    assert dec["kernels"] == kernels and dec["forwards"] == 3
    host = pred["params"]["host_launch_s"]
    assert pred["tokens_per_second"] <= dec["forwards"] / (kernels * host) * (1 + 1e-9)
    assert pred["tokens_per_second"] <= dec["forwards"] / (kernels * pred["params"]["kernel_floor_s"])
    assert pred["tokens_per_second"] < roof["phases"]["decode"]["tokens_per_second"] / 100  # the roofline's 4.8 M
    assert pred["ttft"] == pytest.approx(pred["phases"]["prefill"]["seconds"])
    assert pred["seconds_per_output_token"] == pytest.approx(dec["seconds"] / dec["forwards"])
    assert dec["bound"] == "launch (host)"


def test_gpu_check_sets_measured_beside_predicted_on_a_trace():
    from experiments import gpu_check

    v = gpu_check._versus(str(MI250), "MI250")
    assert v["priced_calls"] > 0 and 0 < v["idle_share"] < 1
    # the sum's error is the summed predictions over the summed measurements, less one
    m = v["model"]
    assert -1 < m["sum_error"] < 10 and m["median_error"] <= m["worst_error"]
    doc = {"device": "x", "torch": "t", "seconds": 1.0, "spec": "MI250", "versus": {"mlp": v}, "counts": {},
           "rows": [{"model": "mlp", "autocast": None, "utilization": 0.1, "seconds_per_step": 2e-3,
                     "peak_flops": 1e12, "peak_source": "x: y", "predicted_seconds": 1e-3, "roofline_seconds": 1e-4}]}
    text = gpu_check._markdown(doc)
    assert "| mlp | - | 0.002 | 0.001 | -50.0% | 0.0001 |" in text and "mlp trace, per op" in text


def test_nsys_predict_on_a_generated_export(capsys, tmp_path):
    from helpers import ranged_model
    from nvtx_profile_gen import generate

    model, x = ranged_model()
    path = generate(model, x, str(tmp_path / "step.sqlite"))
    code, out, _ = run_cli(capsys, "nsys", path, "--predict", "--device-spec", "H100 SXM", "--format", "json")
    assert code == 0
    doc = json.loads(out)
    priced = [r for r in doc["per_op"] if r["predicted_s"] is not None]
    assert {"aten.convolution", "aten.addmm"} <= {r["op"] for r in priced}
    assert doc["predicted_gpu_seconds"] == pytest.approx(sum(r["predicted_s"] for r in priced))
    floor = document()["params"]["nvidia"]["kernel_floor_s"]
    for r in priced:  # a batch of 2 small images: every kernel at least the floor, none far above it
        assert r["kernels"] * floor * (1 - 1e-5) <= r["predicted_s"] < r["kernels"] * 10 * floor


@pytest.mark.bench
def test_the_benchmark_prints_model_and_roofline_per_profile_and_family(tmp_path):
    from helpers import run_benchmark

    out = run_benchmark("time_model.py", "--only", "mi250", "--json", str(tmp_path / "r.json"))
    doc = json.loads((tmp_path / "r.json").read_text())["mi250_minitoy_train.json.gz"]
    by_op = doc["by_op"]
    assert by_op["rows"] == sum(f["rows"] for f in by_op["families"].values())
    line = next(x for x in out.splitlines() if x.startswith("mi250_minitoy_train"))
    assert f"{100 * by_op['model']['sum_error']:+.1f}%" in line and f"{100 * by_op['roofline']['sum_error']:+.1f}%" in line
    assert "  matmul" in out and "  pointwise" in out


def test_predict_refuses_an_unknown_device_in_one_line(capsys):
    code, _, err = run_cli(capsys, "predict", "resnet18", "--device-spec", "Z900")
    assert code == 2
    one_error_line(err, "Z900")
    assert "--peak" not in err[0]  # predict takes no bare peak: the model needs the device's SMs and bandwidth
