"""Profiles from real GPUs: CUDA op names (hand-worked values), torch.profiler traces (real fixtures, traces recorded
here on the CPU against the dispatch count), and every kind of bad file or value through the CLI."""
import gzip
import json
import os
import random
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

from flopcount.cli import main as cli
from flopcount.profiles import analyze, analyze_trace, kineto_trace
from flopcount.profiles.marker_args import Context, derive

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
KINETO = Path(os.environ.get("FLOPCOUNT_KINETO_FIXTURES", HERE / "fixtures" / "kineto"))
MI250 = KINETO / "mi250_minitoy_train.json.gz"
A100 = KINETO / "a100_dlrm_train_control.json.gz"
CPU_ONLY = KINETO / "cpu_only_rank34.json.gz"
needs_kineto = pytest.mark.skipif(not MI250.exists(), reason="Kineto fixtures missing (tests/fixtures/kineto)")

Q = [2, 4, 16, 8]  # (B, H, L, E): 256 scores per head
K = [2, 16, 4, 8]  # the same in (B, L, H, E)
P = [[10, 10], [10]]  # two parameters, 110 elements
# hand-worked: attention forward 2*4 * 256 * (2*8 + 2*8 + 5) = 75,776; backward 2*4 * (256*(6*8 + 4*8 + 5) + 16*2*8)
FWD, BWD = 75_776, 176_128
CASES = [
    # batch norm (2,4,6,6) = 288 elements: training 5 each, eval 2, cuDNN backward (always training, all grads) 7
    ("aten::cudnn_batch_norm", [[2, 4, 6, 6], [4], [4], [4], [4], [], [], []], Context(linked=True), 1_440),
    ("aten::cudnn_batch_norm", [[2, 4, 6, 6], [4], [4], [4], [4], [], [], []], Context(), 576),
    ("aten::miopen_batch_norm", [[2, 4, 6, 6], [4], [4], [4], [4], [], [], []], Context(linked=True), 1_440),
    ("aten::cudnn_batch_norm_backward", [[2, 4, 6, 6], [2, 4, 6, 6], [4], [4], [4], [4], [4], [], [0]], Context(), 2_016),
    # conv: 2 * N * out positions * weight.numel() = 2*2*64*(16*3*3*3)
    ("aten::cudnn_convolution", [[2, 3, 8, 8], [16, 3, 3, 3]] + [[]] * 7, Context(out=((2, 16, 8, 8),), linked=True),
     110_592),
    # transposed: over the input positions, 2*2*16*(16*8*9)
    ("aten::cudnn_convolution_transpose", [[2, 16, 4, 4], [16, 8, 3, 3]] + [[]] * 8,
     Context(out=((2, 8, 8, 8),), linked=True), 73_728),
    # 1x1 conv 2*25*16 = 800, bias 100, + z 100, relu 100
    ("aten::cudnn_convolution_add_relu", [[1, 4, 5, 5], [4, 4, 1, 1], [1, 4, 5, 5], [], [4], [], [], [], []],
     Context(out=((1, 4, 5, 5),), linked=True), 1_100),
    ("aten::miopen_convolution", [[1, 2, 4, 4], [3, 2, 3, 3], [3]] + [[]] * 6, Context(out=((1, 3, 2, 2),), linked=True),
     2 * 4 * 54 + 12),
    ("aten::native_dropout", [[4, 10], [], []], Context(), 80),
    ("aten::native_dropout_backward", [[4, 10], [4, 10], []], Context(), 80),
    ("aten::_scaled_dot_product_flash_attention", [Q, Q, Q, [], [], [], []], Context(), FWD),
    ("aten::_scaled_dot_product_flash_attention_backward", [Q] * 5 + [[2, 4, 16]] + [[]] * 9, Context(), BWD),
    ("aten::_scaled_dot_product_efficient_attention", [Q, Q, Q] + [[]] * 5, Context(), FWD),
    ("aten::_scaled_dot_product_efficient_attention_backward", [Q] * 4 + [[], Q, [2, 4, 16]] + [[]] * 6, Context(),
     BWD),
    ("aten::_scaled_dot_product_cudnn_attention", [Q, Q, Q] + [[]] * 6, Context(), FWD),
    ("aten::_scaled_dot_product_cudnn_attention_backward", [Q] * 5 + [[2, 4, 16, 1]] + [[]] * 10, Context(), BWD),
    ("aten::_flash_attention_forward", [K, K, K] + [[]] * 14, Context(), FWD),
    ("aten::_flash_attention_backward", [K] * 5 + [[2, 4, 16]] + [[]] * 11, Context(), BWD),
    ("aten::_efficient_attention_forward", [K, K, K] + [[]] * 11, Context(), FWD),
    ("aten::_efficient_attention_backward", [K] * 4 + [[], K] + [[]] * 4 + [[2, 4, 16]] + [[]] * 9, Context(), BWD),
    # LSTM, I=10, H=20, biases, 5x3 tokens: per token 2*80*30 + 80 + 160 + 18*20 = 5,400
    ("aten::_cudnn_rnn", [[5, 3, 10], [80, 10], [80, 20], [80], [80], [], [3360], [1, 3, 20], [1, 3, 20]] + [[]] * 10,
     Context(), 15 * 5_400),
    # Adam: 13 per element over the parameters (max_exp_avg_sqs empty without amsgrad)
    ("aten::_fused_adam_", P * 4 + [[]] + [[], []] + [[]] * 9, Context(), 110 * 13),
    ("aten::_fused_adamw_", P * 4 + [[]] + [[], []] + [[]] * 9, Context(), 110 * 13),
    ("aten::_fused_sgd_", P * 2 + [[]] + [[]] * 9, Context(), 110 * 2),  # no momentum buffers
    # SGD's _foreach_add_(params, grads, alpha=-lr): add and scale
    ("aten::_foreach_add_", P + P + [[]], Context(scaled=True), 220),
    ("aten::_foreach_add_", P + P + [[]], Context(), 110),
    ("aten::_foreach_addcmul_", P * 3 + [[]], Context(), 220),
    ("aten::_foreach_lerp_", P * 2 + [[]], Context(), 330),
]


