"""The aten facts the profile readers use without torch (formulas/schemas.py, data/aten_ops.json) are the installed
torch's, and reading a profile loads no torch."""
import json
import os
import subprocess
import sys

import pytest
import torch

from flopcount import formulas
from flopcount.formulas import registry, schemas
from flopcount.formulas.schemas_gen import generate
from flopcount.profiles.marker_args import broadcast_shapes, derive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


def test_the_table_is_the_installed_torchs():
    """Rerun ``python -m flopcount.formulas.schemas_gen`` after a torch upgrade or a new formula."""
    stored = json.loads(open(schemas.DATA, encoding="utf-8").read())
    assert json.loads(json.dumps(generate())) == stored
    assert schemas.table() is not None  # and it is the one in use


def test_every_name_the_formulas_asked_about_is_answered_as_torch_would():
    assert registry.ASKED
    assert {n for n in registry.ASKED if schemas.exists(n)} == {n for n in registry.ASKED if hasattr(torch.ops.aten, n)}


@pytest.mark.parametrize("op", ["aten::mm", "aten::addmm", "aten::convolution", "aten::softmax", "aten::sum",
                                "aten::scaled_dot_product_attention", "aten::native_layer_norm_backward"])
def test_schemas_and_composite_as_torch_gives_them(op):
    for out in (False, True):
        assert schemas.schemas(op, out) == tuple(
            tuple((a[0], a[1], a[3] if len(a) > 3 else schemas.NO_DEFAULT, a[2]) for a in args)
            for is_out, args in schemas.from_torch(op) if bool(is_out) == out)
    assert schemas.is_composite(op) == schemas.composite_from_torch(op)


def test_an_op_the_table_lacks_is_asked_of_torch():
    assert schemas.is_composite("aten::no_such_op") is False and schemas.schemas("aten::no_such_op") == ()
    assert schemas.is_composite("myns::custom") is False


def test_shapes_without_torch_price_as_torch_sizes_do():
    for shapes in ([(2, 1, 4), (3, 1)], [(5,), ()], [(0, 1), (1, 7)], [(2, 3), (2, 3)]):
        assert tuple(broadcast_shapes(shapes)) == tuple(torch.broadcast_shapes(*shapes))
    with pytest.raises(ValueError):
        broadcast_shapes([(2, 3), (4, 3)])
    # by hand: (8 x 16) @ (16 x 32) is 2 x 8 x 32 x 16; a bias adds 8 x 32
    assert derive("aten::mm", [[8, 16], [16, 32]]) == (2 * 8 * 32 * 16, "")
    assert derive("aten::addmm", [[32], [8, 16], [16, 32], [], []]) == (2 * 8 * 32 * 16 + 8 * 32, "")
    assert formulas.is_shape(formulas.Size((2, 3))) and formulas.is_shape(torch.Size((2, 3)))
    assert not formulas.is_shape((2, 3))


LISTING = ("import atexit, json, os, runpy, sys; "
           "atexit.register(lambda: open(os.environ['MODULES_OUT'], 'w').write(json.dumps(sorted(sys.modules)))); "
           "sys.argv = ['flopcount'] + sys.argv[1:]; runpy.run_module('flopcount', run_name='__main__')")


@pytest.mark.parametrize("argv", [["nsys", "nsys/mfu_2gpu_before.sqlite"], ["trace", "kineto/sampled_rank0_train.json.gz"]])
def test_reading_a_profile_loads_no_torch(tmp_path, argv):
    out = tmp_path / "modules.json"
    env = dict(os.environ, MODULES_OUT=str(out), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path = os.path.join(FIXTURES, argv[1])
    res = subprocess.run([sys.executable, "-c", LISTING, argv[0], path, "--format", "json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-1000:]
    assert json.loads(res.stdout)  # a document was printed
    assert not [m for m in json.loads(out.read_text()) if m.split(".")[0] == "torch"]
