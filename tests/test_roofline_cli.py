"""`flopcount roofline` and `flopcount overhead`: the public outputs, checked against hand values, and one-line
errors."""
import json
import textwrap

import pytest

from flopcount.cli import main

MLP_FILE = textwrap.dedent("""
    import torch

    def build():
        return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
""")

P100_PEAK, P100_BW = 9.3e12, 732e9


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(MLP_FILE)
    return f"{path}:build"


def test_roofline_json_against_hand_values(mlp, capsys):
    assert main(["roofline", mlp, "--batch", "4", "--input-shape", "10", "--device-spec", "P100 PCIe",
                 "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"] == "P100 PCIe" and doc["batch_size"] == 4
    # every op here is fp32: roofline time = sum of max(flops / 9.3e12, bytes / 732e9) over the op rows
    expect = sum(max(r["flops"] / P100_PEAK, r["bytes"] / P100_BW) for r in doc["ops"])
    assert doc["roofline_seconds"] == pytest.approx(expect)
    assert doc["seconds_per_flop"] == pytest.approx(expect / sum(r["flops"] for r in doc["ops"]))
    # the first Linear's forward addmm: bias (20), input (4x10), weight^T (10x20) read, 4x20 written, 4 bytes each;
    # 2*4*10*20 + 4*20 FLOPs -> 1680 / 1360 = 1.24 FLOP/byte, far below the P100's 12.7: memory-bound
    fc1 = [r for r in doc["ops"] if r["module"] == "0" and r["op"] == "aten.addmm" and r["phase"] == "forward"][0]
    assert fc1["flops"] == 1680 and fc1["bytes"] == 4 * (20 + 40 + 200 + 80)
    assert fc1["bound"] == "memory" and fc1["intensity"] == pytest.approx(1680 / 1360)
    groups = {g["family"]: g for g in doc["groups"]}
    assert sum(g["share"] for g in groups.values()) == pytest.approx(1.0)
    assert doc["memory_bound_share"] == pytest.approx(1.0)  # a tiny MLP is all memory-bound on a P100


def test_roofline_table_and_plot(mlp, tmp_path, capsys):
    out = tmp_path / "roof.png"
    assert main(["roofline", mlp, "--batch", "4", "--input-shape", "10", "--device-spec", "A100 SXM 40GB",
                 "--dtype", "bfloat16", "--measured", "0.001", "--plot", str(out), "--by", "op"]) == 0
    text = capsys.readouterr().out
    assert "ps per FLOP" in text and "aten.addmm" in text and "neither compute nor bandwidth" in text
    assert "bf16" in text  # the matmuls are held against the bf16 ridge
    assert out.exists() and out.stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["roofline", "resnet18", "--device-spec", "Z9000"], "unknown device"),
    (["roofline", "not_a_model", "--device-spec", "P100 PCIe"], "unknown model"),
    (["roofline", "resnet18", "--device-spec", "P100 PCIe", "--dtype", "bfloat16"], "bf16"),
    (["roofline", "resnet18", "--device-spec", "P100 PCIe", "--measured", "-1"], "--measured"),
    (["overhead", "resnet18", "--batches", "4,2"], "bad batch ladder"),
    (["overhead", "resnet18", "--device", "tpu"], "unknown device"),
])
def test_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flopcount: error:") and message in err[0]


def test_overhead_model_error_is_one_line(mlp, capsys):
    assert main(["overhead", mlp, "--input-shape", "7", "--batches", "1,2", "--steps", "1", "--min-seconds", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("flopcount: error: running build on input 1x7 failed")


def test_overhead_runs_the_ladder(mlp, capsys):
    # real timing: only the shape of the answer is checked here, never the times
    assert main(["overhead", mlp, "--input-shape", "10", "--batches", "1,2,4", "--steps", "2", "--warmup", "1",
                 "--min-seconds", "0", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in doc["ladder"]] == [1, 2, 4]
    assert all(r["seconds"] > 0 for r in doc["ladder"])
    assert doc["ladder"][0]["verdict"] == ""
    assert {r["verdict"] for r in doc["ladder"][1:]} <= {"overhead-bound", "scales with batch"}
    assert doc["threshold"] == 0.1 and "overhead-bound" in doc["verdict"] and doc["notes"]


def test_roofline_takes_this_cpu_by_default_and_a_sequence_length(tmp_path, monkeypatch, capsys):
    import json

    from flopcount.device import cpu_probe
    from flopcount.cli import main

    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: 1e11)
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 1e10)
    assert main(["roofline", "hf:tests/fixtures/hf/llama-gqa-tiny", "--seq-len", "8", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"].startswith("cpu") and doc["peak_flops"] == 1e11 and doc["bandwidth"] == 1e10
    # 8 tokens, not the config's default length: the linear layers' forward alone is 2 x 8 x their weights
    from flopcount.model.specs import build

    model, _, _ = build("hf:tests/fixtures/hf/llama-gqa-tiny", seq_len=8)
    weights = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Linear")
    matmul = next(g for g in doc["groups"] if g["family"] == "matmul")
    assert matmul["flops"] >= 3 * 2 * 8 * weights  # forward + backward's two products
    assert matmul["flops"] < 3 * 2 * 16 * weights
