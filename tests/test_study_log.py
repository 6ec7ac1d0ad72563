"""``flopcount study`` through ``main()`` on a fake backend: a line per row on stderr when stderr is no terminal,
and REPORT.md after every model, so a run stopped halfway leaves a report of the rows it wrote."""
import pandas as pd
import pytest

from flopcount import cli
from flopcount.study import grid
from test_study import PEAK, FakeBackend

ARGS = ["study", "--models", "m1,m2", "--batch-sizes", "1,4", "--images", "6", "--no-figures"]


class CliBackend(FakeBackend):
    """The fake backend as the CLI builds its backend: from the config."""

    stop_at = None  # the backend call that Ctrl-C interrupts

    def __init__(self, config):
        super().__init__(fail={CliBackend.stop_at: KeyboardInterrupt()} if CliBackend.stop_at else None)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(grid, "TorchBackend", CliBackend)
    monkeypatch.setattr(CliBackend, "stop_at", None)
    return CliBackend


def test_piped_run_prints_a_line_per_row(tmp_path, capsys, fake):
    assert cli.main(ARGS + ["--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err.splitlines()
    rows = [line for line in err if line.startswith("[")]
    assert len(rows) == 22  # 2 models x (2 dispatch + 2 fvcore + one + 2 x (theory, batch, epoch))
    assert rows[0].startswith("[1/22] m1 b=1 dispatch: ")
    # the batch row of m1 at batch 4: (520 + 600) FLOPs over 0.5 s x 4, against the fake peak
    batch4 = next(line for line in rows if " m1 b=4 batch:" in line)
    assert f"utilization {1120 / 2.0 / PEAK:.3g}" in batch4 and "s elapsed)" in batch4


def test_no_progress_means_no_lines(tmp_path, capsys, fake):
    assert cli.main(ARGS + ["--out", str(tmp_path), "--no-progress"]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]


def test_stopped_run_leaves_a_report_of_its_rows(tmp_path, capsys, fake):
    fake.stop_at = ("count", "m2", 1)  # m1's 11 rows finish, then m2's first count is interrupted
    assert cli.main([a for a in ARGS if a != "--no-figures"] + ["--out", str(tmp_path)]) == 130
    # the figures of m1's rows were drawn when its last row was written; the roofline is left for the end
    assert (tmp_path / "figures" / "utilization.png").stat().st_size > 1000
    assert not (tmp_path / "figures" / "roofline.png").exists()
    written = pd.read_csv(tmp_path / "results.csv")
    assert set(written["model"]) == {"m1"} and len(written) == 11
    report = (tmp_path / "REPORT.md").read_text()
    assert "## 4. Utilization" in report and "| m1 " in report and "| m2 " not in report


def test_stopped_within_the_first_model_still_reports(tmp_path, capsys, fake):
    fake.stop_at = ("count", "m1", 4)  # after m1's two counts at batch 1
    assert cli.main(ARGS + ["--out", str(tmp_path)]) == 130
    assert len(pd.read_csv(tmp_path / "results.csv")) == 2
    assert "| m1 " in (tmp_path / "REPORT.md").read_text()
