"""Bad times in recorded profiles, both readers: every dropped or merged row is noted with its count and reason,
no time or FLOP count comes out negative, infinite or NaN, and the JSON output is strict."""
import gzip
import json
import os
import random
import shutil
import sqlite3

import pytest

from flopcount.cli import main

pytest.importorskip("pyarrow")
pytest.importorskip("adbc_driver_sqlite")

HERE = os.path.dirname(os.path.abspath(__file__))
KINETO = os.path.join(HERE, "fixtures", "kineto", "mi250_minitoy_train.json.gz")  # kernels, launches, phases
INT64_MAX = 2 ** 63 - 1


def strict_json(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def run_json(capsys, *argv):
    code = main([*argv, "--format", "json"])
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    return code, (strict_json(out.out) if code == 0 else None), err


def skipped(doc):
    """{reason: rows} of the notes' "N row(s) skipped: reason"."""
    out = {}
    for note in doc["notes"]:
        head, sep, why = note.partition(" row(s) skipped: ")
        if sep:
            out[why] = out.get(why, 0) + int(head.replace(",", ""))
    return out


def assert_sane(doc):
    """No negative, infinite or NaN time or FLOP count anywhere in the document."""
    def walk(v, path):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]")
        elif isinstance(v, float) or isinstance(v, int) and not isinstance(v, bool):
            key = path.rsplit(".", 1)[-1]
            if any(w in key for w in ("flops", "seconds", "gpu_s", "time")):
                assert v == v and v not in (float("inf"), float("-inf")) and v >= 0, (path, v)
    walk(doc, "")


@pytest.fixture(scope="module")
def base_export(tmp_path_factory):
    """A generated emit_nvtx export of a small MLP's training step (kernels with their launches)."""
    import torch

    import nvtx_profile_gen as gen

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    return gen.generate(model, torch.randn(4, 3, 2, 2), str(tmp_path_factory.mktemp("nsys") / "base.sqlite"),
                        orphan_kernels=0)


def edited(base, tmp_path, *sqls, name="edited.sqlite"):
    path = str(tmp_path / name)
    shutil.copy(base, path)
    con = sqlite3.connect(path)
    for sql in sqls:
        con.execute(sql)
    con.commit()
    con.close()
    return path


def trace_with(tmp_path, change, name="edited.json"):
    with gzip.open(KINETO) as fh:
        doc = json.load(fh)
    doc["traceEvents"] = change(doc["traceEvents"])
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def is_kernel(e):
    return isinstance(e, dict) and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")


def is_op(e):
    return isinstance(e, dict) and e.get("cat") == "cpu_op"


# --- Nsight exports ------------------------------------------------------------------------------------------------
def test_the_unedited_export_is_the_reference(base_export, capsys):
    code, doc, err = run_json(capsys, "nsys", base_export)
    assert code == 0 and not skipped(doc)
    assert_sane(doc)


@pytest.mark.parametrize("sqls, reason", [
    (["UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 1000 WHERE rowid % 3 = 0"], "kernel that ends before"),
    ([f"UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = {INT64_MAX} WHERE rowid = 5"], "kernel lasting over a week"),
    ([f"UPDATE NVTX_EVENTS SET end = {INT64_MAX} WHERE rowid = 7"], "range lasting over a week"),
    (["UPDATE NVTX_EVENTS SET start = start - 100000000000, end = end - 100000000000 WHERE rowid % 2 = 0"],
     "range with a negative time"),
    (["UPDATE NVTX_EVENTS SET text = NULL WHERE text LIKE 'aten::addmm%'"], "range with no text"),
    (["UPDATE NVTX_EVENTS SET end = NULL WHERE text LIKE 'aten::addmm%'"], "NULL or non-integer start, end"),
    (["UPDATE NVTX_EVENTS SET end = start WHERE text LIKE 'aten::addmm%'"], "range with end == start"),
])
def test_an_impossible_time_is_dropped_with_its_count_and_reason(base_export, tmp_path, capsys, sqls, reason):
    code, ref, _ = run_json(capsys, "nsys", base_export)
    code, doc, err = run_json(capsys, "nsys", edited(base_export, tmp_path, *sqls))
    assert code == 0, err
    assert_sane(doc)
    noted = {why: n for why, n in skipped(doc).items() if why.startswith(reason)}
    assert noted and all(n > 0 for n in noted.values()), doc["notes"]
    assert doc["seconds"] <= ref["seconds"]  # a dropped kernel never adds time, INT64_MAX least of all


def test_a_file_shifted_before_its_start_is_refused_with_what_was_dropped(base_export, tmp_path, capsys):
    shift = "UPDATE {} SET start = start - 100000000000, end = end - 100000000000"
    path = edited(base_export, tmp_path, *(shift.format(t) for t in (
        "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME")))
    code = main(["nsys", path])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("flopcount: error:")
    assert "range with a negative time" in err[0]


