"""The set-up work of one count, bounded (never its time: speed lives in benchmarks/count_speed.py): what is built
once per process is not built again, what one count needs once is done once, and the faster ways of building the
report give the same report."""
import pandas as pd
import pytest
import torch

import flopcount
import flopcount.counting.engine as dispatch
from flopcount.counting.ops import OpInfo
from flopcount.base.report import COLUMNS, FlopReport, _frame_of_columns


def _model():
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


def test_what_the_counter_knows_of_an_op_is_built_once_per_process():
    model, x = _model(), torch.randn(2, 16)
    first = flopcount.count(model, x)
    made = OpInfo.made
    again = flopcount.count(model, x)
    other = flopcount.count(_model(), torch.randn(3, 16))  # another model of the same ops: nothing new either
    assert OpInfo.made == made
    pd.testing.assert_frame_equal(first.frame, again.frame)
    assert other.total() > 0


@torch.library.custom_op("flopcount_speed_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_scaled.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_formula_registered_between_counts_is_used_by_the_next():
    """What the counter knows of an op is kept for the process, yet an op that gets a formula (a name is registered
    once: an op that had none) is priced by it from the next count on."""
    class Scale(torch.nn.Module):
        def forward(self, x):
            return _scaled(x)

    x = torch.randn(2, 16)
    before = flopcount.count(Scale(), x, backward=False)
    assert before.uncounted == {"flopcount_speed_test.scaled": 1}
    flopcount.register_formula("flopcount_speed_test.scaled", family="pointwise")(lambda x, out_shape=None: 7)
    after = flopcount.count(Scale(), x, backward=False)
    assert after.uncounted == {} and after.by("op")["forward"]["flopcount_speed_test.scaled"] == 7


def test_the_model_is_snapshotted_once_per_count(monkeypatch):
    real = dispatch.preserved
    entered = []

    def counted(model):
        entered.append(model)
        return real(model)

    monkeypatch.setattr(dispatch, "preserved", counted)
    model = _model()
    flopcount.count(model, torch.randn(2, 16))
    assert entered == [model]
    entered.clear()
    flopcount.count(model, torch.randn(2, 16), device="cpu")
    assert entered == [model]


def _rows(n=5):
    return [dict(module=f"m{i}", op="aten.mm", phase="forward", dtype="float32", family="matmul", status="counted",
                 flops=10 * i, bytes=4 * i, calls=1) for i in range(n)]


def _as_before(rows):
    """The report's frame as it was built before the column-wise path: from the list of dicts."""
    frame = pd.DataFrame(list(rows))
    if frame.empty:
        frame = pd.DataFrame(columns=COLUMNS)
    for col in COLUMNS:
        if col not in frame.columns:
            frame[col] = 0 if col in ("flops", "bytes", "calls") else ""
    for col in ("flops", "bytes", "calls"):
        frame[col] = frame[col].astype("int64")
    extra = [c for c in frame.columns if c not in COLUMNS]
    return frame[COLUMNS + extra].reset_index(drop=True)


@pytest.mark.parametrize("case", ["plain", "empty", "extra column", "other order", "float", "bool", "object"])
def test_the_report_frame_is_the_same_whichever_way_it_is_built(case):
    rows = _rows()
    if case == "empty":
        rows = []
    elif case == "extra column":
        rows[2]["seconds"] = 0.5
    elif case == "other order":
        rows[3] = dict(reversed(list(rows[3].items())))
    elif case == "float":
        rows[1]["flops"] = 3.0
    elif case == "bool":
        rows[1]["calls"] = True
    elif case == "object":
        rows[4]["module"] = None
    columnwise = _frame_of_columns(rows)
    assert (columnwise is not None) == (case in ("plain", "other order"))
    try:
        expected = _as_before(rows)
    except (TypeError, ValueError):  # a frame the report never took: it must refuse it the same way
        with pytest.raises((TypeError, ValueError)):
            FlopReport.from_rows(rows)
        return
    pd.testing.assert_frame_equal(FlopReport.from_rows(rows).frame, expected)


def test_a_report_made_from_a_frame_in_order_is_a_copy_of_it():
    frame = FlopReport.from_rows(_rows()).frame
    report = FlopReport(frame=frame)
    assert report.frame is not frame
    pd.testing.assert_frame_equal(report.frame, frame)
    report.frame.loc[0, "flops"] = 99
    assert frame.loc[0, "flops"] == 0


def _layouts():
    base = torch.empty(4, 3, 5, 6)
    return {
        "contiguous": base,
        "channels last": base.to(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "size-1 dims": torch.empty(3, 1, 1).as_strided((3, 1, 1), (1, 7, 9)),
        "expanded": torch.empty(3, 1).expand(3, 4),
        "sliced": base[:, :, ::2],
        "parameter": torch.nn.Parameter(torch.empty(8, 2).t()),
        "half": torch.empty(2, 3, dtype=torch.float16),
    }


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", list(_layouts()))
def test_a_meta_stand_in_is_what_empty_like_makes(name, device, monkeypatch):
    from flopcount.counting import stand_ins

    t = _layouts()[name].to(device) if name != "parameter" or device == "cpu" else \
        torch.nn.Parameter(_layouts()[name].detach().to(device))
    made = []
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: made.append(1) or real(*a, **k))
    monkeypatch.setattr(stand_ins, "_STRIDES", {})
    expected = real(t, device="meta")
    for _ in range(3):
        got = stand_ins.empty_meta(t)
        assert (got.shape, got.stride(), got.dtype, got.device, got.storage_offset(), type(got)) == \
            (expected.shape, expected.stride(), expected.dtype, expected.device, expected.storage_offset(),
             type(expected))
    assert len(made) == 1  # once per kind of tensor, not once per stand-in
