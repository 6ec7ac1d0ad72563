"""Generate Nsight Systems SQLite profiles of a real training step, for testing the FLOPs read from profiles.

A model runs one training step on the CPU under ``torch.profiler`` with ``record_shapes=True``. Its op tree (names,
nesting, autograd sequence numbers, input shapes, scopes) is exactly what the RecordFunction callbacks of
``emit_nvtx`` see, so each op becomes an NVTX push/pop range whose text is formatted the way PyTorch's
``getNvtxStr`` formats it. Kernels are synthetic: every op that does the work itself (not a view, not an
allocation, not a wrapper whose children do the work) launches one or two kernels from inside its range, named
with the op's element type the way CUDA kernel templates are (``...<float>``). Backward runs on a second thread,
as the autograd engine's device thread does on a GPU.

With ``generate_annotated`` the step also runs inside ``flopcount.recording.nvtx.annotate`` with a stand-in domain that
leaves a zero-length ``record_function`` event wherever the nvtx package would push or pop; those become the rows
the nvtx package's ranges leave in an export: the domain's creation (NvtxDomainCreate, ``domainId``, its name),
push/pop ranges of registered strings (``textId`` -> StringIds, no inline text) with their colour, nested per
thread, at the very points of the op stream where the annotator called the package.

With ``generate_user_ranges`` the same stand-in marks a user's own ranges instead, named by module path around
chosen modules' forward, in the default domain with inline text (as ``torch.cuda.nvtx.range_push`` leaves them) or
in a domain of the user's, with or without a prefix before the path.

What is not reproduced: ``input_op_ids`` (torch.profiler does not record op outputs, so producers are unknown);
real timestamps (ranges get synthetic, strictly nested times); GPU-only inner ops (cudnn_convolution); the CPU
kernels' own inner ops (mkldnn_convolution) appear instead.

CUDA-style profiles (``cuda="efficient"`` or ``"flash"``): the same recorded tree, rewritten where a CUDA run
dispatches to other ops (cuda_style.py has the rules and their sources in PyTorch's dispatch code), each rewritten
op's arguments laid out from PyTorch's schema of that op:

* convolution: ``_convolution > cudnn_convolution`` (a bias added after it by ``add_``), or
  ``_convolution > _conv_depthwise2d`` for a float32 depthwise convolution, instead of the CPU backend
  (``mkldnn_convolution``, ``thnn_conv2d``); ``convolution_backward`` with no backend op inside (CUDA's are stubs);
* batch norm: ``_batch_norm_impl_index > cudnn_batch_norm``, backward ``CudnnBatchNormBackward0 >
  cudnn_batch_norm_backward(input, grad_output, ...)``;
* dropout in training: ``dropout > native_dropout``, backward ``NativeDropoutBackward0 > native_dropout_backward``,
  instead of ``bernoulli_``, ``div_``, ``mul`` and ``MulBackward0``;
* fused attention: ``_scaled_dot_product_efficient_attention > _efficient_attention_forward`` (float32) or
  ``_scaled_dot_product_flash_attention > _flash_attention_forward`` (half precision), and their backwards, instead of
  the CPU's ``_scaled_dot_product_flash_attention_for_cpu``.

The count such a profile must give is the dispatch count of the same model counted as CUDA dispatches
(``cuda_style.cuda_dispatch``: dropout through ``native_dropout``).

What is not reproduced: ``input_op_ids`` (torch.profiler does not record op outputs, so producers are unknown);
real timestamps (ranges get synthetic, strictly nested times); in CPU-style profiles, GPU-only inner ops
(cudnn_convolution): the CPU kernels' own inner ops (mkldnn_convolution) appear instead.

Run as a script to write a profile: ``python tests/nvtx_profile_gen.py resnet18 --batch 2 --out r18.sqlite``
(``--cuda efficient`` for a CUDA-style one; ``transformer_block`` for the block below).
"""
from __future__ import annotations

import argparse
import os
import sqlite3
from typing import List, Optional

# Ops that move no data through a kernel of their own on a GPU (views, metadata, allocation).
NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided", "aten::as_strided_",
    "aten::resize_", "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::t",
    "aten::transpose", "aten::expand", "aten::detach", "aten::detach_", "aten::alias", "aten::unsqueeze",
    "aten::squeeze", "aten::permute", "aten::select", "aten::slice", "aten::lift_fresh", "aten::resolve_conj",
    "aten::resolve_neg", "aten::flatten", "aten::numpy_T", "aten::expand_as", "aten::view_as", "aten::contiguous",
    "aten::to", "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "detach",
}
# Helpers an op calls around its own kernel (a layout copy, a zero fill): they launch their own kernels but do
# not mean that the op's work is done by its children.
HELPERS = {"aten::copy_", "aten::clone", "aten::fill_", "aten::zero_", "aten::_to_copy", "aten::zeros"}

