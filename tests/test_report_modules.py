"""FlopReport's module questions, as fvcore asks them: the submodules never called (``uncalled_modules``), and the
ops without a formula under one module (``unsupported_ops(module)``). Neither changes the json of a count."""
from __future__ import annotations

import json

import pytest
import torch

import flopcount
from flopcount.base.errors import FlopcountError
from flopcount.counting import blocks
from flopcount.base.report import FlopReport


@torch.library.custom_op("flopcount_report_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_opaque.register_fake
def _(x):
    return torch.empty_like(x)


class _Leaf(torch.nn.Module):
    def forward(self, x):
        return _opaque(_opaque(x))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.leaf = _Leaf()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(_opaque(self.leaf(x)))  # once in the block's own code, twice in its leaf


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()
        self.block2 = torch.nn.Sequential(_Leaf())  # a sibling whose name starts like the block's
        self.keep = torch.nn.Identity()  # called, but runs no op
        self.spare = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())  # defined, never used
        self.extras = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # a container no module of which runs

    def forward(self, x):
        return self.keep(self.block(x)) + self.block2(x)


@pytest.fixture(scope="module")
def report():
    return flopcount.count(_Model(), torch.randn(2, 4), backward=False)


def test_the_modules_never_called_are_listed_in_model_order(report):
    assert report.uncalled_modules() == ["spare", "spare.0", "spare.1", "extras", "extras.0"]


def test_the_uncounted_ops_of_a_module_and_its_parents_but_not_its_siblings(report):
    op = "flopcount_report_test.opaque"
    assert report.unsupported_ops("block.leaf") == {op: 2}
    assert report.unsupported_ops("block") == {op: 3}  # its leaf's 2 and its own 1; block2's are not its
    assert report.unsupported_ops("block2") == {op: 2} and report.unsupported_ops("block2.0") == {op: 2}
    assert report.unsupported_ops() == report.unsupported_ops("") == report.uncounted == {op: 5}
    assert report.unsupported_ops("block.lin") == {} and report.unsupported_ops("spare") == {}


def test_an_unknown_module_is_one_line(report):
    with pytest.raises(FlopcountError, match="the model has no module 'blok'"):
        report.unsupported_ops("blok")


def test_the_module_lists_stay_out_of_the_json(report):
    doc = json.loads(report.to_json())
    assert "modules" not in doc and "modules_called" not in doc
    assert set(report.meta["modules"]) == {n for n, _ in _Model().named_modules()}


def test_a_run_of_blocks_counted_once_knows_every_block_it_did_not_run():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.unused = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(8))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    once = flopcount.count(Stack(), torch.randn(2, 4))
    assert any("counted as layers.2" in n for n in once.notes)  # the run was counted with four of its blocks
    assert once.uncalled_modules() == [f"layers.{i}.unused" for i in range(8)]
    with blocks.every_block():
        every = flopcount.count(Stack(), torch.randn(2, 4))
    assert every.uncalled_modules() == once.uncalled_modules()


def test_a_report_that_does_not_know_the_modules_says_so():
    bare = FlopReport.from_rows([], model="m", estimator="fvcore")
    with pytest.raises(FlopcountError, match="does not record which modules were called"):
        bare.uncalled_modules()
    assert bare.unsupported_ops() == {}
