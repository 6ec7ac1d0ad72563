"""The peak table against datasheet figures written out here, lookup by CUDA's names, precision, effective peak."""
import json

import pytest
import torch

from flopcount.device import cpu_probe
from flopcount.device.datasheet import get_device, list_devices
from flopcount.device.spec import DeviceSpec
from flopcount.base.dtypes import precision_of
from flopcount.base.errors import FlopcountError, UnknownDevice, UnknownPeak
from flopcount.device.peak_policy import effective_peak


# (name as CUDA reports it, precision, figure from the vendor datasheet)
DATASHEET = [
    ("Tesla P100-PCIE-16GB", "fp32", 9.3e12),
    ("Tesla P100-PCIE-16GB", "fp16", 18.7e12),
    ("Tesla P100-PCIE-16GB", "fp64", 4.7e12),
    ("Tesla P100-SXM2-16GB", "fp32", 10.6e12),
    ("Tesla V100-SXM2-16GB", "fp16", 125e12),
    ("Tesla V100-PCIE-32GB", "fp32", 14e12),
    ("Tesla T4", "fp16", 65e12),
    ("NVIDIA A100-SXM4-40GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "tf32", 156e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
    ("NVIDIA A100 80GB PCIe", "bf16", 312e12),
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 PCIe", "fp32", 51e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA A10", "tf32", 62.5e12),
    ("NVIDIA GeForce RTX 4090", "fp32", 82.6e12),
    ("NVIDIA GeForce RTX 3090", "fp32", 35.6e12),
]
BANDWIDTH = [
    ("Tesla P100-PCIE-16GB", 732e9),
    ("NVIDIA A100-PCIE-40GB", 1555e9),
    ("NVIDIA A100-SXM4-40GB", 1555e9),
    ("NVIDIA A100-SXM4-80GB", 2039e9),
    ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA H200", 4.8e12),
    ("Tesla T4", 320e9),
]


@pytest.mark.parametrize("name,precision,figure", DATASHEET)
def test_peak_matches_datasheet(name, precision, figure):
    # datasheets round to 3-4 digits (H100 SXM bf16: 1,979 sparse -> 989.5 dense)
    assert get_device(name).peak(precision) == pytest.approx(figure, rel=1e-3)


@pytest.mark.parametrize("name,figure", BANDWIDTH)
def test_bandwidth_matches_datasheet(name, figure):
    assert get_device(name).bandwidth == pytest.approx(figure, rel=1e-3)


def test_required_devices_present_with_sources():
    table = list_devices()
    for name in ["P100 PCIe", "P100 SXM2", "V100 PCIe", "V100 SXM2", "T4", "A100 PCIe 40GB", "A100 SXM 40GB",
                 "A100 PCIe 80GB", "A100 SXM 80GB", "A10", "L4", "H100 PCIe", "H100 SXM", "H200", "RTX 3090",
                 "RTX 4090"]:
        assert name in table.index
        assert table.loc[name, "source"].strip()
        assert table.loc[name, "fp32"] > 0 and table.loc[name, "bandwidth"] > 0


def test_lookup_spellings():
    assert get_device("p100 pcie").name == "P100 PCIe"
    assert get_device("H100-SXM").name == "H100 SXM"
    assert get_device("h200").name == "H200"  # a unique prefix


def test_absent_precision_is_absent_not_zero():
    p100 = get_device("P100 PCIe")
    assert "bf16" not in p100.peaks and "tf32" not in p100.peaks
    with pytest.raises(UnknownPeak, match="--peak"):
        p100.peak("bf16")


@pytest.mark.parametrize("name", ["Z900", "A100", "", "MI999X"])
def test_unknown_or_ambiguous_device_is_an_error_with_the_way_out(name):
    with pytest.raises(UnknownDevice) as exc:
        get_device(name)
    assert isinstance(exc.value, FlopcountError)
    msg = str(exc.value)
    assert "--device-spec" in msg and "--peak" in msg and "\n" not in msg


def test_precision_of():
    assert precision_of(torch.float32) == "fp32"
    assert precision_of(torch.float32, allow_tf32=True) == "tf32"
    assert precision_of(torch.bfloat16, allow_tf32=True) == "bf16"
    assert precision_of("float16") == "fp16"
    assert precision_of("torch.float64") == "fp64"
    with pytest.raises(UnknownPeak):
        precision_of(torch.int64)