_CTYPE = {"torch.float32": "float", "torch.float64": "double", "torch.float16": "c10::Half",
          "torch.bfloat16": "c10::BFloat16", "torch.int64": "long", "torch.int32": "int", "torch.bool": "bool",
          "torch.uint8": "unsigned char", "torch.int8": "signed char", "torch.int16": "short"}

PID, MAIN_TID, AUTOGRAD_TID = 4242, 4242, 4301
ANNOTATION_DOMAIN_ID = 1  # the default domain (emit_nvtx's) is 0
_MARK = "flopcount-nvtx|"


def global_tid(pid: int, tid: int) -> int:
    """Nsight's serialized GlobalId: process in bits 24..47, thread in bits 0..23."""
    return (pid << 24) | tid


# --- the emit_nvtx formatter, written from PyTorch's getNvtxStr / shapesToStr / inputSizes ----------------------
def nvtx_text(name: str, seq: int, op_id: int, sizes: Optional[List[List[int]]], input_op_ids=()) -> str:
    if seq >= -1 or sizes:
        text = f"{name}, seq = {seq}" if seq >= 0 else name
        if op_id > 0:
            text += f", op_id = {op_id}"
        if sizes:
            text += ", sizes = [" + ", ".join("[" + ", ".join(str(d) for d in s) + "]" for s in sizes) + "]"
        if input_op_ids:
            text += ", input_op_ids = [" + ", ".join(f"({a},{b})" for a, b in input_op_ids) + "]"
        return text
    return name


def input_sizes(inputs) -> List[List[int]]:
    """RecordFunction inputs -> sizes as inputSizes(fn, flatten_list_enabled=true) builds them."""
    out = []
    for item in inputs:
        if hasattr(item, "sizes"):
            out.append(list(item.sizes))
        elif isinstance(item, list):
            tensors = [list(t.sizes) for t in item if hasattr(t, "sizes")]
            out.extend(tensors if tensors else [[]])
        else:
            out.append([])
    return out


def _dtype(inputs) -> str:
    for item in inputs:
        if hasattr(item, "dtype"):
            return _CTYPE.get(str(item.dtype), "float")
        if isinstance(item, list):
            for t in item:
                if hasattr(t, "dtype"):
                    return _CTYPE.get(str(t.dtype), "float")
    return "float"


# --- recording --------------------------------------------------------------------------------------------------
def record_step(model, inputs, loss_fn=None):
    """Run forward + backward of ``model`` on CPU under torch.profiler; return the op tree's root events."""
    import torch
    import torch.nn.functional as F

    def default_loss(out):
        return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))

    def step():
        loss = (loss_fn or default_loss)(model(inputs))
        loss.backward()

    return record(step)