def test_rows_recorded_twice_are_counted_once_and_said(base_export, tmp_path, capsys):
    code, ref, _ = run_json(capsys, "nsys", base_export)
    path = edited(base_export, tmp_path, *(f"INSERT INTO {t} SELECT * FROM {t}" for t in (
        "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME")))
    code, doc, err = run_json(capsys, "nsys", path)
    assert code == 0, err
    assert doc["flops"] == ref["flops"] and doc["seconds"] == pytest.approx(ref["seconds"])
    with sqlite3.connect(base_export) as con:
        n = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in (
            "NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME")}
    why = skipped(doc)
    assert why["range recorded twice (same thread, times and marker): counted once"] == n["NVTX_EVENTS"]
    assert why["kernel recorded twice (same times, name and launch): counted once"] == n["CUPTI_ACTIVITY_KIND_KERNEL"]
    assert why["launch recorded twice (same correlation id, thread and time): counted once"] == \
        n["CUPTI_ACTIVITY_KIND_RUNTIME"]


def test_a_correlation_id_with_several_launches_charges_no_op(base_export, tmp_path, capsys):
    path = edited(base_export, tmp_path, "UPDATE CUPTI_ACTIVITY_KIND_RUNTIME SET correlationId = 1",
                  "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET correlationId = 1")
    code, doc, err = run_json(capsys, "nsys", path)
    assert code == 0, err
    assert_sane(doc)
    reason = [w for w in skipped(doc) if w.startswith("kernel whose correlation id has several different launches")]
    assert reason, doc["notes"]
    # before: every kernel's time went to the op of the first launch
    assert not any(r["gpu_s"] > 0 for r in doc["per_op"])


def test_a_phase_without_time_has_null_flop_rate_in_strict_json(base_export, tmp_path, capsys):
    path = edited(base_export, tmp_path, "DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL")
    code, doc, err = run_json(capsys, "nsys", path)  # strict_json raises on a bare NaN
    assert code == 0, err
    assert doc["flops_per_s"] and all(v is None for v in doc["flops_per_s"].values())


def test_a_hot_journal_is_refused_not_read_as_committed(base_export, tmp_path, capsys):
    path = edited(base_export, tmp_path)
    # the first bytes of a rollback journal whose transaction was never finished (its writer was killed)
    with open(path + "-journal", "wb") as fh:
        fh.write(bytes.fromhex("d9d505f920a163d7") + b"\0" * 504)
    code = main(["nsys", path])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rollback journal" in err[0] and "never finished" in err[0]
    os.unlink(path + "-journal")
    with open(path + "-journal", "wb") as fh:  # a finished journal (persist mode: zeroed header) is no obstacle
        fh.write(b"\0" * 512)
    assert main(["nsys", path]) == 0


# --- torch.profiler traces -----------------------------------------------------------------------------------------
def test_the_unedited_trace_is_the_reference(capsys):
    code, doc, err = run_json(capsys, "trace", KINETO)
    assert code == 0 and not skipped(doc)
    assert_sane(doc)


@pytest.mark.parametrize("change, reason", [
    (lambda ev: [dict(e, dur=-5.0) if is_kernel(e) else e for e in ev], "kernel that ends before"),
    (lambda ev: [dict(e, dur=1e13) if is_kernel(e) else e for e in ev], "kernel lasting over a week"),
    (lambda ev: [dict(e, dur=9.2e15) if is_kernel(e) else e for e in ev], "event without a usable ts, dur"),
    (lambda ev: [dict(e, ts=-e["ts"]) if is_op(e) and i % 2 else e for i, e in enumerate(ev)],
     "op with a negative time"),
    (lambda ev: [dict(e, args=dict(e["args"], **{"Input Dims": "[[1, 2]]"})) if is_op(e) else e for e in ev],
     "op with malformed Input Dims"),
])
def test_an_impossible_trace_event_is_dropped_with_its_count_and_reason(tmp_path, capsys, change, reason):
    code, ref, _ = run_json(capsys, "trace", KINETO)
    code, doc, err = run_json(capsys, "trace", trace_with(tmp_path, change))
    assert code == 0, err
    assert not [e for e in err if "internal error" in e]
    assert_sane(doc)
    assert any(w.startswith(reason) for w in skipped(doc)), doc["notes"]
    assert doc["seconds"] <= ref["seconds"]


def test_a_trace_with_every_event_200_times_reads_as_once(tmp_path, capsys):
    code, ref, _ = run_json(capsys, "trace", KINETO)
    path = trace_with(tmp_path, lambda ev: [e for e in ev for _ in range(200)])
    code, doc, err = run_json(capsys, "trace", path)
    assert code == 0, err
    assert doc["flops"] == ref["flops"] and doc["seconds"] == pytest.approx(ref["seconds"])
    with gzip.open(KINETO) as fh:
        ops = sum(1 for e in json.load(fh)["traceEvents"] if is_op(e) or e.get("cat") == "user_annotation")
    assert skipped(doc)["op recorded twice (same thread, times and marker): counted once"] == 199 * ops


def test_a_trace_correlation_id_with_several_launches_charges_no_op(tmp_path, capsys):
    def one_id(ev):
        return [dict(e, args=dict(e["args"], correlation=1)) if isinstance(e, dict) and
                isinstance(e.get("args"), dict) and "correlation" in e["args"] else e for e in ev]

    code, doc, err = run_json(capsys, "trace", trace_with(tmp_path, one_id))
    assert code == 0, err
    assert any(w.startswith("kernel whose correlation id has several") for w in skipped(doc)), doc["notes"]
    assert all(v is None for v in doc["flops_per_s"].values())  # no time left: null, not NaN