@pytest.mark.parametrize("op,sizes,ctx,want", CASES, ids=[f"{c[0][6:]}-{i}" for i, c in enumerate(CASES)])
def test_cuda_op_hand_worked(op, sizes, ctx, want):
    assert derive(op, sizes, ctx) == (want, "")


def test_cudnn_rnn_backward_all_gradients():
    # per token: data gradients 4,800, weight gradients 4,800 + biases 160, gate sums 80, cell 2*18*20 = 720
    sizes = [[5, 3, 10], [80, 10], [80, 20], [80], [80], [], [3360], [1, 3, 20], [1, 3, 20], [5, 3, 20],
             [5, 3, 20], [1, 3, 20], [1, 3, 20]] + [[]] * 10 + [[10]] + [[]]
    assert derive("aten::_cudnn_rnn_backward", sizes, Context()) == (15 * 10_560, "")


# --- torch.profiler traces ---------------------------------------------------------------------------------------
@needs_kineto
def test_mi250_mlp_equals_hand_count():
    a = analyze_trace(MI250)
    # forward: addmm 2*5*128*128 + 5*128 bias; relu 640; mse_loss 640 * (subtract, square, reduce)
    assert a.report.total("forward") == 164_480 + 640 + 1_920
    # backward: mse_loss_backward 640 * 4 (mean), threshold_backward 640, weight grad mm 2*128*5*128, bias sum
    # 640, AccumulateGrad add_ 128*128 + 128 (no grad_input: the input needs none)
    assert a.report.total("backward") == 2_560 + 640 + 163_840 + 640 + 16_512
    # SGD: _foreach_add_(params, grads, alpha=-lr): 2 per element
    assert a.report.total("optimizer") == 2 * (128 * 128 + 128)
    assert a.devices[0] == "AMD Radeon Graphics" and a.time_source == "device" and a.kernels_unlaunched == 0