def test_effective_peak_of_a_bf16_fp32_mixture_by_hand():
    a100 = get_device("A100 SXM 40GB")
    assert (a100.peaks["bf16"], a100.peaks["fp32"]) == (312e12, 19.5e12)  # the datasheet's dense figures
    # 3e12 FLOPs in bf16 at 312e12 FLOP/s take 3/312 s; 1e12 in fp32 at 19.5e12 take 1/19.5 s: 0.0608974 s in
    # all, so 4e12 FLOPs run at 65.684e12 FLOP/s (far nearer fp32's peak than the FLOP-weighted mean, 238.9e12)
    assert effective_peak({"bf16": 3e12, "fp32": 1e12}, a100) == pytest.approx(65.684e12, rel=1e-4)
    # the other way round: 1/312 + 3/19.5 = 0.1570513 s, 4e12 FLOPs at 25.469e12 FLOP/s
    assert effective_peak({"bf16": 1e12, "fp32": 3e12}, a100) == pytest.approx(25.469e12, rel=1e-4)


def test_effective_peak_single_precision_is_that_peak():
    a100 = get_device("A100 SXM 40GB")
    assert effective_peak({"bf16": 7e9, "fp32": 0}, a100) == pytest.approx(312e12, rel=1e-12)


def test_tf32_on_a_device_without_it_runs_at_fp32():
    assert effective_peak({"tf32": 1e9}, get_device("V100 SXM2")) == pytest.approx(15.7e12, rel=1e-12)


def test_effective_peak_rejects_a_missing_precision():
    with pytest.raises(UnknownPeak):
        effective_peak({"bf16": 1e9}, get_device("T4"))


def test_cpu_spec_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_mm(dtype):
        calls.append(dtype)
        return 5e10

    monkeypatch.setattr(cpu_probe, "probe_matmul", fake_mm)
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 2e10)
    spec = cpu_probe.cpu_spec(threads=3)
    assert spec.peak("fp32") == 5e10 and spec.bandwidth == 2e10
    assert spec.measured and spec.source.startswith("measured")
    cache = json.loads((tmp_path / "cpu_peaks.json").read_text())
    assert any("threads=3" in k and k.endswith("float32") for k in cache)
    # second call: from the cache, no new probe; another thread count is a new key
    cpu_probe.cpu_spec(threads=3)
    assert calls == ["float32"]
    cpu_probe.cpu_spec(threads=1)
    assert calls == ["float32", "float32"]


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    (tmp_path / "cpu_peaks.json").write_text("{not json")
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: 1e10)
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 1e9)
    assert cpu_probe.cpu_spec().peak("fp32") == 1e10


def test_probe_matmul_is_a_plausible_rate():
    # a small real probe: positive and below 100 TFLOP/s, which no CPU core count here could reach
    reading = cpu_probe.probe_matmul(max_n=256, repeats=2)
    rate = reading.rate(best=True)
    assert reading.runs == 2 and reading.work == 2 * 256 ** 3
    assert 1e8 < rate < 1e14


def test_probe_matmul_keeps_the_fastest_size(monkeypatch):
    """Sizes double from 256 until a product takes long enough; the figure is the size that ran fastest, not the
    last one tried (a BLAS library can run an in-between size far slower)."""
    import flopcount.device.timing as timing

    seconds = {256: 1e-3, 512: 4e-3, 1024: 40e-3, 2048: 400e-3}  # 512 is the fastest per FLOP
    tried = []

    def fake_measure(fn, *, repeats, warmup, label):
        n = int(label.split()[-1])
        tried.append(n)
        return timing.Measurement([seconds[n]] * repeats, warmup=warmup, label=label)

    monkeypatch.setattr(timing, "measure", fake_measure)
    reading = cpu_probe.probe_matmul(max_n=4096, budget_s=1.2)
    assert tried == [256, 512, 1024, 2048]  # 2048 took 0.4 s >= 1.2 / 12: the last size tried
    assert reading.work == 2 * 512 ** 3
    assert reading.rate(best=True) == 2 * 512 ** 3 / 4e-3


def test_device_spec_ridge():
    spec = DeviceSpec(name="x", peaks={"fp32": 10e12}, bandwidth=1e12, source="test")
    assert spec.ridge == {"fp32": 10.0}


def test_cache_keeps_the_best_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    readings = iter([5e10, 3e10])  # the second probe ran while the machine was busy
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: next(readings))
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 1e9)
    assert cpu_probe.cpu_spec().peak("fp32") == 5e10
    assert cpu_probe.cpu_spec(refresh=True).peak("fp32") == 5e10


class _SettingsWithoutAllowTf32:
    """A torch whose cuBLAS settings object no longer answers ``allow_tf32`` (the old flag), as some releases'
    ``cuBLASModule`` does: reading it raises AttributeError, and only ``fp32_precision`` is left."""

    def __init__(self, fp32_precision):
        self.fp32_precision = fp32_precision

    def __getattr__(self, name):
        raise AttributeError(f"'cuBLASModule' object has no attribute {name!r}")