def record(step):
    """Run ``step()`` (any zero-argument callable) on CPU under torch.profiler; return the op tree's root events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return prof.profiler.kineto_results.experimental_event_tree()


class MarkingDomain:
    """Stands in for an nvtx Domain: each push or pop becomes an empty ``record_function`` event, so that it keeps
    its place among the ops the profiler records. Calls made while a backward runs (the module ranges of the
    backward, also from the engine's final callback) are tagged to go to the autograd thread."""

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return message, color

    def _mark(self, what: str) -> None:
        import torch
        from torch.autograd.profiler import record_function

        lane = "bwd" if torch._C._current_graph_task_id() != -1 else "main"
        with record_function(f"{_MARK}{what}|{lane}"):
            pass

    def push_range(self, attributes=None, **kwargs):
        text, color = attributes
        self._mark(f"push|{color}|{text}")

    def pop_range(self):
        self._mark("pop||")


def _does_work(ev) -> bool:
    if ev.name in NO_KERNEL or not ev.name.startswith("aten::"):
        return False
    stack = list(ev.children)
    while stack:
        c = stack.pop()
        if c.name.startswith("aten::") and c.name not in NO_KERNEL and c.name not in HELPERS:
            return False
        stack.extend(c.children)
    return True


def build_rows(roots, *, record_shapes: bool = True, kernels_per_op=(1, 2), orphan_kernels: int = 0,
               domain: Optional[str] = "flopcount"):
    """Op tree -> (nvtx rows, runtime rows, kernel rows, strings) in the Nsight schema. The ranges a
    ``MarkingDomain`` marked are in the domain ``domain`` (registered strings, the nvtx package's way), or with
    ``domain=None`` in the default domain with inline text, as a user's own ``torch.cuda.nvtx.range_push`` leaves
    them."""
    nvtx, runtime, kernels = [], [], []
    strings = {}
    open_ranges = {}  # thread -> the annotator's ranges pushed and not yet popped

    def sid(s: str) -> int:
        return strings.setdefault(s, len(strings) + 1)

    clock = [1_000_000]
    op_id = [0]
    corr = [0]

    def annotation(ev, tid):
        # push|color|text|lane or pop|||lane
        parts = ev.name[len(_MARK):].split("|")
        what, lane = parts[0], parts[-1]
        thread = global_tid(PID, AUTOGRAD_TID if lane == "bwd" else tid)
        stack = open_ranges.setdefault(thread, [])
        if what == "push":
            stack.append((clock[0], "|".join(parts[2:-1]), int(parts[1])))
        else:
            start, text, color = stack.pop()
            if domain is None:
                nvtx.append((start, clock[0], 59, text, thread))
            else:
                nvtx.append((start, clock[0], 59, None, thread, sid(text), ANNOTATION_DOMAIN_ID, color))
        clock[0] += 10

    def visit(ev, tid):
        if ev.name.startswith(_MARK):
            annotation(ev, tid)
            return
        ef = ev.extra_fields
        op_id[0] += 1
        my_id = op_id[0]
        inputs = list(getattr(ef, "inputs", []) or [])
        sizes = input_sizes(inputs) if record_shapes else None
        seq = int(getattr(ef, "sequence_number", -1))
        text = nvtx_text(ev.name, seq, my_id, sizes)
        start = clock[0]
        clock[0] += 10
        if _does_work(ev):
            n = kernels_per_op[my_id % len(kernels_per_op)]
            for k in range(n):
                corr[0] += 1
                launch = clock[0]
                runtime.append((launch, launch + 3, 1, global_tid(PID, tid), corr[0], sid("cudaLaunchKernel_v7000"), 0))
                name = f"void flopcount_synthetic::{ev.name[6:]}_kernel<{_dtype(inputs)}>(int)"
                kstart = launch + 2
                kernels.append((kstart, kstart + 100 + 7 * (my_id % 13) + k, 0, 1, 7, corr[0], PID << 24,
                                sid(name), sid(name.split("<")[0].split("::")[-1]), 1 + my_id % 64, 1, 1, 256, 1, 1))
                clock[0] += 5
        for child in ev.children:
            visit(child, tid)
        end = clock[0]
        clock[0] += 10
        nvtx.append((start, end, 59, text, global_tid(PID, tid)))

    for root in roots:
        backward = root.name.startswith("autograd::engine::evaluate_function")
        visit(root, AUTOGRAD_TID if backward else MAIN_TID)
    if any(row[6] == ANNOTATION_DOMAIN_ID for row in nvtx if len(row) > 6):
        # the package creates its domain once per process, before the domain's first range
        nvtx.append((999_000, None, 75, domain, global_tid(PID, MAIN_TID), None, ANNOTATION_DOMAIN_ID, None))
    for k in range(orphan_kernels):  # launched before the capture window: no runtime row
        kernels.append((clock[0] + k * 200, clock[0] + k * 200 + 50, 0, 1, 7, 10_000_000 + k, PID << 24,
                        sid("void flopcount_synthetic::orphan_kernel<float>(int)"), sid("orphan_kernel"), 1, 1, 1, 32, 1, 1))
    return nvtx, runtime, kernels, strings


_SCHEMA = """
CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT);
CREATE TABLE ENUM_NSYS_EVENT_TYPE (id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
    category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER,
    domainId INTEGER, uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER,
    int32Value INTEGER, floatValue REAL, jsonTextId INTEGER, jsonText TEXT, binaryData TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL, eventClass INTEGER NOT NULL,
    globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL, returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER NOT NULL,
    contextId INTEGER NOT NULL, streamId INTEGER NOT NULL, correlationId INTEGER, globalPid INTEGER,
    demangledName INTEGER NOT NULL, shortName INTEGER NOT NULL, gridX INTEGER NOT NULL, gridY INTEGER NOT NULL,
    gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL);
"""
_META = [("EXPORT_PRODUCT_NAME", "NVIDIA Nsight Systems"), ("EXPORT_PRODUCT_VERSION", "synthetic"),
         ("EXPORT_SCHEMA_VERSION", "3.25.0"), ("EXPORT_SCHEMA_VERSION_MAJOR", "3"),
         ("EXPORT_SCHEMA_VERSION_MINOR", "25"), ("EXPORT_SCHEMA_VERSION_MICRO", "0"),
         ("GENERATED_BY", "flopcount tests/nvtx_profile_gen.py")]


def write_sqlite(path, nvtx, runtime, kernels, strings, *, tables=None) -> str:
    """Write rows in the Nsight SQLite schema; ``tables`` (a subset of names) leaves the others out."""
    if os.path.exists(path):
        os.unlink(path)
    con = sqlite3.connect(path)
    for stmt in _SCHEMA.strip().split(";"):
        name = stmt.split("TABLE")[1].split("(")[0].strip() if "TABLE" in stmt else None
        if name and (tables is None or name in tables):
            con.execute(stmt)
    have = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
    if "StringIds" in have:
        con.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, s) for s, i in strings.items()])
    if "META_DATA_EXPORT" in have:
        con.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)", _META)
    if "ENUM_NSYS_EVENT_TYPE" in have:
        con.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)",
                        [(59, "NvtxPushPopRange", "NvtxPushPopRange"), (60, "NvtxStartEndRange", "NvtxStartEndRange"),
                         (75, "NvtxDomainCreate", "NvtxDomainCreate")])
    if "NVTX_EVENTS" in have:
        # emit_nvtx's rows are in the default domain (0), inline text
        rows = [tuple(r) + (None, 0, None) if len(r) == 5 else tuple(r) for r in nvtx]
        con.executemany("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId, domainId, color) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in have:
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, ?, ?, ?, NULL)", runtime)
    if "CUPTI_ACTIVITY_KIND_KERNEL" in have:
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", kernels)
    con.commit()
    con.close()
    return path