def _leaf_matmul_flops(path):
    """2 m k n (+ m n for addmm's bias) over every mm/addmm/bmm cpu_op of the file, computed here from the JSON."""
    total = 0
    for e in json.load(gzip.open(path))["traceEvents"]:
        if e.get("cat") != "cpu_op" or e.get("name") not in ("aten::mm", "aten::addmm", "aten::bmm"):
            continue
        d = e["args"]["Input Dims"]
        if e["name"] == "aten::mm":
            (m, k), (_, n) = d[0], d[1]
            total += 2 * m * k * n
        elif e["name"] == "aten::addmm":
            (m, k), (_, n) = d[1], d[2]
            total += 2 * m * k * n + m * n
        else:
            (b, m, k), (_, _, n) = d[0], d[1]
            total += 2 * b * m * k * n
    return total


@needs_kineto
def test_matmul_flops_equal_an_independent_sum():
    sampled = KINETO / "sampled_rank0_train.json.gz"
    a = analyze_trace(sampled)
    mine = int(a.ops[a.ops["op"].isin(["aten.mm", "aten.addmm", "aten.bmm"])]["flops"].sum())
    assert mine == _leaf_matmul_flops(sampled) > 0


@needs_kineto
def test_integer_ops_are_zero_even_where_their_sizes_fit_no_schema():
    """The sampled trace's TorchScript ops record their inputs shifted (a leading empty entry): an op on integer
    tensors only is still no floating-point work; a float op whose sizes fit no schema stays listed, not 0."""
    a = analyze_trace(KINETO / "sampled_rank0_train.json.gz")
    underived = [n for n in a.notes if n.startswith("FLOPs not derived")]
    assert not any(" of aten.cumsum:" in n or " of aten.sum:" in n or " of aten.eq:" in n for n in underived)
    assert any(" of aten.pow:" in n and "fit no schema" in n for n in underived)


@needs_kineto
def test_a100_trace_devices_and_time():
    a = analyze_trace(A100)
    assert a.devices[0] == "NVIDIA A100-PG509-200" and a.kernels > 8_000 and a.kernels_unlaunched == 0
    assert a.gpu_seconds("backward") > 0 and a.flops_per_s("backward") > 0
    # every matmul is its own op, counted once: exactly the sum worked out from the file (this trace has ops of
    # duration 0, under 1 us, at the start of the ops they sit in; they once put 104 linear layers inside the
    # clamp before them, and their addmm FLOPs went missing)
    mine = int(a.ops[a.ops["op"].isin(["aten.mm", "aten.addmm", "aten.bmm"])]["flops"].sum())
    assert mine == _leaf_matmul_flops(A100) > 0


@needs_kineto
def test_cpu_only_trace_uses_cpu_time(capsys):
    assert cli(["trace", str(CPU_ONLY)]) == 0
    out = capsys.readouterr().out
    assert "cpu_time=" in out and "CPU time" in out and "no device activity" in out


def _record(step):
    from torch.profiler import ProfilerActivity, profile

    step()  # warm-up: the gradients exist, as in every step but the first
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return prof


