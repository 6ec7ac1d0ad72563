"""Every benchmark runs at a tiny size and prints its ratio (no time is asserted: speed lives in benchmarks/)."""
import importlib.util
import json
import os
import re

import pytest

from helpers import ROOT, run_benchmark

pytestmark = pytest.mark.bench  # `-m 'not bench'` leaves the benchmarks' smoke tests out


def test_count_speed_prints_the_ratio_against_flop_counter_mode():
    out = run_benchmark("count_speed.py", "--models", "alexnet", "--batch", "1", "--repeat", "2", "--linear-calls", "3")
    assert re.search(r"ratio flopcount / FlopCounterMode = \d+\.\d\d .*over 2 rounds", out)


def test_compare_speed_prints_the_ratio_against_dispatch_alone():
    out = run_benchmark("compare_speed.py", "--models", "alexnet", "--estimators", "fvcore", "--batch", "1")
    assert re.search(r"^all\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d", out, re.M)


def test_timing_overhead_prints_the_paired_ratio():
    out = run_benchmark("timing_overhead.py", "--rounds", "3", "--steps", "2", "--width", "16", "--batch", "2")
    assert "median over paired rounds" in out and "%" in out


def test_annotation_overhead_prints_paired_ratios():
    out = run_benchmark("annotation_overhead.py", "--size", "32", "--batch", "2", "--rounds", "2", "--steps", "1")
    ratios = re.findall(r"annotated / bare = \d+\.\d{4} \(median of 2 pairs; quartiles \d+\.\d{4} \.\. \d+\.\d{4}\)", out)
    assert len(ratios) >= 2, out  # wall and CPU time, for each annotated loop that can run here


def test_nvtx_parse_prints_its_ratios_by_wall_and_cpu():
    out = run_benchmark("nvtx_parse.py", "--ranges", "400", "--kernels", "400", "--repeat", "2", "--subset", "20",
                        "--scan-subset", "5", "--memory-subset", "100")
    assert "400 ranges, 400 kernels attributed" in out
    assert re.search(r"analyze over 2 runs: wall median \d+\.\d\d s .* CPU median .* peak \d+\.\d\d GB", out)
    ratios = re.findall(r"analyze is (\d+(?:\.\d+)?)x faster \(wall\), (\d+(?:\.\d+)?)x \(CPU\)", out)
    assert len(ratios) == 4, out  # indexed loop, loop without indexes, row-wise reader, in-memory loop
    assert "target not judged" in out


def test_nsys_speed_prints_cpu_ratios_against_the_loop_and_the_floor():
    out = run_benchmark("nsys_speed.py", "--ranges", "400", "--kernels", "300", "--repeat", "1")
    assert "generated 400 ranges and 300 kernels" in out
    assert re.search(r"indexed per-kernel loop \(300 kernels placed\)", out), out
    assert re.search(r"loop / flopcount: \d+\.\d\dx CPU, .* flopcount / floor: \d+\.\d\dx CPU", out), out


@pytest.fixture(scope="module")
def kineto_run(tmp_path_factory):
    """kineto_parse's output at 3,000 events and the trace it generated, kept: trace_speed reads the same trace
    rather than generating its own (most of either run is the generation: torch, torchvision, a profiled step)."""
    path = tmp_path_factory.mktemp("kineto") / "trace.json.gz"
    return run_benchmark("kineto_parse.py", "--events", "3000", "--repeat", "1", "--keep", str(path)), path


def test_kineto_parse_prints_its_ratio_to_json_load(kineto_run):
    out, _ = kineto_run
    assert "generated a trace of 3,000 events" in out
    assert re.search(r"load / json\.load = \d+\.\d\dx, analyze / json\.load = \d+\.\d\dx", out)
    assert "target not judged" in out


@pytest.mark.slow
def test_job_read_gives_one_report_from_every_mode():
    """4 ranks (a real trace copied, each rank's clock skewed): one process, 2 and 4 worker processes and a Dask
    LocalCluster (where installed) give equal ranks, job and stragglers."""
    out = run_benchmark("job_read.py", "--ranks", "4", "--runs", "1")
    assert re.search(r"^1 worker .*\n2 workers .*\n4 workers ", out, re.M), out
    assert "PASS (ranks, job and stragglers equal across every mode and run)" in out, out


def test_trace_speed_prints_its_cpu_ratio_to_orjson(kineto_run):
    out = run_benchmark("trace_speed.py", "--trace", str(kineto_run[1]), "--repeat", "1")
    assert "generated" not in out and "orjson.loads of the file (3,000 events)" in out  # the trace given, read
    assert re.search(r"flopcount / floor: \d+\.\d\dx CPU \(per round \d+\.\d\d-\d+\.\d\d\)", out), out


def test_json_identity_finds_equal_runs_equal_and_one_changed_byte(tmp_path):
    """Two runs of one cheap command (trace of a small fixture) give the same bytes; a byte changed is reported."""
    spec = importlib.util.spec_from_file_location("json_identity", os.path.join(ROOT, "benchmarks", "json_identity.py"))
    ji = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ji)
    with pytest.raises(SystemExit) as bad:
        ji.main(["--write", str(tmp_path), "--only", "trace_mi250,no_such_command"])
    assert bad.value.code == 2 and not list(tmp_path.iterdir())  # refused before running anything
    assert ji.main(["--write", str(tmp_path), "--only", "trace_mi250"]) == 0
    assert [f.name for f in tmp_path.iterdir()] == ["trace_mi250.json"]
    data = (tmp_path / "trace_mi250.json").read_bytes()
    assert json.loads(data)["ops"]  # the json of a trace with its ops
    first, again = {"trace_mi250": (0, data)}, ji.run_all(ROOT, ["trace_mi250"])
    assert list(again) == ["trace_mi250"] and ji.compare(first, again) == []
    i = data.index(b'"') + 1
    changed = {"trace_mi250": (0, data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])}
    [(name, lines)] = ji.compare(changed, again)
    assert name == "trace_mi250" and lines[0] == "exit 0 -> 0"
    assert any(line.startswith("-") and not line.startswith("---") for line in lines), lines
    assert any(line.startswith("+") and not line.startswith("+++") for line in lines), lines
    assert [n for n, _ in ji.compare({}, again)] == ["trace_mi250"]  # run on one side only: a difference too