def generate(model, inputs, path, *, record_shapes=True, orphan_kernels=2, loss_fn=None, cuda=None) -> str:
    """A profile of one training step of ``model``; ``cuda`` ("efficient" or "flash", the attention kernels): as a
    CUDA run records it."""
    roots = record_step(model, inputs, loss_fn=loss_fn)
    if cuda:
        from cuda_style import cuda_style, from_events

        roots = cuda_style(from_events(roots), attention=cuda)
    rows = build_rows(roots, record_shapes=record_shapes, orphan_kernels=orphan_kernels)
    return write_sqlite(path, *rows)


def transformer_block(d: int = 32, heads: int = 4, p: float = 0.1):
    """A pre-norm transformer block (attention through scaled_dot_product_attention, dropout on both residual
    branches, a GELU MLP), its input, and a loss for its output."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.drop = nn.Dropout(p)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)
            x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, n, d)))
            return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    return Block(), torch.randn(2, 8, d), lambda out: out.float().pow(2).mean()


def generate_step(step, path, *, record_shapes=True, orphan_kernels=2) -> str:
    """A profile of ``step()`` as it runs, whatever it does (an optimizer's step included)."""
    rows = build_rows(record(step), record_shapes=record_shapes, orphan_kernels=orphan_kernels)
    return write_sqlite(path, *rows)


def generate_annotated(model, step, path, *, steps: int = 2, record_shapes=True, orphan_kernels=0,
                       emit_nvtx=True) -> str:
    """A profile of ``steps`` calls of ``step()`` (a training step of ``model``) inside
    ``flopcount.recording.nvtx.annotate(model)``: steps, phases and modules marked around the emit_nvtx ranges (left out,
    kernels kept, with ``emit_nvtx=False``: a loop profiled without emit_nvtx)."""
    from flopcount.recording.nvtx import annotate

    def run():
        with annotate(model, domain=MarkingDomain()):
            for _ in range(steps):
                step()

    nvtx, runtime, kernels, strings = build_rows(record(run), record_shapes=record_shapes,
                                                 orphan_kernels=orphan_kernels)
    if not emit_nvtx:
        nvtx = [row for row in nvtx if len(row) > 5]
    return write_sqlite(path, nvtx, runtime, kernels, strings)


def generate_user_ranges(model, step, path, modules, *, domain: Optional[str] = None, prefix: str = "") -> str:
    """A profile of one call of ``step()`` where the user pushed a range named ``prefix`` + each module path in
    ``modules`` around that module's forward (hooks standing in for ``torch.cuda.nvtx.range_push(path)`` /
    ``range_pop()``), on the thread that runs the forward; in the default domain (``domain=None``) or a domain of
    that name."""
    marker = MarkingDomain()
    named = dict(model.named_modules())
    handles = []
    for name in modules:
        handles.append(named[name].register_forward_pre_hook(
            lambda m, a, name=name: marker.push_range((prefix + name, 0))))
        handles.append(named[name].register_forward_hook(lambda m, a, o: marker.pop_range()))
    try:
        rows = build_rows(record(step), orphan_kernels=0, domain=domain)
    finally:
        for h in handles:
            h.remove()
    return write_sqlite(path, *rows)


def main(argv=None):
    import torch
    import torchvision

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a torchvision model, or transformer_block")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--size", type=int, default=64, help="image side")
    p.add_argument("--no-shapes", action="store_true")
    p.add_argument("--cuda", choices=["efficient", "flash"], help="CUDA-style, with these attention kernels")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.model == "transformer_block":
        model, x, loss = transformer_block()
    else:
        model, x, loss = getattr(torchvision.models, a.model)(weights=None), torch.randn(a.batch, 3, a.size, a.size), None
    generate(model, x, a.out, record_shapes=not a.no_shapes, loss_fn=loss, cuda=a.cuda)
    print(a.out)


if __name__ == "__main__":
    main()
