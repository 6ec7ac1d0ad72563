"""The package loads its public names on first use: importing it (as the ``flopcount`` command does) costs no
torch, and each name is what it was when the package imported everything at once."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)  # a hang guard, not a speed limit
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_import_costs_no_torch_and_dtype_tables_need_none():
    out = _python("import sys, flopcount\n"
                  "from flopcount.dtypes import precision_of, CHOICES\n"
                  "print('torch' in sys.modules, precision_of('bf16'), precision_of('float', allow_tf32=True))")
    assert out == "False bf16 tf32"


def test_public_names_resolve_on_first_use():
    out = _python("import flopcount, flopcount.compare, flopcount.utilization\n"
                  "from flopcount import compare, utilization, FlopReport, EstimatorError, estimators\n"
                  "print(callable(compare), compare.__module__, utilization.__module__, FlopReport.__name__,\n"
                  "      issubclass(EstimatorError, Exception), estimators.__name__, flopcount.compare is compare,\n"
                  "      'count' in dir(flopcount) and 'get_estimator' in dir(flopcount))")
    assert out == "True flopcount.compare flopcount.utilization FlopReport True flopcount.estimators True True"


def test_parse_dtype_still_gives_torch_dtypes():
    import torch

    from flopcount.dtypes import DtypeError, parse_dtype

    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    assert parse_dtype(None) is None
    try:
        parse_dtype("int3")
    except DtypeError:
        pass
    else:
        raise AssertionError("int3 parsed")