def test_a_trace_without_any_duration_is_refused(tmp_path, capsys):
    path = trace_with(tmp_path, lambda ev: [dict(e, dur=0) if is_op(e) or e.get("cat") == "user_annotation"
                                            else e for e in ev])
    code = main(["trace", path])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "every op has a duration of 0" in err[0]


def test_zero_length_autograd_nodes_are_noted(tmp_path, capsys):
    path = trace_with(tmp_path, lambda ev: [dict(e, dur=0) if is_op(e) and "Backward" in e.get("name", "")
                                            else e for e in ev])
    code, doc, err = run_json(capsys, "trace", path)
    assert code == 0, err
    assert any("autograd node(s) of zero duration" in n for n in doc["notes"]), doc["notes"]


# --- the fuzz: seeded edits of times and duplicates, both readers ---------------------------------------------------
FUZZ_SEED, FUZZ_FILES = 26, 12  # per reader


def test_fuzzed_nsys_times_and_duplicates(base_export, tmp_path, capsys):
    """Each file gets 1-4 edits on distinct rows; each edit is one the screening must drop or merge, so the rows
    noted are at least the rows edited."""
    rng = random.Random(FUZZ_SEED)
    with sqlite3.connect(base_export) as con:
        rows = {t: [r[0] for r in con.execute(f"SELECT rowid FROM {t}")] for t in ("NVTX_EVENTS",
                                                                                   "CUPTI_ACTIVITY_KIND_KERNEL")}
    edits = {
        "NVTX_EVENTS": ["UPDATE NVTX_EVENTS SET end = {big} WHERE rowid = {r}",
                        "UPDATE NVTX_EVENTS SET start = -start - 1, end = -1 WHERE rowid = {r}",
                        "UPDATE NVTX_EVENTS SET end = start WHERE rowid = {r}",
                        "UPDATE NVTX_EVENTS SET end = NULL WHERE rowid = {r}",
                        "INSERT INTO NVTX_EVENTS SELECT * FROM NVTX_EVENTS WHERE rowid = {r}"],
        "CUPTI_ACTIVITY_KIND_KERNEL": [
            "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 1 - {small} WHERE rowid = {r}",
            "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = {big} WHERE rowid = {r}",
            "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = -{small} - 1 WHERE rowid = {r}",
            "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL SELECT * FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE rowid = {r}"],
    }
    for i in range(FUZZ_FILES):
        sqls = []
        for table in rng.sample(sorted(edits), rng.randint(1, 2)):
            for r in rng.sample(rows[table], rng.randint(1, 2)):
                sqls.append(rng.choice(edits[table]).format(r=r, big=rng.choice([INT64_MAX, 2 ** 62, 10 ** 18]),
                                                            small=rng.randint(0, 10 ** 12)))
        path = edited(base_export, tmp_path, *sqls, name=f"fuzz{i}.sqlite")
        code, doc, err = run_json(capsys, "nsys", path)
        assert code in (0, 2) and not [e for e in err if "internal error" in e or "Traceback" in e], (sqls, err)
        if code == 2:
            assert len(err) == 1 and err[0].startswith("flopcount: error:"), (sqls, err)
            continue
        assert_sane(doc)
        assert sum(skipped(doc).values()) >= len(sqls), (sqls, doc["notes"])


def test_fuzzed_trace_times_and_duplicates(tmp_path, capsys):
    rng = random.Random(FUZZ_SEED)
    with gzip.open(KINETO) as fh:
        events = json.load(fh)["traceEvents"]
    timed = [i for i, e in enumerate(events) if is_op(e) or is_kernel(e)]

    def negative(e):
        return dict(e, ts=-rng.uniform(1, 1e9))

    def huge(e):
        return dict(e, dur=rng.choice([9.2e15, 4.7e15, 1e13]))

    def backwards(e):
        return dict(e, dur=-rng.uniform(1, 1e6)) if is_kernel(e) else dict(e, ts=-e["ts"])

    for i in range(FUZZ_FILES):
        picked = rng.sample(timed, rng.randint(1, 6))
        ev = list(events)
        twice = []
        for j in picked:
            kind = rng.choice(["negative", "huge", "backwards", "twice"])
            if kind == "twice":
                twice.append(events[j])
            else:
                ev[j] = {"negative": negative, "huge": huge, "backwards": backwards}[kind](events[j])
        ev += twice
        path = trace_with(tmp_path, lambda _: ev, name=f"fuzz{i}.json")
        code, doc, err = run_json(capsys, "trace", path)
        assert code in (0, 2) and not [e for e in err if "internal error" in e or "Traceback" in e], err
        if code == 2:
            assert len(err) == 1 and err[0].startswith("flopcount: error:"), err
            continue
        assert_sane(doc)
        assert sum(skipped(doc).values()) >= len(picked), doc["notes"]
