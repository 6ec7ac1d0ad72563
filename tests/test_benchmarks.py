"""Every benchmark runs at a tiny size and prints its ratio (no time is asserted: speed lives in benchmarks/)."""
import re

import pytest

from helpers import run_benchmark


def test_count_speed_prints_the_ratio_against_flop_counter_mode():
    out = run_benchmark("count_speed.py", "--models", "resnet18", "--batch", "1", "--repeat", "2")
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


def test_kineto_parse_prints_its_ratio_to_json_load():
    out = run_benchmark("kineto_parse.py", "--events", "3000", "--repeat", "1")
    assert "generated a trace of 3,000 events" in out
    assert re.search(r"load / json\.load = \d+\.\d\dx, analyze / json\.load = \d+\.\d\dx", out)
    assert "target not judged" in out


@pytest.mark.slow
def test_job_read_gives_one_report_from_every_mode():
    """16 ranks (a real trace copied, each rank's clock skewed): one process, 2 and 4 worker processes and a Dask
    LocalCluster (where installed) give equal ranks, job and stragglers."""
    out = run_benchmark("job_read.py", "--ranks", "16", "--runs", "1")
    assert re.search(r"^1 worker .*\n2 workers .*\n4 workers ", out, re.M), out
    assert "PASS (ranks, job and stragglers equal across every mode and run)" in out, out
def test_trace_speed_prints_its_cpu_ratio_to_orjson():
    out = run_benchmark("trace_speed.py", "--events", "3000", "--repeat", "1")
    assert "generated 3,000 events" in out
    assert re.search(r"flopcount / floor: \d+\.\d\dx CPU \(per round \d+\.\d\d-\d+\.\d\d\)", out), out