def _block():
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return layer, torch.randn(2, 8, 32)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "transformer_block"])
def test_cpu_trace_equals_dispatch(tmp_path, name):
    import torch

    import flopcount
    from flopcount.recording.capture import training_step

    if name == "transformer_block":
        model, x = _block()
        loss = lambda out: out.float().pow(2).mean()  # noqa: E731

        def step():
            model.zero_grad(set_to_none=True)  # as the counted step: no gradient to accumulate into
            loss(model(x)).backward()
    else:
        s = training_step(name, 2, device="cpu", input_shape="3,32,32", num_classes=10)
        model, x, step = s.model, s.inputs, s
        loss = None
    path = tmp_path / f"{name}.json"
    _record(step).export_chrome_trace(str(path))
    a = analyze_trace(path)
    counted = flopcount.count(model, x, loss_fn=loss) if loss else flopcount.count(model, x)
    for phase in ("forward", "backward"):
        assert a.report.total(phase) == counted.total(phase) > 0, phase
    # both sides read one formula table, so an error in it would cancel out: the trace's forward products are
    # also held to values worked out here from the layers' shapes
    f = a.report.frame[a.report.frame.phase == "forward"]
    by_op = f.groupby("op")["flops"].sum()
    assert by_op.sum() == a.report.total("forward")
    if name == "transformer_block":
        # 2 x 8 = 16 tokens, d 32, 4 heads of 8, feed-forward 64. Linear layers 2 x 16 x in x out + 16 x out:
        # out_proj 32->32 33,280, linear1 32->64 66,560, linear2 64->32 66,048: addmm 165,888; in_proj 32->96
        # runs as mm, 2 x 16 x 32 x 96 = 98,304 (its bias added apart, as PyTorch runs a 3-d linear).
        # Attention: 2 x 4 x 8 x 8 = 512 scores, each 2E + 5 + 2E = 37: 18,944
        assert (by_op["aten.addmm"], by_op["aten.mm"]) == (165_888, 98_304)
        assert by_op["aten._scaled_dot_product_flash_attention_for_cpu"] == 18_944
    else:
        macs, outputs = [], []

        def conv_macs(m, inputs, out):
            macs.append(out.numel() * m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1])
            outputs.append(out.numel() if m.bias is not None else 0)

        hooks = [m.register_forward_hook(conv_macs) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
        with torch.no_grad():
            model(x)
        for h in hooks:
            h.remove()
        # 2 per multiply-add (+1 per output element of a biased convolution); the classifier: 2 x 2 x in x 10 + 20
        assert by_op["aten.convolution"] == 2 * sum(macs) + sum(outputs)
        features = {"resnet18": 512, "mobilenet_v2": 1280}[name]
        assert by_op["aten.addmm"] == 2 * 2 * features * 10 + 2 * 10


# --- bad files and bad values: one line on stderr, exit 2, never a traceback ------------------------------------
def _one_line(capsys, argv, code=2):
    rc = cli(argv)
    err = capsys.readouterr().err.strip()
    assert rc == code, (argv, rc, err)
    if code == 2:
        assert err.startswith("flopcount: error:") and "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_traces(tmp_path, capsys):
    text = tmp_path / "t.json"
    text.write_text("this is not json")
    trunc = tmp_path / "t.json.gz"
    trunc.write_bytes(gzip.compress(b'{"traceEvents": []}' * 1000)[:60])
    none = tmp_path / "n.json"
    none.write_text('{"schemaVersion": 1}')
    assert "not JSON" in _one_line(capsys, ["trace", str(text)])
    assert "gzip" in _one_line(capsys, ["trace", str(trunc)])
    assert "traceEvents" in _one_line(capsys, ["trace", str(none)])


@pytest.fixture(scope="module")
def small_profile(tmp_path_factory):
    import torch

    import nvtx_profile_gen as gen

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    return gen.generate(model, torch.randn(4, 3, 2, 2), str(tmp_path_factory.mktemp("p") / "lin.sqlite"))


def _edit(src, dst, *sql):
    shutil.copy(src, dst)
    con = sqlite3.connect(dst)
    for s in sql:
        con.execute(s)
    con.commit()
    con.close()
    return str(dst)


def test_file_kinds_one_line(tmp_path, capsys, monkeypatch):
    assert "is a directory" in _one_line(capsys, ["nsys", str(tmp_path)])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "FIFO" in _one_line(capsys, ["nsys", str(fifo)])
    assert "character device" in _one_line(capsys, ["nsys", "/dev/null"])
    empty = tmp_path / "e.sqlite"
    empty.write_bytes(b"")
    assert "empty" in _one_line(capsys, ["trace", str(empty)])
    secret = tmp_path / "secret.sqlite"
    secret.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    real_open = open

    def deny(path, *a, **k):  # tests run as root, which chmod 000 does not stop
        if str(path) == str(secret):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **k)
    monkeypatch.setattr("builtins.open", deny)
    assert "permission denied" in _one_line(capsys, ["nsys", str(secret)])


