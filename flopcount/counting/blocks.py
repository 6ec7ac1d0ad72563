"""Repeated blocks counted once: a run of numbered blocks (``model.layers.0`` ... ``model.layers.N-1``) of the same
type, parameters and settings is counted with four of its blocks and with three, and the rest computed.

How, and why it is exact:

* A *run* is a ``ModuleList`` (or ``Sequential``) of at least ``MIN_BLOCKS`` children of one class whose every
  submodule has the same parameter and buffer shapes, dtypes and ``requires_grad``, and the same plain settings
  (numbers, strings, flags: a sliding window, an attention type, ``training``), the block's own number aside (a
  ``layer_idx`` equal to its position). Blocks that differ there (Gemma2's alternating windows, a ``layer_types``
  list) are not a run: every block is counted.
* The step is counted twice with the list cut down (``cut``): blocks ``0, 1, 2, N-1`` (count A) and ``0, 1, N-1``
  (count B), renumbered ``0..3`` and ``0..2`` while they run, so that the model's own loop over its list, its
  ``len`` and its slices work unchanged. Every row is then a sum over blocks of what each block adds to it, and
  A - B is what one middle block adds (its own rows, and its share of rows outside it: the optimizer's, a
  collective's of a parent, a cache's).
* The proof, on each count: blocks 1 and 2 of count A, two middle blocks each run between two others, are
  compared op for op (module below the block, op, phase, dtype, FLOPs, bytes, calls), and blocks 0, 1 and the last
  of count A against the same blocks of count B (a block's rows do not depend on how many blocks came before).
  A block whose ops depend on anything else than what the run's test holds equal (its inputs' metadata, its
  settings) would show there; if any check fails the step is counted with every block, and the notes say why.
* What the proof does not see: ops the parent runs between its blocks that depend on a block's number (a loop
  ``if i % 2: ...`` outside the blocks) are taken as growing by the same amount per block (A - B); a model whose
  loop does that must be counted with ``every_block()``.
* The whole: block ``k`` of ``3..N-2`` has block 2's rows under its own path (``--by module`` lists
  ``model.layers.7.self_attn`` as a full count does), blocks 0, 1 and ``N-1`` their own, and every row outside the
  blocks A + (N - 4) x (A - B), an exact integer.

``every_block()`` turns this off (the CLI's ``--every-block``); ``scaled`` is the one entry point, used by the
training count (``dispatch``), the sharded count (``distributed.sharded``) and a generation (``infer``).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Tuple

import torch

MIN_BLOCKS = 6  # below this, counting every block costs about what the two cut-down counts cost
_INT_COLUMNS = ("flops", "bytes", "calls")
_state = threading.local()
_BACKWARD = ("backward", "recompute")  # phases that run the blocks last to first


@contextmanager
def every_block():
    """Count every block inside this block (today's path: no run is cut down)."""
    _state.whole = getattr(_state, "whole", 0) + 1
    try:
        yield
    finally:
        _state.whole -= 1


def enabled() -> bool:
    """Whether runs of identical blocks may be counted once here (no ``every_block()`` is open)."""
    return not getattr(_state, "whole", 0)


class Run:
    """A run of identical numbered blocks: the list at ``path`` holding ``n`` of them."""

    def __init__(self, path: str, holder: torch.nn.Module, n: int):
        self.path, self.holder, self.n = path, holder, n

    def describe(self) -> str:
        """The run's blocks as a path range, ``model.layers.0-31``."""
        return f"{self.path}.0-{self.n - 1}"


# attribute names a block keeps its own number under (transformers: layer_idx; others: layer_id, layer_number)
_INDEX_WORDS = ("idx", "index", "layer", "number", "id")


def _settings(module: torch.nn.Module, position: int) -> tuple:
    """The plain settings of one module: its attributes that are numbers, strings, flags or None (or tuples of
    them), and the identity of any other object it holds (a shared config is one object), its number aside."""
    out = []
    for k, v in sorted(vars(module).items()):
        if k.startswith("_") or k in ("_parameters", "_buffers", "_modules"):
            continue
        if type(v) is int and v == position and any(w in k.lower() for w in _INDEX_WORDS):
            continue  # the block's own number
        if isinstance(v, (int, float, str, bool, type(None))) or (
                isinstance(v, tuple) and all(isinstance(e, (int, float, str, bool, type(None))) for e in v)):
            out.append((k, v))
        elif isinstance(v, torch.Tensor):
            out.append((k, tuple(v.shape), v.dtype, v.requires_grad))
        elif callable(v) and hasattr(v, "__func__"):  # a bound method: its function
            out.append((k, v.__func__))
        else:
            out.append((k, type(v), id(v)))
    return tuple(out)


def signature(block: torch.nn.Module, position: int) -> tuple:
    """What must be equal for two blocks to run the same ops on the same inputs: every submodule's class,
    parameters, buffers and settings."""
    sig = []
    for name, m in block.named_modules():
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False))
        sig.append((name, type(m), params, buffers, _settings(m, position), len(m._forward_hooks),
                    len(m._forward_pre_hooks)))
    return tuple(sig)


