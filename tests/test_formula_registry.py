"""The formula table: a name is registered once; one count may carry formulas of its own (``formulas=``) that leave
the table as it was; ``flopcount formulas`` and the docs' page list the table from the table itself."""
from __future__ import annotations

import csv
import io
import json

import pytest
import torch

import flopcount
from flopcount import formulas
from flopcount.cli.main import main
from flopcount.base.errors import FlopcountError
from flopcount.estimators import EstimatorError
from flopcount.counting import counting, rows_of
from flopcount.formulas import FormulaError, listing, matmul, per_count


def _mm_flops(report, phase=None) -> int:
    f = report.frame[report.frame["op"] == "aten.mm"]
    if phase is not None:
        f = f[f["phase"] == phase]
    return int(f["flops"].sum())


# --- one registration per name ------------------------------------------------------------------------------------
def test_a_second_formula_for_a_name_is_refused_and_the_table_kept():
    with pytest.raises(FormulaError, match=r"aten\.mm has a formula already") as err:
        flopcount.register_formula("aten.mm")(lambda *a, **k: 1)
    assert "\n" not in str(err.value) and isinstance(err.value, FlopcountError)
    assert formulas.lookup("aten.mm") is matmul.mm and formulas.op_family("aten.mm") == "matmul"


def test_a_name_declared_zero_is_refused_either_way():
    with pytest.raises(FormulaError, match=r"aten\.view is declared zero-FLOP already \(view\)"):
        formulas.register("aten.view", family="custom")(lambda *a, **k: 1)
    with pytest.raises(FormulaError, match=r"aten\.mm has a formula already"):
        formulas.register_zero(formulas.MEMORY, ["aten.mm"])
    assert formulas.ZERO_FLOP["aten.view"] == formulas.VIEW and "aten.mm" not in formulas.ZERO_FLOP


def test_a_refused_registration_registers_none_of_its_names():
    fresh = "flopcount_registry_test.never_registered"
    with pytest.raises(FormulaError, match=r"aten\.bmm"):
        formulas.register(fresh, "aten.bmm", family="custom")(lambda *a, **k: 1)
    with pytest.raises(FormulaError, match="given twice"):
        formulas.register(fresh, fresh, family="custom")(lambda *a, **k: 1)
    assert fresh not in formulas.FLOP_FORMULAS and fresh not in formulas.FAMILY


def test_a_new_name_registers_once():
    name = "flopcount_registry_test.once"
    fn = flopcount.register_formula(name)(lambda *a, out_shape=None, **k: 5)
    assert formulas.lookup(name) is fn and formulas.op_family(name) == "custom"
    with pytest.raises(FormulaError, match=name.replace(".", r"\.")):
        flopcount.register_formula(name)(fn)


# --- formulas of one count ------------------------------------------------------------------------------------------
def _sizes_product(a, b, out_shape=None, **_):
    """rows of the first operand x columns of the second: a formula that reads the sizes it is given."""
    return a[0] * b[1]


@pytest.mark.parametrize("key", [torch.ops.aten.mm, "aten.mm"], ids=["packet", "name"])
def test_a_count_with_its_own_mm_formula_and_the_next_without(key):
    model, x = torch.nn.Linear(8, 4, bias=False), torch.randn(2, 8)
    # by hand, the table's 2mkn: forward (2, 8) @ (8, 4) = 2 * 2 * 8 * 4 = 128; backward, the weight's gradient
    # only (the input needs none): grad_out.t() (4, 2) @ x (2, 8) = 2 * 4 * 2 * 8 = 128
    table = flopcount.count(model, x)
    assert _mm_flops(table, "forward") == 128 and _mm_flops(table, "backward") == 128
    own = flopcount.count(model, x, formulas={key: _sizes_product})
    # by hand, rows x columns: forward 2 x 4 = 8, backward 4 x 8 = 32
    assert _mm_flops(own, "forward") == 8 and _mm_flops(own, "backward") == 32
    assert table.total() - own.total() == (128 + 128) - (8 + 32)
    assert any("aten.mm" in n and "formulas=" in n for n in own.notes)
    again = flopcount.count(model, x)
    assert again.total() == table.total() and _mm_flops(again) == 256
    assert formulas.lookup("aten.mm") is matmul.mm and per_count.current() == {}


def test_a_count_formula_prices_an_op_the_table_declares_zero():
    model = torch.nn.Flatten()
    x = torch.randn(2, 3, 4)
    assert flopcount.count(model, x, backward=False).total() == 0
    own = flopcount.count(model, x, backward=False,
                          formulas={"aten.view": lambda x, *a, out_shape=None, **k: x.numel()})
    assert own.by("op")["forward"]["aten.view"] == 2 * 3 * 4  # the input's elements, by hand
    assert formulas.ZERO_FLOP["aten.view"] == formulas.VIEW


def test_the_table_is_the_same_after_a_count_that_failed():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x) @ torch.ones(3, 3)  # (2, 4) @ (3, 3): does not fit

    with pytest.raises(RuntimeError, match="same reduction dim"):
        flopcount.count(Broken(), torch.randn(2, 8), formulas={"aten.addmm": lambda *a, **k: 1})
    assert per_count.current() == {}
    assert flopcount.count(torch.nn.Linear(8, 4), torch.randn(2, 8), backward=False).total() == \
        2 * 2 * 8 * 4 + 2 * 4  # addmm by the table: 2mkn and the bias's m x n adds


