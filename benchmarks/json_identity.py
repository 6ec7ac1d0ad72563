"""The json of the main commands on the shared fixtures, byte for byte, here against another revision.

A refactor that moves modules must not change a single printed byte. This script runs ``count``, ``count --fsdp
--tp``, ``trace``, ``nsys`` and ``infer`` with ``--format json`` on the fixtures under ``tests/fixtures``, once with
this tree and once with a clean checkout of ``--against`` (a git worktree in a temporary folder, removed after),
and compares the outputs. Both runs read the same fixture files (this tree's), so paths printed in the json agree.

    python benchmarks/json_identity.py --against HEAD~3     # exit 0 if every output is byte-identical
    python benchmarks/json_identity.py --write DIR          # keep this tree's outputs, one file per command
    python benchmarks/json_identity.py --against REV --only trace_mi250,nsys_mfu   # some of the commands
"""
from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
LLAMA = "hf:" + os.path.join(FIX, "hf", "llama-gqa-tiny")
GPT2 = "hf:" + os.path.join(FIX, "hf", "gpt2-tiny")

COMMANDS = {
    "count_resnet18": ["count", "resnet18", "--batch", "2"],
    "count_mobilenet_v2": ["count", "mobilenet_v2", "--by", "module"],
    "count_llama": ["count", LLAMA, "--seq-len", "16"],
    "count_llama_fsdp2_tp2": ["count", LLAMA, "--seq-len", "16", "--fsdp", "2", "--tp", "2"],
    "count_llama_tp2_by_module": ["count", LLAMA, "--seq-len", "16", "--tp", "2", "--by", "module"],
    "infer_gpt2": ["infer", GPT2, "--prompt", "8", "--new", "4", "--batch", "2"],
    "infer_llama": ["infer", LLAMA, "--prompt", "16", "--new", "8", "--device-spec", "H100-SXM"],
    "trace_a100": ["trace", os.path.join(FIX, "kineto", "a100_dlrm_train_control.json.gz")],
    "trace_mi250": ["trace", os.path.join(FIX, "kineto", "mi250_minitoy_train.json.gz")],
    "trace_sampled": ["trace", os.path.join(FIX, "kineto", "sampled_rank0_train.json.gz")],
    "trace_legacy": ["trace", os.path.join(FIX, "kineto", "legacy_1x_cnn.json")],
    "trace_a100_predict": ["trace", os.path.join(FIX, "kineto", "a100_dlrm_train_control.json.gz"), "--predict"],
    "nsys_mfu": ["nsys", os.path.join(FIX, "nsys", "mfu_2gpu_before.sqlite")],
    "nsys_mfu_by_kernel": ["nsys", os.path.join(FIX, "nsys", "mfu_2gpu_before.sqlite"), "--by", "kernel"],
}


def run_all(tree: str, names=None) -> dict:
    """{name: (exit code, stdout bytes)} of every command (or those ``names``) run with the package of ``tree``."""
    env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0")
    out = {}
    for name in names or COMMANDS:
        args = COMMANDS[name]
        done = subprocess.run([sys.executable, "-m", "flopcount", *args, "--format", "json"], cwd=tree, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out[name] = (done.returncode, done.stdout)
        print(f"  {name}: exit {done.returncode}, {len(done.stdout):,} bytes", file=sys.stderr)
    return out


def compare(ours: dict, theirs: dict) -> list:
    """The names whose exit code or bytes differ, each with the first lines of a diff (a command run on one side
    only differs)."""
    bad = []
    for name in [*ours, *(n for n in theirs if n not in ours)]:
        if ours.get(name) == theirs.get(name):
            continue
        if name not in ours or name not in theirs:
            bad.append((name, [f"run {'here' if name in ours else 'there'} only"]))
            continue
        diff = difflib.unified_diff(theirs[name][1].decode(errors="replace").splitlines(),
                                    ours[name][1].decode(errors="replace").splitlines(), lineterm="", n=0)
        bad.append((name, [f"exit {theirs[name][0]} -> {ours[name][0]}", *list(diff)[:12]]))
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="a git revision to compare this tree with")
    ap.add_argument("--write", metavar="DIR", help="write this tree's outputs to DIR")
    ap.add_argument("--only", metavar="NAMES", help="comma-separated command names (default: all of them)")
    args = ap.parse_args(argv)
    if not args.against and not args.write:
        ap.error("give --against REV, --write DIR or both")
    names = [n for n in (args.only or "").split(",") if n] or list(COMMANDS)
    unknown = [n for n in names if n not in COMMANDS]
    if unknown:
        ap.error(f"unknown command name {unknown[0]!r} (known: {', '.join(COMMANDS)})")
    print("this tree:", file=sys.stderr)
    ours = run_all(ROOT, names)
    if args.write:
        os.makedirs(args.write, exist_ok=True)
        for name, (_, data) in ours.items():
            with open(os.path.join(args.write, name + ".json"), "wb") as fh:
                fh.write(data)
    if not args.against:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        other = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", other, args.against], check=True)
        try:
            print(f"{args.against}:", file=sys.stderr)
            theirs = run_all(other, names)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", other], check=False)
    bad = compare(ours, theirs)
    for name, lines in bad:
        print(f"{name}: differs", *("    " + line for line in lines), sep="\n")
    print(f"{len(names) - len(bad)} of {len(names)} outputs byte-identical with {args.against}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