def find_run(model: torch.nn.Module) -> Optional[Run]:
    """The run of identical blocks with the most parameters, or None."""
    best, best_params = None, -1
    for path, m in model.named_modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(m._modules.items())
        if len(children) < MIN_BLOCKS or [k for k, _ in children] != [str(i) for i in range(len(children))]:
            continue
        blocks = [c for _, c in children]
        if any(b is None or type(b) is not type(blocks[0]) for b in blocks):
            continue
        first = signature(blocks[0], 0)
        if any(signature(b, i) != first for i, b in enumerate(blocks[1:], 1)):
            continue
        if len({id(b) for b in blocks}) != len(blocks):
            continue  # one module listed twice: its rows are one path's
        params = sum(p.numel() for p in m.parameters())
        if params > best_params:
            best, best_params = Run(path, m, len(blocks)), params
    return best


@contextmanager
def cut(run: Run, keep: List[int]):
    """The run's list holding only the blocks ``keep`` (renumbered from 0) while inside."""
    saved = run.holder._modules
    blocks = list(saved.values())
    run.holder._modules = OrderedDict((str(i), blocks[k]) for i, k in enumerate(keep))
    try:
        yield
    finally:
        run.holder._modules = saved


class Mismatch(Exception):
    """The cut-down counts do not prove the blocks identical."""


def _place(module: str, prefix: str) -> Tuple[Optional[int], str]:
    """(position in the run, the rest of the path) of a module path, or (None, path) outside the run's blocks."""
    if not module.startswith(prefix):
        return None, module
    rest = module[len(prefix):]
    head, dot, tail = rest.partition(".")
    if not head.isdigit():
        return None, module
    return int(head), dot + tail


def _split(records: List[dict], run: Run, keys: List[str]):
    """({position: {key below the block: numbers}}, {key outside the blocks: numbers}, the records' order)."""
    prefix = run.path + "." if run.path else ""
    blocks: Dict[int, Dict[tuple, tuple]] = {}
    outside: Dict[tuple, tuple] = {}
    for r in records:
        pos, rest = _place(r["module"], prefix)
        k = (rest,) + tuple(r[c] for c in keys if c != "module")
        nums = tuple(int(r[c]) for c in _INT_COLUMNS)
        target = outside if pos is None else blocks.setdefault(pos, {})
        if k in target:
            raise Mismatch("a row twice")
        target[k] = nums
    return blocks, outside


