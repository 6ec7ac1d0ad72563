"""What the command line loads before it has work to do: the help, the version, the peak table (a CSV read and
printed) and the formula table start without torch or pandas, which take seconds to import. Each command runs in a
fresh interpreter that lists the modules it loaded on its way out."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flopcount.cli.main import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "pandas")
# The two ways in: ``python -m flopcount`` and the installed script (``flopcount.cli:main``).
MODULE = ("import runpy, sys; sys.argv = ['flopcount'] + sys.argv[1:]; "
          "runpy.run_module('flopcount', run_name='__main__')")
SCRIPT = "import sys; from flopcount.cli import main; sys.argv = ['flopcount'] + sys.argv[1:]; sys.exit(main())"
LISTING = ("import atexit, json, os, sys; "
           "atexit.register(lambda: open(os.environ['MODULES_OUT'], 'w').write(json.dumps(sorted(sys.modules))))\n")


def loaded(tmp_path, entry: str, *argv: str):
    """(exit code, stdout, the names of every module loaded) of one command line in a new interpreter."""
    out = tmp_path / "modules.json"
    env = dict(os.environ, MODULES_OUT=str(out), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FLOPCOUNT_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", LISTING + entry, *argv], env=env, capture_output=True, text=True,
                         timeout=120)
    return res.returncode, res.stdout, json.loads(out.read_text())


def heavy(modules) -> list:
    return [m for m in modules if m.split(".")[0] in HEAVY]


@pytest.mark.parametrize("argv", [
    ["--help"], ["--version"], ["peaks"], ["peaks", "--sources"], ["peaks", "--format", "csv"],
    ["peaks", "--format", "json"], ["formulas"], ["formulas", "--format", "json"],
])
@pytest.mark.parametrize("entry", [MODULE, SCRIPT], ids=["python -m flopcount", "flopcount"])
def test_help_version_and_peaks_load_neither_torch_nor_pandas(tmp_path, entry, argv):
    # (the formula table too, whose ops are checked against the generated aten table where it is this torch's)
    code, out, modules = loaded(tmp_path, entry, *argv)
    assert code == 0 and out
    assert heavy(modules) == [], \
        f"flopcount {' '.join(argv)} loaded {sorted({m.split('.')[0] for m in heavy(modules)})}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_help_loads_neither_torch_nor_pandas(tmp_path, command):
    code, out, modules = loaded(tmp_path, MODULE, command, "--help")
    assert code == 0 and "usage: flopcount" in out
    assert heavy(modules) == []


def test_peaks_json_is_the_table_with_its_numbers(tmp_path):
    """The rows printed without pandas carry the figures of the library's own table."""
    from flopcount.device.datasheet import get_device

    code, out, _ = loaded(tmp_path, MODULE, "peaks", "--format", "json")
    rows = {r["name"]: r for r in json.loads(out)}
    h100 = get_device("H100 SXM")
    assert rows[h100.name]["bf16"] == h100.peak("bf16") and rows[h100.name]["bandwidth"] == h100.bandwidth
    assert all(r["fp32"] is None or r["fp32"] > 0 for r in rows.values())


def test_the_package_loads_its_public_names_on_first_use(tmp_path):
    """``import flopcount`` is light; its public names are there as before (``flopcount.compare`` stays the
    function once the module of the same name is loaded)."""
    code, _, modules = loaded(tmp_path, "import flopcount; print(flopcount.__version__)")
    assert code == 0 and heavy(modules) == []
    probe = ("import flopcount, flopcount.analyses.compare, flopcount.analyses.utilization, inspect; "
             "print(all(callable(getattr(flopcount, n)) for n in ('count', 'compare', 'utilization', "
             "'generate_cost', 'register_formula', 'register_estimator', 'available_estimators', 'get_estimator')), "
             "inspect.isfunction(flopcount.compare), inspect.isfunction(flopcount.utilization), "
             "issubclass(flopcount.EstimatorError, Exception), flopcount.FlopReport.__name__)")
    code, out, modules = loaded(tmp_path, probe)
    assert code == 0 and out.split() == ["True", "True", "True", "True", "FlopReport"]


# --- the package itself: its public names load on first use, each what it was when all loaded at once ---------
def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)  # a hang guard, not a speed limit
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_import_costs_no_torch_and_dtype_tables_need_none():
    out = _python("import sys, flopcount\n"
                  "from flopcount.base.dtypes import precision_of, CHOICES\n"
                  "print('torch' in sys.modules, precision_of('bf16'), precision_of('float', allow_tf32=True))")
    assert out == "False bf16 tf32"


def test_public_names_resolve_on_first_use():
    out = _python("import flopcount, flopcount.analyses.compare, flopcount.analyses.utilization\n"
                  "from flopcount import compare, utilization, FlopReport, EstimatorError, estimators\n"
                  "print(callable(compare), compare.__module__, utilization.__module__, FlopReport.__name__,\n"
                  "      issubclass(EstimatorError, Exception), estimators.__name__, flopcount.compare is compare,\n"
                  "      'count' in dir(flopcount) and 'get_estimator' in dir(flopcount))")
    assert out == "True flopcount.analyses.compare flopcount.analyses.utilization FlopReport True flopcount.estimators True True"


def test_parse_dtype_still_gives_torch_dtypes():
    import torch

    from flopcount.base.dtypes import DtypeError, parse_dtype

    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    assert parse_dtype(None) is None
    try:
        parse_dtype("int3")
    except DtypeError:
        pass
    else:
        raise AssertionError("int3 parsed")