class _Twice(torch.nn.Module):
    """The same product twice, by ``torch.mm`` (the memo's own table) and by a linear layer (its replayed calls)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4))
        self.lin = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.lin(torch.mm(x, self.w))


def _remembered_mm(model, x, table=None):
    """(FLOPs of aten.mm, memo hits) of two calls of ``model`` in one remembering count."""
    with per_count.applied(table or {}):
        with counting(model, x, remember=True) as (counter, inputs):
            model(inputs)
            model(inputs)
    rows = rows_of(counter)
    return sum(r["flops"] for r in rows if r["op"] == "aten.mm"), counter.memo.hits


def test_no_count_reuses_what_another_remembered_with_other_formulas():
    model, x = _Twice(), torch.randn(2, 8)
    # by hand, per call: (2, 8) @ (8, 4) = 2*2*8*4 = 128 and (2, 4) @ (4, 4) = 2*2*4*4 = 64; two calls: 384
    table, hits = _remembered_mm(model, x)
    assert table == 384 and hits >= 2  # the second call came from the memo
    own, hits = _remembered_mm(model, x, {"aten.mm": lambda *a, **k: 1000})
    assert own == 4 * 1000 and hits >= 2  # the remembered second call kept this count's formula
    assert _remembered_mm(model, x)[0] == 384


@pytest.mark.parametrize("bad, fragment", [
    ({"aten.mm": 3}, "is a int, not a function"),
    ({"aten.no_such_op": len}, "unknown op 'aten.no_such_op'"),
    ({"aten::mm": len}, "unknown op 'aten::mm'"),
    ({"nowhere_at_all.mm": len}, "unknown op 'nowhere_at_all.mm'"),
    ({torch.ops.aten.mm.default: len}, "give its packet, torch.ops.aten.mm"),
    ({torch.ops.aten.mm: len, "aten.mm": len}, "given twice"),
    ([("aten.mm", len)], "a mapping"),
])
def test_bad_count_formulas_are_one_line_errors(bad, fragment):
    with pytest.raises(FormulaError) as err:
        flopcount.count(torch.nn.Linear(8, 4), torch.randn(2, 8), formulas=bad)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert per_count.current() == {}


def test_count_formulas_are_refused_by_another_estimator():
    with pytest.raises(EstimatorError, match="formulas= applies to the dispatch estimator") as err:
        flopcount.count(torch.nn.Linear(8, 4), torch.randn(2, 8), estimator="ptflops",
                        formulas={"aten.mm": len})
    assert "\n" not in str(err.value)


# --- the listing --------------------------------------------------------------------------------------------------
def test_the_listing_is_every_op_of_the_table_and_follows_it():
    name = "flopcount_registry_test.listed"

    @flopcount.register_formula(name, family="custom")
    def listed_formula(x, out_shape=None):
        """Seven FLOPs, whatever the sizes.

        More text that the listing leaves out."""
        return 7

    rows = listing.rows()
    assert [r["op"] for r in rows if r["op"] not in formulas.FLOP_FORMULAS and r["op"] not in formulas.ZERO_FLOP] == []
    assert {r["op"] for r in rows} == set(formulas.FLOP_FORMULAS) | set(formulas.ZERO_FLOP)
    by_op = {r["op"]: r for r in rows}
    assert by_op[name] == dict(op=name, family="custom", module=__name__, kind="formula",
                               formula="test_the_listing_is_every_op_of_the_table_and_follows_it.listed_formula",
                               about="Seven FLOPs, whatever the sizes.")
    mm = by_op["aten.mm"]
    assert (mm["family"], mm["module"], mm["kind"], mm["formula"]) == ("matmul", "matmul", "formula", "mm")
    assert mm["about"] == matmul.mm.__doc__.strip().splitlines()[0]
    assert by_op["aten.view"]["kind"] == "view" and by_op["aten.view"]["formula"] == ""
    assert by_op["aten.clone"]["kind"] == "memory"
    assert by_op["aten.max_pool2d"]["formula"] == "_maxpool.formula"  # a formula made by a function
    assert by_op["aten.mul"]["about"] == "Per output element: 1 FLOP."


def test_the_markdown_page_has_one_row_per_op():
    page = listing.markdown()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert page.startswith("# The formula table\n") and len(rows) == len(listing.rows())
    assert "| `aten.mm` | matmul | matmul | `mm` | ``2 m k n`` for ``(m, k) @ (k, n)``. |" in page
    assert "| `aten.view` | memory | memory | view | A view or metadata op: no arithmetic, no bytes. |" in page
    assert all(line.count(" | ") - line.count("\\|") == 4 for line in rows)  # no cell's text breaks the table
    assert not listing.markdown(title="").startswith("#")


def test_the_formulas_command_in_each_format(capsys):
    assert main(["formulas", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == listing.rows()
    assert main(["formulas", "--format", "csv", "--family", "matmul"]) == 0
    got = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert got and {r["family"] for r in got} == {"matmul"} and list(got[0]) == list(listing.COLUMNS)
    assert {r["op"] for r in got} == {op for op, fam in formulas.FAMILY.items() if fam == "matmul"
                                      and (op in formulas.FLOP_FORMULAS or op in formulas.ZERO_FLOP)}
    assert main(["formulas", "--family", "matmul"]) == 0
    out = capsys.readouterr().out
    assert "aten.mm " in out and "aten.view" not in out


def test_an_unknown_family_is_one_line_and_exit_2(capsys):
    assert main(["formulas", "--family", "no_such_family"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flopcount: error: no op of family 'no_such_family'") and "\n" not in err
