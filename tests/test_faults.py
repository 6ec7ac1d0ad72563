"""Bad input and faults through the CLI: one line on stderr, a non-zero exit, nothing already written lost."""
import os

import pytest

from flopcount.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def one_error_line(err, fragment):
    assert len(err) == 1 and err[0].startswith("flopcount: error:") and fragment in err[0], err
    assert "Traceback" not in err[0]


def test_a_figure_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    from flopcount import plots

    victim = tmp_path / "elsewhere.txt"
    victim.write_text("keep me")
    link = tmp_path / "figure.png"
    link.symlink_to(victim)
    plt = plots._pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    plots._save(fig, str(link), plt)
    assert victim.read_text() == "keep me"
    assert not link.is_symlink() and link.read_bytes()[:4] == b"\x89PNG"


def test_an_unwritable_figure_is_one_line_after_the_table_is_printed(tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):  # root writes anywhere: a path under a file cannot be written by anyone
        target = str(tmp_path / "file.txt" / "roof.png")
        (tmp_path / "file.txt").write_text("")
    else:
        target = str(folder / "roof.png")
    code, out, err = run(capsys, "roofline", "alexnet", "--device-spec", "P100 PCIe", "--plot", target)
    assert code == 2 and "utilization ceiling" in out  # what was computed is printed first
    one_error_line(err, "cannot write the figure")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_on_stdout_is_one_line(capfd):
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "flopcount", "peaks"], stdout=full, stderr=subprocess.PIPE,
                             text=True)
    assert out.returncode == 2
    one_error_line(out.stderr.strip().splitlines(), "cannot write the output")


def test_a_batch_too_large_for_memory_is_an_out_of_memory_line(capsys):
    code, out, err = run(capsys, "compare", "resnet18", "--batch", "1000000", "--estimators", "fvcore")
    assert code == 2
    one_error_line(err, "out of memory in making a batch of 1000000 inputs")


def test_a_peer_estimator_runs_from_count_on_real_weights(capsys):
    code, out, err = run(capsys, "count", "alexnet", "--estimator", "fvcore", "--format", "json")
    assert code == 0, err
    import json

    doc = json.loads(out)
    assert doc["estimator"] == "fvcore" and doc["flops"]["forward"] > 0
