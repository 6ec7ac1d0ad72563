"""Bad input, round three: an hf: folder's code never runs, no size or degree starts work that cannot end, no
measured rate past the device's datasheet, the profile readers' last internal errors, and one convention for the
recurrent cell on every device. One line and exit 2 (or the right figure with a note), nothing left behind."""
import gzip
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys

import pytest
import torch
from torch import nn

import flopcount
from flopcount.cli import main
from flopcount.base.errors import FlopcountError
from helpers import ROOT, op_flops, one_error_line, run_cli as run

HERE = os.path.dirname(os.path.abspath(__file__))
HF = os.path.join(HERE, "fixtures", "hf")
GPT2, LLAMA = os.path.join(HF, "gpt2-tiny"), os.path.join(HF, "llama-gqa-tiny")
MI250 = os.path.join(HERE, "fixtures", "kineto", "mi250_minitoy_train.json.gz")
REAL_NSYS = os.path.join(HERE, "fixtures", "nsys", "mfu_2gpu_before.sqlite")


def cli(*argv, env=None, **kw):
    """``python -m flopcount argv`` in a child process, with this checkout first on the path."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "flopcount", *argv], env=env, timeout=120, capture_output=True,
                          text=True, **kw)


# --- an hf: folder's own code never runs --------------------------------------------------------------------------
RUNS_CODE = ("import os\nopen(os.path.join(os.path.dirname(__file__), 'RAN'), 'w').write('the folder ran code')\n"
             "from transformers import PretrainedConfig\n\nclass EvilConfig(PretrainedConfig):\n"
             "    model_type = 'evil'\n")


def code_folder(tmp_path, model_type="evil"):
    folder = tmp_path / "custom"
    folder.mkdir()
    config = {"model_type": model_type, "vocab_size": 16, "hidden_size": 8, "architectures": ["EvilModel"],
              "auto_map": {"AutoConfig": "configuration_evil.EvilConfig", "AutoModel": "modeling_evil.EvilModel"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_evil.py").write_text(RUNS_CODE)
    (folder / "modeling_evil.py").write_text(RUNS_CODE)
    return folder


def test_a_folder_that_asks_to_run_its_code_is_refused_and_its_code_never_runs(tmp_path):
    pytest.importorskip("transformers")
    folder = code_folder(tmp_path)
    # "y" on stdin is what transformers' prompt takes as consent to run the folder's Python
    res = cli("count", f"hf:{folder}", "--format", "json", input="y\ny\ny\n")
    assert res.returncode == 2 and res.stdout == ""  # no prompt on stdout, even under --format json
    one_error_line(res.stderr.strip().splitlines(), "auto_map AutoConfig: 'configuration_evil.EvilConfig'")
    assert not (folder / "RAN").exists()


@pytest.mark.parametrize("model_type", ["evil", "gpt2"])
def test_the_api_refuses_a_folder_with_code_too(tmp_path, monkeypatch, model_type):
    pytest.importorskip("transformers")
    from flopcount.model.specs import load_model

    folder = code_folder(tmp_path, model_type)
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("y\n" * 3))
    with pytest.raises(FlopcountError, match="asks to run its own code"):
        load_model(f"hf:{folder}", device="meta")
    assert not (folder / "RAN").exists()


def test_a_missing_folder_named_like_a_hub_id_is_one_line_before_torch_and_never_asks_the_hub(tmp_path):
    # the hub unreachable (a closed local port), and torch and transformers unimportable: the refusal comes first
    script = tmp_path / "no_torch.py"
    script.write_text(
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ImportError(f'{name} imported')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "sys.argv = ['flopcount', 'count', 'hf:my-model-folder', '--format', 'json']\n"
        "from flopcount.cli import main\n"
        "sys.exit(main())\n")
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("HF_", "TRANSF"))}
    env.update(PYTHONPATH=ROOT, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf-home"))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == ""
    one_error_line(res.stderr.strip().splitlines(), "'my-model-folder': no such directory here, and the hub cannot "
                                                    "be reached")


# --- sizes and degrees bounded before any work ----------------------------------------------------------------------
@pytest.fixture
def never_sharded(monkeypatch):
    import flopcount.distributed.sharded as sharded

    monkeypatch.setattr(sharded, "fake_world", lambda *a, **k: pytest.fail("started sharding"))


def test_an_fsdp_degree_past_the_model_is_refused_before_sharding(capsys, never_sharded):
    pytest.importorskip("transformers")
    # gpt2-tiny's largest parameter is the 512-row token embedding
    code, out, err = run(capsys, "count", f"hf:{GPT2}", "--fsdp", "1000000")
    assert code == 2
    one_error_line(err, "FSDP 1,000,000 is more ranks than the largest parameter has rows "
                        "(transformer.wte.weight: 512)")
    code, out, err = run(capsys, "count", f"hf:{GPT2}", "--tp", "1000000")
    assert code == 2
    one_error_line(err, "tensor parallel 1000000 does not divide the model's num_attention_heads (4)")


def test_world_in_python_is_bounded_by_the_model(never_sharded):
    from flopcount.distributed import UnsupportedLayout

    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(UnsupportedLayout, match="largest parameter has rows"):
        flopcount.count(mlp, torch.randn(2, 8), world=10 ** 6)
    with pytest.raises(UnsupportedLayout, match="a world of 1,000,000,000,000 ranks"):
        flopcount.count(mlp, torch.randn(2, 8), world={"tp": 10 ** 12})
    with pytest.raises(UnsupportedLayout, match="tensor parallel 32 splits no layer of Sequential"):
        flopcount.count(mlp, torch.randn(2, 8), world={"tp": 32})
    # 600 parameter tensors of 5,000 rows: FSDP 5,000 would set up 3,000,000 shards
    with torch.device("meta"):
        stack = nn.Sequential(*[nn.Linear(4, 5000) for _ in range(300)])
    with pytest.raises(UnsupportedLayout, match="3,000,000 shards to set up"):
        flopcount.count(stack, torch.randn(2, 4, device="meta"), world=5000)


def test_infer_sizes_past_a_tensors_index_are_refused_before_the_model_is_built(capsys, monkeypatch):
    import flopcount.model.specs as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("built the model"))
    for flag, value in (("--batch", 10 ** 20), ("--prompt", 10 ** 20), ("--new", 10 ** 19)):
        args = {"--batch": "1", "--prompt": "8", "--new": "2", flag: str(value)}
        code, out, err = run(capsys, "infer", f"hf:{LLAMA}", *[x for kv in args.items() for x in kv])
        assert code == 2
        one_error_line(err, "past what a tensor can index")


def test_a_count_past_int64_flops_is_refused_not_blamed_on_the_model(capsys, tmp_path):
    # Linear(10, 3) at batch 2e17: the input is 8e18 bytes (a tensor holds it), the forward (2 x 30 + 3) x 2e17 =
    # 1.26e19 FLOPs, past 2**63 - 1 (9.2e18); a batch whose input no tensor holds is refused as such
    path = tmp_path / "lin.py"
    path.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(10, 3)\n")
    code, out, err = run(capsys, "count", f"{path}:build", "--input-shape", "10", "--batch", str(2 * 10 ** 17))
    assert code == 2
    one_error_line(err, "pass 2**63")
    code, out, err = run(capsys, "count", f"{path}:build", "--input-shape", "10", "--batch", str(3 * 10 ** 17))
    assert code == 2
    one_error_line(err, "more than a tensor can hold")


def test_a_named_pipe_at_the_cpu_peak_cache_is_not_opened(tmp_path):
    os.mkfifo(tmp_path / "cpu_peaks.json")
    res = cli("peaks", env=dict(os.environ, FLOPCOUNT_CACHE_DIR=str(tmp_path)))  # a blocked open times out here
    assert res.returncode == 0 and "A100" in res.stdout
    assert stat.S_ISFIFO(os.lstat(tmp_path / "cpu_peaks.json").st_mode)


# --- the Python API of a generation -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from flopcount.model.specs import load_model

    return load_model(f"hf:{LLAMA}", device="meta", train=False)[0]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(device="tpu"), "device must be a device of type meta, cpu, not 'tpu'"),
    (dict(progress=5), "progress must be callable"),
    (dict(seed="x"), "seed must be an integer, not 'x'"),
    (dict(as_device="tpu"), "as_device must be one of 'cpu', 'cuda'"),
    (dict(remember="yes"), "remember must be True or False"),
])
def test_generate_cost_checks_its_arguments(llama, kwargs, fragment):
    from flopcount.analyses.infer import generate_cost

    with pytest.raises(FlopcountError, match=fragment):
        generate_cost(llama, 8, 2, **kwargs)


def test_a_generations_on_checks_its_arguments_and_refuses_rates_past_the_device(llama):
    from flopcount.analyses.infer import generate_cost

    gen = generate_cost(llama, 8, 2)
    with pytest.raises(FlopcountError, match="measured_tokens_per_s must be a number, not '100'"):
        gen.on("H100 SXM", measured_tokens_per_s="100")
    with pytest.raises(FlopcountError, match="spec must be a DeviceSpec"):
        gen.on(5)
    # the decode step's FLOPs over the H100's dense bf16/fp32 peak bounds the rate from above: 1e30 tokens/s is not
    # a rate any device runs, and neither is a prefill in a femtosecond
    with pytest.raises(FlopcountError, match=r"puts decode at MFU [0-9.e+]+ and MBU [0-9.e+]+: past 1"):
        gen.on("H100 SXM", measured_tokens_per_s=1e30)
    with pytest.raises(FlopcountError, match=r"puts prefill at MFU"):
        gen.on("H100 SXM", measured_ttft=1e-15)
    pred = gen.on("H100 SXM", measured_tokens_per_s=100.0)
    assert 0 < pred.phases["decode"].mfu < 1 and 0 < pred.phases["decode"].mbu < 1


def test_infer_refuses_a_measured_rate_past_the_device(capsys):
    pytest.importorskip("transformers")
    for flag, value in (("--measured-tokens-per-s", "1e30"), ("--measured-ttft", "1e-15")):
        code, out, err = run(capsys, "infer", f"hf:{LLAMA}", "--prompt", "8", "--new", "2", "--device-spec",
                             "H100 SXM", flag, value, "--format", "json")
        assert code == 2 and out == ""
        one_error_line(err, "past 1, faster than H100 SXM's datasheet peak and bandwidth allow")


# --- the profile readers --------------------------------------------------------------------------------------------
def test_compare_inductor_reads_a_bare_event_list_as_the_document(tmp_path, capsys):
    pytest.importorskip("torch._inductor.analysis.profile_analysis")
    with gzip.open(MI250) as fh:
        events = json.load(fh)["traceEvents"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(events))
    docs = []
    for path in (MI250, str(bare)):
        code, out, err = run(capsys, "trace", path, "--compare-inductor", "--format", "json")
        assert code == 0, err
        docs.append(json.loads(out)["rows"])
    assert docs[0] == docs[1] and docs[0]


def test_a_backward_op_whose_forward_has_junk_dims_is_still_priced(tmp_path, capsys):
    with gzip.open(MI250) as fh:
        doc = json.load(fh)
    junk = 0
    for e in doc["traceEvents"]:
        a = e.get("args") if isinstance(e, dict) else None
        if isinstance(a, dict) and "Input Dims" in a and "Sequence number" in a and "backward" not in e["name"].lower() \
                and "autograd" not in e["name"].lower():
            a["Input Dims"] = "junk"
            junk += 1
    assert junk
    path = tmp_path / "junk.json"
    path.write_text(json.dumps(doc))
    code, out, err = run(capsys, "trace", str(path), "--format", "json")
    assert code == 0, err
    ref_code, ref, _ = run(capsys, "trace", MI250, "--format", "json")
    got, ref = json.loads(out), json.loads(ref)
    # the forward ops lost their sizes (not priced, said), the backward ops kept theirs and are priced as before
    assert got["flops"]["forward"] == 0 and got["flops"]["backward"] == ref["flops"]["backward"] > 0
    assert any("no sizes in marker" in n for n in got["notes"])


def test_junk_sizes_of_a_backward_node_leave_its_op_underived(tmp_path, capsys):
    with gzip.open(MI250) as fh:
        doc = json.load(fh)
    for e in doc["traceEvents"]:  # an autograd node's sizes are its forward op's output: here nested one level too deep
        a = e.get("args") if isinstance(e, dict) else None
        if isinstance(a, dict) and "Input Dims" in a and "Backward" in e.get("name", ""):
            a["Input Dims"] = [[[2, 3]]] * len(a["Input Dims"])
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(doc))
    code, out, err = run(capsys, "trace", str(path), "--format", "json")
    assert code == 0, err
    assert any("malformed sizes" in n for n in json.loads(out)["notes"])


@pytest.mark.skipif(not os.path.exists(REAL_NSYS), reason="real nsys fixture missing")
@pytest.mark.parametrize("value", ["'junk'", "X'00ff'"])
def test_nsys_by_module_with_junk_threads_is_one_line(tmp_path, capsys, value):
    pytest.importorskip("adbc_driver_sqlite")
    path = str(tmp_path / "junk.sqlite")
    shutil.copy(REAL_NSYS, path)
    with sqlite3.connect(path) as con:
        con.execute(f"UPDATE NVTX_EVENTS SET globalTid = {value} WHERE rowid % 2 = 0")
    code, out, err = run(capsys, "nsys", path, "--by", "module")
    assert code == 2
    one_error_line(err, "no ranges of the NVTX domain 'flopcount'")


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    pytest.importorskip("adbc_driver_sqlite")
    import nvtx_profile_gen as gen

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    return gen.generate(model, torch.randn(4, 3, 2, 2), str(tmp_path_factory.mktemp("nsys") / "base.sqlite"),
                        orphan_kernels=0)


def _one_time_for_every_range(path):
    """Every NVTX range of the export at ``path`` given the same start and end."""
    with sqlite3.connect(path) as con:
        low, high = con.execute("SELECT min(start), max(end) FROM NVTX_EVENTS").fetchone()
        con.execute("UPDATE NVTX_EVENTS SET start = ?, end = ?", (low, high))


def test_an_export_whose_ranges_share_one_time_is_refused_where_nothing_is_priced(small_export, tmp_path, capsys):
    path = str(tmp_path / "same.sqlite")
    shutil.copy(small_export, path)
    _one_time_for_every_range(path)
    code, out, err = run(capsys, "nsys", path, "--format", "json")
    assert code == 2 and out == ""
    one_error_line(err, "nothing could be priced")
    assert "share their start and end" in err[0]


@pytest.mark.skipif(not os.path.exists(REAL_NSYS), reason="real nsys fixture missing")
def test_an_export_whose_ranges_share_one_time_says_so(tmp_path, capsys):
    pytest.importorskip("adbc_driver_sqlite")
    path = str(tmp_path / "same.sqlite")
    shutil.copy(REAL_NSYS, path)
    _one_time_for_every_range(path)
    code, out, err = run(capsys, "nsys", path, "--format", "json")
    assert code == 0, err  # an export without shapes: GPU times only, and the note says the nesting is lost
    assert any("share their start and end with another range" in n for n in json.loads(out)["notes"])


# --- one convention for the recurrent cell --------------------------------------------------------------------------
def test_an_lstm_counts_the_same_on_the_cpu_kernel_and_as_cudnn():
    # nn.LSTM(4, 5) on 3 steps x 2 sequences = 6 tokens; H = 5, I = 4, 4 gates.
    # forward per token: W_ih x and W_hh h 2 x 4H x (I + H) = 360, their sum 4H = 20, the biases 2 x 4H = 40, the
    # cell 18H = 90 (three sigmoids 12H, tanh(g) H, f c + i g 3H, o tanh(c') 2H): 510, x 6 = 3060.
    # backward per token: data gradients 2 x 4H x (I + H) = 360 and weight gradients 360, the gates' sum 20, the
    # bias gradients 40, the cell's derivative 2 x 90 = 180: 960, x 6 = 5760.
    x = torch.randn(3, 2, 4)
    cpu = flopcount.count(nn.LSTM(4, 5), x)
    cuda = flopcount.count(nn.LSTM(4, 5), x, as_device="cuda")
    assert op_flops(cpu, "aten.mkldnn_rnn_layer", "forward") == op_flops(cuda, "aten._cudnn_rnn", "forward") == 3060
    assert op_flops(cpu, "aten.mkldnn_rnn_layer_backward", "backward") == 5760
    assert op_flops(cuda, "aten._cudnn_rnn_backward", "backward") == 5760
    assert cpu.total() == cuda.total()


@pytest.mark.slow  # a child process that imports torch and transformers: ~10 s of CPU
def test_a_cached_hub_id_is_read_from_the_cache_at_once_while_the_hub_cannot_be_reached(tmp_path):
    pytest.importorskip("transformers")
    snapshot = tmp_path / "hub" / "models--someone--tiny-gpt2" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(os.path.join(GPT2, "config.json"), snapshot / "config.json")
    (tmp_path / "hub" / "models--someone--tiny-gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-gpt2" / "refs" / "main").write_text("0" * 40)
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith(("HF_", "TRANSF"))}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hub"))
    res = cli("count", "hf:someone/tiny-gpt2", "--no-backward", "--format", "json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["model"] == "tiny-gpt2"
    assert "Retrying" not in res.stderr and "thrown while requesting" not in res.stderr  # the hub was never tried
