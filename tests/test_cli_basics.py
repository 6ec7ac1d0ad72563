"""What a new user meets first on the command line: --version, defaults in --help, and progress bars that are
drawn on a terminal's stderr only, never into json or csv and never with --no-progress."""
from __future__ import annotations

import io
import sys

import pytest

from flopcount.base import progress
from flopcount.cli import main
from flopcount.cli.main import COMMANDS, build_parser


def test_version(capsys):
    import flopcount

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"flopcount {flopcount.__version__}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_no_progress(command):
    parser = build_parser()
    needs = {"count": ["resnet18"], "compare": ["resnet18"], "utilization": ["resnet18"], "roofline": ["resnet18"],
             "overhead": ["resnet18"], "nsys": ["x.sqlite"], "trace": ["x.json"], "capture": ["x.py"],
             "peaks": [], "study": [], "infer": ["resnet18"], "predict": ["resnet18", "--device-spec", "H100 SXM"]}
    args = parser.parse_args([command] + needs.get(command, []) + ["--no-progress"])
    assert args.no_progress is True


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["count", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "batch size (default: 1)" in text and "(default: dispatch)" in text


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_is_drawn_on_a_terminal_only_and_never_with_no_progress(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert progress.shown()
    list(progress.bar(range(3), desc="work"))
    assert "work" in terminal.getvalue()
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    list(progress.bar(range(3), desc="work", wanted=False))
    assert quiet.getvalue() == ""
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    assert not progress.shown()
    list(progress.bar(range(3), desc="work"))
    assert piped.getvalue() == ""


def test_compare_draws_its_bar_on_stderr_and_keeps_json_clean(tmp_path, monkeypatch, capsys):
    import json

    path = tmp_path / "mlp.py"
    path.write_text("import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, 3))\n")
    monkeypatch.setattr(progress, "shown", lambda wanted=True: bool(wanted))  # as on a terminal
    assert main(["compare", f"{path}:build", "--input-shape", "4", "--estimators", "fvcore", "--format",
                 "json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert "estimators" in err
    assert main(["compare", f"{path}:build", "--input-shape", "4", "--estimators", "fvcore", "--no-progress"]) == 0
    assert "estimators" not in capsys.readouterr().err


def test_count_shows_the_ops_it_has_seen_on_a_terminal_and_nothing_with_no_progress(monkeypatch, capsys):
    monkeypatch.setattr(progress, "shown", lambda wanted=True: bool(wanted))  # as on a terminal
    assert main(["count", "resnet18", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert "counting resnet18" in err and "op" in err
    import json

    json.loads(out)  # stdout untouched
    assert main(["count", "resnet18", "--no-progress"]) == 0
    assert "counting" not in capsys.readouterr().err
    progress.tick()  # outside a count: nothing to tick, no error
