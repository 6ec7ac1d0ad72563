"""Early checks through ``main()``: an output that cannot be written and a ``--plot`` without matplotlib are one
line and exit 2 before torch is imported or any work is done (the checks run while the command line is parsed)."""
import os
import subprocess
import sys

import pytest

from flopcount.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(argv, block=()):
    """main(argv) in a fresh interpreter (``block``: modules made unimportable): its exit code, stderr, and whether
    torch was imported by then."""
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in block)
            + "from flopcount.cli import main\n"
            + f"rc = main({argv!r})\n"
            + "print(rc, 'torch' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    rc, torch_loaded = p.stdout.split()[-2:]
    return int(rc), p.stderr.strip(), torch_loaded == "True"


def test_plot_without_matplotlib_is_refused_before_any_work(tmp_path):
    rc, err, torch_loaded = _run(["roofline", "resnet18", "--device-spec", "H100 SXM", "--plot",
                                  str(tmp_path / "r.png")], block=("matplotlib",))
    assert rc == 2 and not torch_loaded
    assert err.startswith("flopcount: error:") and "\n" not in err
    assert 'pip install "flopcount[plot]"' in err
    assert not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("argv", [
    ["roofline", "resnet18", "--device-spec", "H100 SXM", "--plot", "{file}/r.png"],
    ["compare", "resnet18", "--plot", "{file}/deeper/c.png"],
    ["study", "--quick", "--out", "{file}/results"],
    ["capture", "resnet18", "--kineto", "--out", "{file}/run"],
])
def test_an_output_under_a_file_is_refused_before_any_work(tmp_path, argv):
    (tmp_path / "notes.txt").write_text("kept")
    argv = [a.replace("{file}", str(tmp_path / "notes.txt")) for a in argv]
    rc, err, torch_loaded = _run(argv)
    assert rc == 2 and not torch_loaded, err
    assert "notes.txt is not a folder" in err and "\n" not in err
    assert (tmp_path / "notes.txt").read_text() == "kept"  # nothing already there is lost


def test_a_study_folder_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "results").write_text("kept")
    assert cli(["study", "--quick", "--out", str(tmp_path / "results")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert (tmp_path / "results").read_text() == "kept"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to any folder")
def test_a_read_only_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert cli(["study", "--quick", "--out", str(folder / "results")]) == 2
        assert "is not writable" in capsys.readouterr().err
    finally:
        folder.chmod(0o755)