@pytest.mark.parametrize("precision, expected", [("ieee", False), ("tf32", True), ("none", False)])
def test_tf32_allowed_reads_a_torch_without_the_old_allow_tf32_flag(monkeypatch, precision, expected):
    from flopcount.device.peak_policy import tf32_allowed

    monkeypatch.setattr(torch.backends.cuda, "matmul", _SettingsWithoutAllowTf32(precision))
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    allowed = tf32_allowed()
    assert allowed["matmul"] is expected and allowed["attention"] is expected


def test_tf32_allowed_follows_the_matmul_precision_setting(monkeypatch):
    from flopcount.device.peak_policy import tf32_allowed

    monkeypatch.setattr(torch.backends.cuda, "matmul", _SettingsWithoutAllowTf32("none"))
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert tf32_allowed()["matmul"] is True


# --- the CPU's cached peak: when, under what load, and measured again on request ---------------------------------
def test_a_probe_under_load_is_cached_with_its_load_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: 3.55e10)
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 1e9)
    monkeypatch.setattr(cpu_probe, "machine_load", lambda: 12.0)
    monkeypatch.setattr(cpu_probe.os, "cpu_count", lambda: 2)
    spec = cpu_probe.cpu_spec(threads=2)
    assert "load average 12.00 on 2 cores" in spec.source and "under load" in spec.source
    assert "--probe-cpu" in spec.source
    entry = next(v for k, v in json.loads((tmp_path / "cpu_peaks.json").read_text()).items() if k.endswith("float32"))
    assert entry["rate"] == 3.55e10 and entry["load"] == 12.0 and entry["cores"] == 2 and entry["measured_at"]


def test_a_quiet_probe_replaces_a_low_reading_and_is_not_said_to_be_under_load(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    readings, loads = iter([3.55e10, 1.99e11]), iter([12.0, 12.0, 0.1, 0.1])
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: next(readings))
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 1e9)
    monkeypatch.setattr(cpu_probe, "machine_load", lambda: next(loads))
    monkeypatch.setattr(cpu_probe.os, "cpu_count", lambda: 2)
    cpu_probe.cpu_spec(threads=2)
    spec = cpu_probe.cpu_spec(threads=2, refresh=True)
    assert spec.peak("fp32") == 1.99e11 and "under load" not in spec.source


def test_an_older_cache_of_bare_numbers_is_still_read(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    key = f"{cpu_probe.cpu_model()}|threads=2|"
    (tmp_path / "cpu_peaks.json").write_text(json.dumps({key + "float32": 7e10, key + "bandwidth": 3e9}))
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: pytest.fail("the cached figure is used"))
    spec = cpu_probe.cpu_spec(threads=2)
    assert spec.peak("fp32") == 7e10 and "unrecorded time" in spec.source


def test_peaks_probe_cpu_measures_again_and_the_table_says_when(tmp_path, monkeypatch, capsys):
    from flopcount.cli import main

    monkeypatch.setenv("FLOPCOUNT_CACHE_DIR", str(tmp_path))
    readings = iter([3e10, 9e10])
    monkeypatch.setattr(cpu_probe, "probe_matmul", lambda dtype: next(readings))
    monkeypatch.setattr(cpu_probe, "probe_bandwidth", lambda: 1e9)
    monkeypatch.setattr(cpu_probe, "machine_load", lambda: 0.0)
    cpu_probe.cpu_spec()
    assert main(["peaks", "--probe-cpu"]) == 0
    out, err = capsys.readouterr()
    assert "measuring this CPU" in err and "9e+10 FLOP/s" in err
    cpu_line = next(line for line in out.splitlines() if line.startswith("cpu (") and "float32" in line)
    assert "9e+10 FLOP/s" in cpu_line and "measured 20" in cpu_line and "load average 0.00" in cpu_line


def test_peaks_help_names_the_probe(capsys):
    from flopcount.cli import main

    with pytest.raises(SystemExit):
        main(["peaks", "--help"])
    assert "--probe-cpu" in capsys.readouterr().out


@pytest.mark.parametrize("reported, precision, figure", [
    ("AMD Instinct MI300X", "bf16", 1307.4e12), ("AMD Instinct MI300X", "fp32", 163.4e12),
    ("AMD Instinct MI250", "fp16", 362.1e12), ("NVIDIA B200", "bf16", 2250e12), ("NVIDIA B200", "tf32", 1100e12),
    ("NVIDIA L40S", "fp32", 91.6e12), ("NVIDIA L40S", "bf16", 362e12),
])
def test_amd_instinct_b200_and_l40s_are_in_the_table(reported, precision, figure):
    spec = get_device(reported)
    assert spec.peak(precision) == pytest.approx(figure, rel=1e-12)
    assert spec.source.strip() and spec.bandwidth > 0
    # dense figures: the datasheets' sparsity figures are twice these, never the ones kept
    assert "sparsity" in spec.note or "sparsity" in spec.source or spec.name == "MI250"