def test_malformed_values_are_skipped_and_counted(small_profile, tmp_path, capsys):
    want = analyze(small_profile).report.total()
    cases = {
        "null tid": "UPDATE NVTX_EVENTS SET globalTid = NULL WHERE rowid = 1",
        "text in int": "UPDATE NVTX_EVENTS SET start = 'abc' WHERE rowid = 2",
        "reversed": "UPDATE NVTX_EVENTS SET end = start - 5 WHERE rowid = 3",
        "degenerate": "UPDATE NVTX_EVENTS SET end = start WHERE rowid = 4",
        "kernel text": "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'x' WHERE rowid = 1",
    }
    for what, sql in cases.items():
        path = _edit(small_profile, tmp_path / f"{what}.sqlite", sql)
        a = analyze(path)
        assert any("skipped" in n for n in a.notes), (what, a.notes)
        assert _one_line(capsys, ["nsys", path], code=0) == ""
    # every range degenerate: nothing left to nest; one line, not 0 FLOPs
    path = _edit(small_profile, tmp_path / "all0.sqlite", "UPDATE NVTX_EVENTS SET end = start")
    assert "end == start" in _one_line(capsys, ["nsys", path])
    path = _edit(small_profile, tmp_path / "allrev.sqlite", "UPDATE NVTX_EVENTS SET end = start - 1")
    assert "end before start" in _one_line(capsys, ["nsys", path])
    assert want > 0


def test_malformed_sizes_are_not_derived(small_profile, tmp_path):
    bad = {"malformed": "[[4, 12], [5, 12", "overflow": "[[99999999999999999999999, 12], [5, 12], [5]]",
           "nested": "[" * 50 + "]" * 50}
    for what, sizes in bad.items():
        path = _edit(small_profile, tmp_path / f"{what}.sqlite",
                     f"UPDATE NVTX_EVENTS SET text = 'aten::addmm, seq = 1, op_id = 9, sizes = {sizes}' "
                     "WHERE text LIKE 'aten::addmm%'")
        a = analyze(path)
        assert any("aten.addmm" in n and "not derived" in n for n in a.notes), (what, a.notes)


def test_giant_string_memory_stays_proportional(small_profile, tmp_path):
    import resource

    big = 16 << 20
    path = _edit(small_profile, tmp_path / "big.sqlite", f"UPDATE NVTX_EVENTS SET text = 'aten::addmm, sizes = ' || "
                 f"hex(zeroblob({big // 2})) WHERE rowid = 1")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    a = analyze(path)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert any("over 1,048,576 bytes" in n for n in a.notes)
    assert grown < 6 * big  # the string is held a few times at most, never 13-20x


_WAL_WRITER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1])
con.execute("PRAGMA journal_mode=WAL")
con.execute("PRAGMA wal_autocheckpoint=0")
print(con.execute("SELECT count(*) FROM NVTX_EVENTS").fetchone()[0], flush=True)
con.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) SELECT start + 10000000, "
            "end + 10000000, eventType, text, globalTid FROM NVTX_EVENTS")
