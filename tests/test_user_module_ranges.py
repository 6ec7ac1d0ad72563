"""``flopcount nsys --by module`` from a user's own NVTX ranges named by module path (no flopcount.recording.nvtx annotator):
generated exports of one training step of a small model, the user's ranges pushed around chosen modules' forward,
in the default domain, in a domain of their own and behind a prefix; each range's FLOPs checked against the ops
placed inside it by hand."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flopcount.cli import main as cli
from flopcount.profiles import analyze
from helpers import CONV, FC, LOSS, RELU, check_module_rows, module_rows, ranged_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
REAL = HERE / "fixtures" / "nsys" / "mfu_2gpu_before.sqlite"

# The forward ops inside each range are worked by hand beside the model (helpers.ranged_model).
RANGES = ["features", "features.0", "fc"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    pytest.importorskip("torch")
    import nvtx_profile_gen as gen

    folder = tmp_path_factory.mktemp("user_ranges")
    model, x = ranged_model()

    def step():
        model.zero_grad(set_to_none=True)  # no gradient accumulation: every step is the same ops
        model(x).pow(2).mean().backward()

    return SimpleNamespace(
        default=gen.generate_user_ranges(model, step, str(folder / "default.sqlite"), RANGES),
        domain=gen.generate_user_ranges(model, step, str(folder / "domain.sqlite"), RANGES, domain="myapp"),
        prefixed=gen.generate_user_ranges(model, step, str(folder / "prefixed.sqlite"), RANGES, prefix="module: "),
        plain=gen.generate_step(step, str(folder / "plain.sqlite"), orphan_kernels=0))


def _rows(capsys, argv):
    return module_rows(cli, capsys, argv)


def _check(rows, backward_total):
    # the backward runs on the autograd thread, where the user pushed no range: all of it is the root's
    check_module_rows(rows, backward_total)
    assert all(r["calls"] == 1 for m, r in rows.items() if m)  # one forward call, one range each


def test_default_domain_ranges_named_like_module_paths_are_modules(exports, capsys):
    backward = analyze(exports.default).report.total("backward")
    # the ranges change no op's count: the same step without them has the same FLOPs
    plain = analyze(exports.plain).report
    assert plain.total("forward") == CONV + RELU + FC + LOSS and plain.total("backward") == backward
    _check(_rows(capsys, ["nsys", exports.default, "--by", "module"]), backward)


def test_a_domain_of_the_users_own(exports, capsys):
    backward = analyze(exports.domain).report.total("backward")
    _check(_rows(capsys, ["nsys", exports.domain, "--by", "module", "--module-ranges", "myapp"]), backward)


def test_a_prefix(exports, capsys):
    backward = analyze(exports.prefixed).report.total("backward")
    _check(_rows(capsys, ["nsys", exports.prefixed, "--by", "module", "--module-ranges", "module: "]), backward)
    # without the rule, "module: fc" is no module path: nothing to group by
    assert cli(["nsys", exports.prefixed, "--by", "module"]) == 2


def test_the_table_says_where_the_modules_come_from(exports, capsys):
    assert cli(["nsys", exports.default, "--by", "module"]) == 0
    out = capsys.readouterr().out
    assert "default domain's NVTX ranges named like a module path" in out
    assert next(line for line in out.splitlines() if line.startswith("features.0"))


@pytest.mark.parametrize("argv, fragment", [
    # emit_nvtx alone names ops, never modules: refused, saying what would work
    (["--by", "module"], "none named like a module path (emit_nvtx's name ops, not modules)"),
    (["--by", "module", "--module-ranges", "nope"], "in a domain 'nope', nor one named 'nope' + a module path"),
    (["--by", "op", "--module-ranges", "myapp"], "--module-ranges applies to --by module"),
])
def test_refusals_are_one_line(exports, capsys, argv, fragment):
    assert cli(["nsys", exports.plain] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err


@pytest.mark.skipif(not REAL.exists(), reason="real nsys fixtures missing (tests/fixtures/nsys)")
def test_nccl_ranges_of_an_unnamed_domain_are_not_modules(capsys):
    # the real export's NCCL ranges (ncclSend, ...) sit in a domain whose creation the capture window cut off: a
    # name without a dot that looks like a module path, but not in the default domain
    assert cli(["nsys", str(REAL), "--by", "module"]) == 2
    assert "none named like a module path" in capsys.readouterr().err
