"""compare's reasons say where each side counted an op, when the two file it on different rows."""
import pytest
import torch
from torch import nn

import flopcount


class WindowAttention(nn.Module):
    """Its bmm is 'attention' for dispatch (by the module that ran it); the profiler puts every op at the root."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x)
        return torch.bmm(q, q.transpose(1, 2)).softmax(-1) @ q


def _reasons(table, op, phase):
    row = table[(table["op"] == op) & (table["phase"] == phase)]
    return " ".join(row["reason"])


def test_bmm_under_attention_is_said_to_be_counted_there():
    table = flopcount.compare(nn.Sequential(WindowAttention()), torch.randn(2, 4, 8), estimators=("profiler",))
    text = _reasons(table, "matmul", "forward")
    assert "dispatch counts the same ops (aten.bmm under 'attention')" in text and "as 0" not in text
    assert "aten.bmm under 'matmul'" in _reasons(table, "attention", "forward")


@pytest.mark.slow
def test_swin_t_reasons_are_true():
    model, _ = flopcount.model.specs.load_model("swin_t")
    table = flopcount.compare(model, torch.randn(1, 3, 224, 224), estimators=("profiler",))
    for phase in ("forward", "backward"):
        text = _reasons(table, "matmul", phase)
        assert "aten.bmm under 'attention'" in text
        assert "counted as 0" not in text and "counts these ops as 0" not in text