def combine(a: List[dict], b: List[dict], run: Run, keys: List[str]) -> List[dict]:
    """The rows of the whole run from count A (blocks 0, 1, 2, last) and count B (0, 1, last); raises
    ``Mismatch`` where they do not prove the blocks identical. ``keys``: the rows' non-numeric columns, in
    order (module first)."""
    n = run.n
    blocks_a, out_a = _split(a, run, keys)
    blocks_b, out_b = _split(b, run, keys)
    if set(blocks_a) - {0, 1, 2, 3} or set(blocks_b) - {0, 1, 2}:
        raise Mismatch("rows of blocks that did not run")
    get_a = lambda p: blocks_a.get(p, {})  # noqa: E731
    get_b = lambda p: blocks_b.get(p, {})  # noqa: E731
    if get_a(1) != get_a(2):
        raise Mismatch("blocks 1 and 2 ran different ops")
    if get_a(0) != get_b(0) or get_a(1) != get_b(1) or get_a(3) != get_b(2):
        raise Mismatch("a block's ops changed with the number of blocks before it")
    prefix = run.path + "." if run.path else ""
    extra = n - 4
    rows: List[dict] = []

    def emit(pos: Optional[int], k: tuple, nums: tuple):
        module = k[0] if pos is None else f"{prefix}{pos}{k[0]}"
        row = {"module": module}
        row.update(zip([c for c in keys if c != "module"], k[1:]))
        row.update(zip(_INT_COLUMNS, nums))
        rows.append(row)

    # in the order of count A; each stretch of a middle block's rows (of one phase, one after the other) stands
    # for blocks 2..N-2 in the order they run (forward ones ascending, backward ones descending)
    segment: List[tuple] = []

    def flush():
        if segment:
            order = range(n - 2, 1, -1) if segment[0][0] in _BACKWARD else range(2, n - 1)
            for p in order:
                for _, kk in segment:
                    emit(p, kk, blocks_a[2][kk])
            segment.clear()

    for r in a:
        pos, rest = _place(r["module"], prefix)
        k = (rest,) + tuple(r[c] for c in keys if c != "module")
        if pos == 2 and (not segment or segment[0][0] == r["phase"]):
            segment.append((r["phase"], k))
            continue
        flush()
        if pos == 2:
            segment.append((r["phase"], k))
        elif pos is None:
            d = tuple(x - y for x, y in zip(out_a[k], out_b.get(k, (0, 0, 0))))
            nums = tuple(x + extra * y for x, y in zip(out_a[k], d))
            if any(v < 0 for v in nums):
                raise Mismatch("a row outside the blocks shrinks with more blocks")
            emit(None, k, nums)
        else:
            emit(n - 1 if pos == 3 else pos, k, blocks_a[pos][k])
    flush()
    missing = set(out_b) - set(out_a)
    if missing:
        raise Mismatch("a row outside the blocks only with fewer blocks")
    return rows


def expand_paths(values: Dict[str, object], run: Run, keep: List[int]) -> Dict[str, object]:
    """A per-module mapping of a cut-down count (``module_outputs``) under the whole run's paths: each kept
    block's under its own number, block 2's under every middle block's."""
    prefix = run.path + "." if run.path else ""
    out: Dict[str, object] = {}
    middle = []
    for path, v in values.items():
        pos, rest = _place(path, prefix)
        if pos is None:
            out[path] = v
            continue
        real = keep[pos] if pos < len(keep) else pos
        out[f"{prefix}{real}{rest}"] = v
        if real == 2:
            middle.append((rest, v))
    for p in range(3, run.n - 1):
        for rest, v in middle:
            out[f"{prefix}{p}{rest}"] = v
    return out


KEEP_A = lambda n: [0, 1, 2, n - 1]  # noqa: E731
KEEP_B = lambda n: [0, 1, n - 1]  # noqa: E731


def scaled(model: torch.nn.Module, count: Callable[[], object], records: Callable[[object], List[dict]],
           keys: List[str]) -> Tuple[Optional[Run], object, object, List[dict], str]:
    """Run ``count()`` with the model's run of blocks cut down twice (A, then B) and combine their
    ``records(result)``. Returns (run, result A, result B, the whole run's rows, ""), or (None, None, None, [],
    why) where the blocks are not counted once (no run, turned off, or the proof failed): the caller then counts
    every block."""
    if not enabled():
        return None, None, None, [], "every block asked for"
    run = find_run(model)
    if run is None:
        return None, None, None, [], "no run of identical blocks"
    with cut(run, KEEP_A(run.n)):
        res_a = count()
    with cut(run, KEEP_B(run.n)):
        res_b = count()
    try:
        rows = combine(records(res_a), records(res_b), run, keys)
    except Mismatch as exc:
        return None, None, None, [], f"{run.describe()} not counted once: {exc}"
    return run, res_a, res_b, rows, ""


def note(run: Run) -> str:
    """The report's note for a run whose middle blocks were computed from block 2."""
    return (f"blocks {run.path}.3-{run.n - 2} counted as {run.path}.2 (identical blocks, checked op for op on each "
            "count: see estimators/blocks.py)")
