"""Default tables through ``main()`` hide the rows of 0 FLOPs and the columns of zeros, with a footer that says how
many and how to show them (``--all``); csv and json keep everything."""
import io
import json

import pandas as pd
import pytest

from flopcount.cli import main as cli

MODEL = '''
import torch


def build():
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(20, 5))
'''


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("hidden") / "mlp.py"
    path.write_text(MODEL)
    return f"{path}:build"


def _table_rows(text):
    """The body rows of a table (between the dashed rule under the header and the next rule)."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
    body = []
    for line in lines[rule + 1:]:
        if line.startswith("---") or not line.strip():
            break
        body.append(line.split()[0])
    return body


def test_count_hides_the_ops_of_0_flops_and_says_how_many(spec, capsys):
    argv = ["count", spec, "--input-shape", "10", "--batch", "2"]
    assert cli(argv + ["--format", "csv"]) == 0
    every = pd.read_csv(io.StringIO(capsys.readouterr().out)).set_index("op")
    zero = sorted(every.index[every["total"] == 0])
    # the linears' weight transposes and the loss's plumbing: no arithmetic, and there are some
    assert "aten.t" in zero
    assert cli(argv) == 0
    out = capsys.readouterr().out
    shown = _table_rows(out)
    assert not set(zero) & set(shown) and set(shown) == set(every.index) - set(zero)
    assert f"(hidden: {len(zero)} row(s) of 0 FLOPs (views, copies); --all shows them" in out
    assert cli(argv + ["--all"]) == 0
    out = capsys.readouterr().out
    assert set(_table_rows(out)) == set(every.index) and "hidden" not in out


def test_a_cpu_trace_hides_its_columns_of_zeros(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        model(torch.randn(2, 4)).sum().backward()
    path = str(tmp_path / "t.json")
    prof.export_chrome_trace(path)
    assert cli(["trace", path]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("op "))
    # no device activity: no kernels, and so no naive count (every kernel x every enclosing op)
    assert "kernels" not in header.split() and "naive" not in header.split()
    assert "(hidden: columns of zeros (naive, kernels); --all shows them" in out
    assert cli(["trace", path, "--all"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("op "))
    assert {"naive", "kernels"} <= set(header.split())
    assert cli(["trace", path, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kernels"] == 0 and all(r["kernels"] == 0 for r in doc["per_op"])


def test_infer_of_a_cnn_shows_no_kv_cache_columns(capsys):
    assert cli(["infer", "alexnet"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("phase"))
    assert "KV" not in header
    # a CNN takes no tokens: one forward over its samples
    assert header.split()[:3] == ["phase", "forwards", "samples"] and "FLOPs/sample" in header
    assert "(hidden: columns of zeros (KV read, KV written); --all shows them" in out


def test_a_long_estimator_failure_is_cut_at_a_word(spec, capsys, monkeypatch):
    ops_fx = pytest.importorskip("pthflops.ops_fx")
    words = " ".join(f"word{i}" for i in range(120))  # one sentence, longer than a line may be

    class Boom:
        def __init__(self, traced):
            pass

        def run(self, *args):
            raise RuntimeError(f"cannot trace {words}")

    monkeypatch.setattr(ops_fx, "ProfilingInterpreter", Boom)  # pthflops itself fails, as on an untraceable model
    assert cli(["compare", spec, "--input-shape", "10", "--estimators", "pthflops"]) == 0
    err = capsys.readouterr().err
    warning = next(line for line in err.splitlines() if "pthflops failed" in line)
    said = warning.rsplit("...", 1)[0].split("cannot trace ", 1)[1].split()
    assert warning.endswith("...") and said == words.split()[:len(said)]  # whole words only, in order