con.commit()
print("committed", flush=True)
sys.stdin.readline()
con.close()
"""


def test_wal_beside_the_export_is_read(small_profile, tmp_path):
    import subprocess

    path = str(tmp_path / "wal.sqlite")
    shutil.copy(small_profile, path)
    # The writer is another process, as nsys is: two SQLite libraries in one process (Python's and the Arrow
    # driver's) do not see each other's POSIX locks, and a reader there can find the WAL "locked" by its own process.
    writer = subprocess.Popen([sys.executable, "-c", _WAL_WRITER, path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        n = int(writer.stdout.readline())
        assert writer.stdout.readline().strip() == "committed"
        assert os.path.getsize(path + "-wal") > 0
        a = analyze(path)  # read while the writer still holds the WAL open
    finally:
        writer.communicate("\n", timeout=300)  # a guard against a hang only
    assert a.ranges == 2 * n


# --- fuzz: corrupted copies each give a report or one line -------------------------------------------------------
def _corrupt(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:
        for _ in range(rng.randint(1, 40)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1:
        b = b[: rng.randrange(len(b))]
    elif kind == 2:
        start = rng.randrange(len(b))
        b[start:start + rng.randint(1, 512)] = bytes(min(512, len(b) - start))
    else:
        start = rng.randrange(len(b))
        b[start:start + 64] = bytes(rng.randrange(256) for _ in range(64))
    return bytes(b)


def _sql_corrupt(path, rng):
    con = sqlite3.connect(path)
    col = rng.choice(["start", "end", "globalTid", "text", "eventType"])
    val = rng.choice(["NULL", "'x'", "1.5", "-1", "9223372036854775807", "x'00ff'"])
    con.execute(f"UPDATE NVTX_EVENTS SET {col} = {val} WHERE abs(random()) % 3 = 0")
    con.commit()
    con.close()


@needs_kineto
def test_fuzz_readers(small_profile, tmp_path, capsys):
    rng = random.Random(1234)
    raw = {"nsys": Path(small_profile).read_bytes(), "trace": gzip.decompress(MI250.read_bytes())}
    # no clock: the work is bounded instead (200 files from a fixed seed, each one corruption of a small export or
    # trace); a time limit measured how busy the machine was, not the readers
    for i in range(200):
        kind = "nsys" if i % 2 else "trace"
        path = tmp_path / f"f{i}.{'sqlite' if kind == 'nsys' else 'json'}"
        if kind == "nsys" and i % 6 == 1:
            path.write_bytes(raw[kind])
            _sql_corrupt(path, rng)  # NULLs and type swaps in a well-formed file
        elif kind == "trace" and i % 6 == 0:
            doc = json.loads(raw[kind])
            for e in rng.sample(doc["traceEvents"], 20):
                key = rng.choice(list(e))
                e[key] = rng.choice([None, "x", -1, 1e300, [], {}])
            path.write_text(json.dumps(doc))
        else:
            path.write_bytes(_corrupt(raw[kind], rng))
        rc = cli([kind, str(path)])
        out = capsys.readouterr()
        assert "Traceback" not in out.err and "internal error" not in out.err, (i, out.err)
        assert rc == 0 or (rc == 2 and out.err.count("\n") == 1), (i, rc, out.err)


@needs_kineto
def test_trace_reader_restores_the_collector():
    import gc

    kineto_trace.load(MI250)
    assert gc.isenabled()
    gc.disable()
    try:
        kineto_trace.load(MI250)
        assert not gc.isenabled()  # a caller's choice is left as it was
    finally:
        gc.enable()


def test_gpu_check_without_gpu_stops_in_one_line(capsys, monkeypatch):
    import torch

    from experiments import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", "unused"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_check: no CUDA GPU") and "\n" not in err


@needs_kineto
def test_gpu_check_analysis_on_a_trace():
    from experiments import gpu_check

    class Counted:  # the dispatch side, as the MI250 MLP was worked out by hand
        def total(self, phase):
            return {"forward": 167_040, "backward": 184_192}[phase]

    row = gpu_check.counts_side_by_side(Counted(), analyze_trace(MI250))
    assert row["forward"] == {"dispatch": 167_040, "trace": 167_040, "nvtx": None}
    assert row["backward"]["trace"] == row["backward"]["dispatch"]


@pytest.mark.slow
def test_gpu_check_pipeline_runs_on_the_cpu(tmp_path):
    """The whole check (timing with and without autocast, a recorded trace, the counts side by side) as a dry run
    on the CPU: the recorded traces give exactly the dispatch count."""
    from experiments import gpu_check

    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(r["model"], r["autocast"]) for r in doc["rows"]] == [
        (m, a) for m in ("resnet50", "mobilenet_v2", "gpt2-small") for a in (None, "bfloat16")]
    assert all("error" not in r and r["utilization"] > 0 and r["flops_per_step"] > 0 for r in doc["rows"])
    assert set(doc["counts"]) == {"resnet50", "mobilenet_v2"}
    for row in doc["counts"].values():
        for phase in ("forward", "backward"):
            assert row[phase]["trace"] == row[phase]["dispatch"] > 0 and row[phase]["nvtx"] is None
    assert "| resnet50 | forward |" in (tmp_path / "gpu_check.md").read_text()
