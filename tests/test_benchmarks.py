"""Every benchmark runs at a tiny size and prints its ratio (no time is asserted: speed lives in benchmarks/)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(script, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_count_speed_prints_the_ratio_against_flop_counter_mode():
    out = run_benchmark("count_speed.py", "--models", "resnet18", "--batch", "1", "--repeat", "2")
    assert re.search(r"ratio flopcount / FlopCounterMode = \d+\.\d\d .*over 2 rounds", out)


def test_compare_speed_prints_the_ratio_against_dispatch_alone():
    out = run_benchmark("compare_speed.py", "--models", "alexnet", "--estimators", "fvcore", "--batch", "1")
    assert re.search(r"^all\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d", out, re.M)


def test_timing_overhead_prints_the_paired_ratio():
    out = run_benchmark("timing_overhead.py", "--rounds", "3", "--steps", "2", "--width", "16", "--batch", "2")
    assert "median over paired rounds" in out and "%" in out


def test_nvtx_parse_prints_its_ratios_by_wall_and_cpu():
    out = run_benchmark("nvtx_parse.py", "--ranges", "400", "--kernels", "400", "--repeat", "2", "--subset", "20",
                        "--scan-subset", "5", "--memory-subset", "100")
    assert "400 ranges, 400 kernels attributed" in out
    assert re.search(r"analyze over 2 runs: wall median \d+\.\d\d s .* CPU median .* peak \d+\.\d\d GB", out)
    ratios = re.findall(r"analyze is (\d+(?:\.\d+)?)x faster \(wall\), (\d+(?:\.\d+)?)x \(CPU\)", out)
    assert len(ratios) == 4, out  # indexed loop, loop without indexes, row-wise reader, in-memory loop
    assert "target not judged" in out


def test_kineto_parse_prints_its_ratio_to_json_load():
    out = run_benchmark("kineto_parse.py", "--events", "3000", "--repeat", "1")
    assert "generated a trace of 3,000 events" in out
    assert re.search(r"analyze / json\.load = \d+\.\d\dx", out) and "target not judged" in out
