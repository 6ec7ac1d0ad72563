"""Bad input, round two, outside the profile readers: output paths that are not files, hf: configs no real run
accepts, the Python API's arguments, the command's own streams. One line, exit 2 (or a note and the right
figure), nothing outside the output path touched, the caller's objects unchanged."""
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

import flopcount
from flopcount.cli import main
from helpers import one_error_line, run_cli as run
from flopcount.base.errors import FlopcountError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GPT2 = os.path.join(HERE, "fixtures", "hf", "gpt2-tiny", "config.json")
LLAMA = os.path.join(HERE, "fixtures", "hf", "llama-gqa-tiny", "config.json")


def cli(*argv, env=None, **kw):
    """``python -m flopcount argv`` with this checkout first on the path."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "flopcount", *argv], env=env, timeout=300, **kw)


MLP = ("import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(),"
       " torch.nn.Linear(20, 3))\n")
BROKEN = ("import torch\n\nclass Broken(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
          "        self.fc = torch.nn.Linear(10, 3)\n\n    def forward(self, x):\n        return self.fc(x) + None\n\n"
          "def build():\n    return Broken()\n")
WARNS = ("import warnings\nimport torch\n\nclass Talks(torch.nn.Linear):\n    def forward(self, x):\n"
         "        warnings.warn('a remark of the model\\nwith a second line', UserWarning)\n"
         "        return super().forward(x)\n\ndef build():\n    return Talks(10, 3)\n")


@pytest.fixture
def model_file(tmp_path):
    def make(text=MLP, name="mlp.py"):
        path = tmp_path / name
        path.write_text(text)
        return f"{path}:build"
    return make


# --- outputs go only to a regular file or a new path --------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["roofline", "alexnet", "--device-spec", "P100 PCIe"],
    ["compare", "alexnet", "--estimators", "dispatch"],
])
def test_a_named_pipe_given_as_the_figure_is_refused_and_left_a_pipe(tmp_path, capsys, argv):
    pipe = tmp_path / "figure.png"
    os.mkfifo(pipe)
    code, out, err = run(capsys, *argv, "--plot", str(pipe))
    assert code == 2
    one_error_line(err, "is a named pipe (FIFO)")
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)


def test_a_named_pipe_given_as_the_kineto_capture_is_refused_before_recording(tmp_path, capsys, model_file):
    pipe = tmp_path / "run.json.gz"
    os.mkfifo(pipe)
    code, out, err = run(capsys, "capture", model_file(), "--input-shape", "10", "--kineto", "--out", str(pipe))
    assert code == 2
    one_error_line(err, "is a named pipe (FIFO): a trace is written only to a regular file or a new path")
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)


def test_the_one_writer_refuses_anything_but_a_file_or_a_new_path(tmp_path):
    from flopcount.base.errors import OutputError
    from flopcount.base.outputs import check_output
    from flopcount.base.outputs import atomic_write

    # a character device: the decision reads its stat and never opens it
    with pytest.raises(OutputError, match="is a character device"):
        check_output(os.devnull)
    with pytest.raises(OutputError, match="is a directory"):
        atomic_write(str(tmp_path), "x")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(OutputError, match="named pipe"):
        atomic_write(str(pipe), "x")
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode) and sorted(os.listdir(tmp_path)) == ["pipe"]  # no temporary left
    atomic_write(str(tmp_path / "new.txt"), "new")
    atomic_write(str(tmp_path / "new.txt"), "again")
    assert (tmp_path / "new.txt").read_text() == "again"


# --- silent wrong elsewhere ----------------------------------------------------------------------------------------
def test_a_peak_below_any_device_is_refused(capsys, model_file):
    code, out, err = run(capsys, "utilization", model_file(), "--input-shape", "10", "--batch", "2",
                         "--peak", "1e-30", "--steps", "1", "--warmup", "0")
    assert code == 2
    one_error_line(err, "below any device that runs PyTorch")
    from flopcount.study import StudyConfig, StudyError

    with pytest.raises(StudyError, match="below any device"):
        StudyConfig(models=("m1",), batch_sizes=(1,), peak=1e-30).validate()


def test_an_unknown_study_estimator_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    import flopcount.study.grid as grid

    monkeypatch.setattr(grid, "make_dataset", lambda *a, **k: pytest.fail("the study started"))
    code, out, err = run(capsys, "study", "--estimators", "bogus", "--out", str(tmp_path / "s"))
    assert code == 2
    one_error_line(err, "unknown estimator(s) bogus")
    assert not (tmp_path / "s").exists() or not os.listdir(tmp_path / "s")


def write_config(tmp_path, base, **changes):
    with open(base) as fh:
        config = json.load(fh)
    config.update(changes)
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return f"hf:{folder}"


@pytest.mark.parametrize("base, changes, fragment", [
    (GPT2, dict(architectures=["GPT2FooModel"]), "names the architecture 'GPT2FooModel', which transformers"),
    (GPT2, dict(n_positions=0), "n_positions is 0; it must be at least 1"),
    (GPT2, dict(vocab_size=0), "vocab_size is 0; it must be at least 1"),
    (LLAMA, dict(num_attention_heads=4, num_key_value_heads=3),
     "num_key_value_heads is 3, which does not divide the 4"),
    (GPT2, dict(n_layer=1_000_000), "n_layer is 1,000,000: past 10,000 layers"),
    (GPT2, dict(n_embd=10 ** 7, n_head=1), "parameters, past the"),
])
def test_a_config_no_real_run_accepts_is_one_line_before_building(tmp_path, capsys, monkeypatch, base, changes,
                                                                  fragment):
    pytest.importorskip("transformers")
    import transformers

    # bounded work: the refusal comes from the config alone, before any model class is built
    monkeypatch.setattr(transformers.AutoModel, "from_config",
                        classmethod(lambda *a, **k: pytest.fail("built the model")))
    monkeypatch.setattr(transformers.PreTrainedModel, "_from_config",
                        classmethod(lambda *a, **k: pytest.fail("built the model")))
    code, out, err = run(capsys, "count", write_config(tmp_path, base, **changes))
    assert code == 2
    one_error_line(err, fragment)


def test_on_meta_inputs_a_real_run_rejects_are_rejected():
    model = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for x in (torch.randn(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.long)):
        with pytest.raises(RuntimeError) as real:
            model(x)
        with pytest.raises(RuntimeError, match="operands of different dtypes"):
            flopcount.count(model, x)
        assert "dtype" in str(real.value) or "type" in str(real.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts first: a mixed call is fine there
        assert flopcount.count(model, torch.randn(2, 4)).total("forward") > 0


def test_a_loss_that_is_not_a_tensor_is_refused():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(FlopcountError, match="loss_fn returned 'loss', not a tensor"):
        flopcount.count(model, torch.randn(2, 4), loss_fn=lambda out: "loss")
    with pytest.raises(FlopcountError, match="not a tensor"):
        flopcount.utilization(model, torch.randn(2, 4), loss_fn=lambda out: 3, peak=1e9, steps=1, warmup=0)


def test_annotate_blocks_exited_out_of_order_leave_backward_as_it_was():
    from flopcount.recording.nvtx import annotate
    from test_annotate import Recorder

    original = torch.autograd.backward
    model = torch.nn.Linear(3, 2)
    first, second = annotate(model, domain=Recorder()), annotate(model, domain=Recorder())
    first.__enter__()
    second.__enter__()
    assert torch.autograd.backward is not original
    first.__exit__(None, None, None)  # out of order
    model(torch.randn(2, 3)).sum().backward()  # still works between the two exits
    second.__exit__(None, None, None)
    assert torch.autograd.backward is original


# --- the user's fault is the user's ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["utilization", "--batch", "2", "--steps", "1", "--warmup", "0", "--peak", "1e9"],
    ["capture", "--kineto"],
])
def test_the_models_own_error_names_the_model(tmp_path, capsys, model_file, argv):
    spec = model_file(BROKEN, "broken.py")
    code, out, err = run(capsys, argv[0], spec, "--input-shape", "10", *argv[1:],
                         *(["--out", str(tmp_path / "run")] if argv[0] == "capture" else []))
    assert code == 2
    one_error_line(err, "failed: TypeError: unsupported operand type(s) for +")
    assert "broken.py:build" in err[0] or "running build" in err[0]
    assert not list(tmp_path.glob("run*"))


def test_a_capture_on_the_cpu_prints_only_its_path(tmp_path, capfd, model_file):
    out = tmp_path / "run"
    code = main(["capture", model_file(), "--input-shape", "10", "--kineto", "--out", str(out)])
    captured = capfd.readouterr()
    assert code == 0 and captured.out.strip() == f"{out}.json.gz"
    assert captured.err == "", captured.err  # Kineto's start/stop probes and its device-count error stay out


def test_a_closed_stdout_is_one_line():
    res = cli("peaks", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
              preexec_fn=lambda: os.close(1))
    assert res.returncode == 2
    one_error_line(res.stderr.strip().splitlines(), "standard output is closed")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stderr_keeps_the_exit_code(model_file):
    with open("/dev/full", "w") as full:  # opened for writing by the child's stderr only; never replaced
        bad = cli("count", "no_such_model_name", stdout=subprocess.PIPE, stderr=full, text=True)
        good = cli("peaks", stdout=subprocess.PIPE, stderr=full, text=True)
    assert bad.returncode == 2 and good.returncode == 0 and "A100" in good.stdout


def test_a_model_warning_is_one_line(capsys, model_file):
    code, out, err = run(capsys, "count", model_file(WARNS, "talks.py"), "--input-shape", "10")
    assert code == 0
    assert err == ["flopcount: warning: a remark of the model"], err


def test_a_missing_local_path_is_refused_at_once(capsys, monkeypatch):
    pytest.importorskip("transformers")
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("asked the hub")))
    for spec in ("hf:no/such/dir", "hf:./nothing", "hf:/no/such/dir"):
        code, out, err = run(capsys, "count", spec)
        assert code == 2
        one_error_line(err, "no such directory")


def test_a_hub_id_offline_is_one_line():
    pytest.importorskip("transformers")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = cli("count", "hf:no-such-org/no-such-model", env=env, capture_output=True, text=True)
    assert res.returncode == 2
    one_error_line(res.stderr.strip().splitlines(),
                   "cannot read the transformers config of 'no-such-org/no-such-model'")


def test_ctrl_c_while_torch_imports_is_one_line(tmp_path):
    script = tmp_path / "ctrl_c.py"
    script.write_text(
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['/usr/bin/flopcount', 'count', 'resnet18']\n"
        "from flopcount.cli import main\n"
        "sys.exit(main())\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 130 and res.stderr.strip() == "flopcount: interrupted", res.stderr


def test_ctrl_c_while_reading_a_profile_says_so(capsys, monkeypatch):
    pytest.importorskip("pyarrow")
    pytest.importorskip("adbc_driver_sqlite")
    import flopcount.profiles.nsys_export as nsys

    def interrupted(*a, **k):  # while the kernels are read on the second thread
        raise KeyboardInterrupt

    monkeypatch.setattr(nsys, "_read_ranges", interrupted)
    path = os.path.join(HERE, "fixtures", "nsys", "mfu_2gpu_before.sqlite")
    code, out, err = run(capsys, "nsys", path)
    assert code == 130 and err == ["flopcount: interrupted"]


# --- the Python API -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, fragment", [
    (lambda m, x: flopcount.count(lambda t: t, x), "model must be a torch.nn.Module, not function"),
    (lambda m, x: flopcount.count(torch.jit.script(torch.nn.Sequential(m)), x), "torch.jit.script module"),
    (lambda m, x: flopcount.count(m, x, optimizer="sgd"), "optimizer must be a torch.optim.Optimizer"),
    (lambda m, x: flopcount.count(torch.nn.Linear(4, 3, device="meta"), x, device="cpu"), "weights are on meta"),
    (lambda m, x: flopcount.utilization(m, x, steps=2.5, peak=1e9), "steps must be an integer, not 2.5"),
    (lambda m, x: flopcount.utilization(torch.nn.ReLU(), x, peak=1e9), "has no trainable parameters"),
    (lambda m, x: flopcount.utilization(m, x, optimizer="sgd", peak=1e9), "optimizer must be"),
    (lambda m, x: flopcount.utilization(7, x, peak=1e9), "model must be a torch.nn.Module, not int"),
])
def test_a_wrong_argument_is_one_flopcount_error(call, fragment):
    model = torch.nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FlopcountError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        call(model, torch.randn(2, 4))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_annotate_checks_its_arguments():
    from flopcount.recording.nvtx import annotate
    from test_annotate import Recorder

    with pytest.raises(FlopcountError, match="annotate's model must be a torch.nn.Module, not int"):
        annotate(5, domain=Recorder())
    with pytest.raises(FlopcountError, match="domain must be a name or an nvtx domain object, not 5"):
        annotate(torch.nn.Linear(2, 2), domain=5)
