"""The dispatch-level counter: every aten op of a training step, forward and backward, attributed to a module.

How it works, and why:

* A ``TorchDispatchMode`` sees every op below autograd, so backward ops are seen as the ops they really are
  (``convolution_backward`` with its output mask, not a guessed 2 x forward).
* The model runs with stand-in parameters and buffers for the whole step (``stand_ins.py``): ``meta`` tensors by
  default (no memory, no compute, so a model too large for this machine can still be counted), or detached views
  of the real ones on a real device. The caller's model is never modified and its weights are never copied.
* Backward ops are attributed to the module whose forward created the autograd node that runs them: in forward,
  every autograd node created while a module is on top of the stack (its sequence number) is tagged with that
  module, at each op and at each module's entry and exit; in backward,
  ``torch._C._current_autograd_node()`` names the node being run. Gradient accumulation into a parameter goes to
  the parameter's module.
* On meta tensors, ops whose kernel is chosen at run time (attention, the CPU's LSTM) are routed as a real run on
  the target device would route them (``as_device``, ``kernels.py``); autocast around the count is honoured by
  running on fake tensors of the autocast's device type, where its casts apply as on that device.
* A forward that needs tensor values fails on meta; the step is then counted on the CPU with real tensors, said in
  one line on stderr and in the report's notes (``fallback.py``).
* A sharded model (FSDP2, tensor parallel: ``flopcount.distributed``) runs as it is (``AsGiven``), since its hooks
  swap its parameters during the step; DTensor ops are let through to DTensor, which unwraps them and runs its
  local ops, counted here; ops run inside ``aside()`` are not ops of the step.
"""
from __future__ import annotations

import sys
import threading
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import formulas
from ..errors import reason
from ..api_checks import check_loss
from ..progress import tick
from ..step import (batch_size_of, call_model, default_loss, module_stack, preserved, random_on,
                    rebuild_optimizer, seeded)
from ..report import COUNTED, UNCOUNTED, ZERO, FlopReport
from .base import Capabilities, Request
from . import fallback
from .kernels import call_simulated, kernels_as
from .known_values import follows as follows_values, known_values, note as note_values
from . import memo
from .stand_ins import StandIns, autocast_device, stand_ins

# matrix products and convolutions whose real kernels require one dtype for every operand (below autocast, which
# has already cast them where it is on)
_SAME_DTYPE = frozenset(getattr(torch.ops.aten, n) for n in ("mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot",
                                                                "convolution"))
_get_sequence_nr = torch._C._autograd._get_sequence_nr
_current_node = torch._C._current_autograd_node
_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad nodes carry no sequence number
_aside = threading.local()


@contextmanager
def aside():
    """Ops run inside this block are not ops of the step and are not counted (DTensor runs each op once more on
    fake tensors of the global shapes, only to learn its output's shape)."""
    _aside.depth = getattr(_aside, "depth", 0) + 1
    try:
        yield
    finally:
        _aside.depth -= 1
# phases whose ops belong to the module running them (backward ops to the module of their autograd node; the
# optimizer's to the root): a training step's forward and its recompute, a generation's prefill and decode
FORWARD_PHASES = ("forward", "recompute", "prefill", "decode")


class _OpInfo:
    __slots__ = ("name", "formula", "zero", "family", "values", "hidden", "memo", "noted")

    def __init__(self, func):
        self.name = str(func.overloadpacket)
        self.formula = formulas.lookup(self.name)
        self.zero = formulas.ZERO_FLOP.get(self.name)
        self.family = formulas.op_family(self.name)
        self.values = self.name in formulas.VALUES
        # fake tensors answer ``.device`` through prim ops: bookkeeping of the simulation, not ops of the step
        self.hidden = self.name.startswith("prim.")
        self.memo = memo.kind(func)
        self.noted = follows_values(func)


def _to_shapes(x):
    """Tensors -> their torch.Size, at any depth (foreach ops take lists of tensors); everything else as is."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        if any(isinstance(e, (torch.Tensor, list, tuple)) for e in x):
            return type(x)(_to_shapes(e) for e in x)
    return x


def _compute_dtype_ref(args, out) -> Optional[torch.Tensor]:
    """The tensor whose dtype the op computes in: its first floating input (``where(cond, a, b)`` computes in
    a's dtype, not cond's; a float comparison yields bools but is float work), else any input, else the output."""
    first = None
    for a in args:
        t = _first_tensor(a)
        if t is not None:
            if t.dtype.is_floating_point or t.dtype.is_complex:
                return t
            if first is None:
                first = t
    return first if first is not None else _first_tensor(out)


_DTYPE_NAMES: Dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(e) for e in x)
    return 0


def _first_tensor(x) -> Optional[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for e in x:
            t = _first_tensor(e)
            if t is not None:
                return t
    return None


def _tensors_in(x, found: list) -> list:
    """Every tensor in ``x`` (a tensor, or tuples, lists and dicts of them at any depth, a transformers
    ``ModelOutput`` among them), in order."""
    if isinstance(x, torch.Tensor):
        found.append(x)
    elif isinstance(x, (list, tuple)):
        for e in x:
            _tensors_in(e, found)
    elif isinstance(x, dict):
        for e in x.values():
            _tensors_in(e, found)
    return found


def shape_label(output) -> str:
    """A module's output as the module tree shows it: one tensor's shape ``64x256x56x56`` (``scalar`` for a
    0-d tensor); a tuple, list or dict of tensors: its first tensor's shape and how many more follow
    (``8x20x64 (+2)``, an LSTM's output and its (h, c)); no tensor at all: ``""``."""
    tensors = _tensors_in(output, [])
    if not tensors:
        return ""
    first = "x".join(str(int(d)) for d in tensors[0].shape) or "scalar"
    return first if len(tensors) == 1 else f"{first} (+{len(tensors) - 1})"


class _Counter(TorchDispatchMode):
    """Accumulates (module, op, phase, dtype) -> [flops, bytes, calls]."""

    def __init__(self, param_owner: Dict[int, str], simulated_run: bool = False, unwrap: tuple = (),
                 remember: bool = False):
        super().__init__()
        # tensor subclasses counted through the ops they run on their local tensors (DTensor), never as themselves
        self.unwrap = tuple(unwrap)
        self.simulated = simulated_run
        # results and counts of calls on meta tensors, for a count that repeats them (memo.py)
        self.memo = memo.Memo() if remember and simulated_run else None
        self.recording: Optional[list] = None  # the accounting of each op, while a module's call is recorded
        self.graph = True  # autograd nodes are made (grad mode on), whose modules backward ops are attributed to
        self.needs_values: Optional[str] = None  # the op that needed values a simulated run lacks
        self.written = 0  # bytes written by forward ops (the memory estimate of a fallback reads it)
        self.flops = self.moved = 0  # FLOPs and bytes of every op so far (a caller reads them between its steps)
        self.phase = "forward"
        self.stack = [""]
        self.checkpointing: set = set()  # modules that checkpoint their forward (transformers layers)
        self.rows: Dict[tuple, list] = defaultdict(lambda: [0, 0, 0])
        self.errors: Dict[str, str] = {}
        self._ops: Dict[Any, _OpInfo] = {}
        self._seq_owner: Dict[int, str] = {}
        self._next_seq = _get_sequence_nr()  # the first autograd node not yet tagged
        self._param_owner = param_owner
        self.outputs: Dict[str, str] = {}  # module path -> its first forward call's output (``shape_label``)

    def record_output(self, module: str, output) -> None:
        """The output of a module's first call only: a module called again (a shared activation, a checkpointed
        layer's recompute in backward) keeps the shape of the call that came first in the forward."""
        if module not in self.outputs and output is not None:
            self.outputs[module] = shape_label(output)

    # --- module attribution -------------------------------------------------------------------------------
    def _module_of_node(self, node) -> str:
        if node is None:
            return ""
        seq = node._sequence_nr()
        if seq == _NO_SEQUENCE:  # AccumulateGrad: the parameter's module
            var = getattr(node, "variable", None)
            return self._param_owner.get(id(var), "") if var is not None else ""
        return self._seq_owner.get(seq, "")

    def _recomputed_module(self, default: str) -> str:
        """The module of an op a checkpoint re-runs outside every module's hooks. (transformers checkpoints a
        layer's ``forward``, not its call, so that the layer's hooks do not run twice: its own ops, the residual
        adds, re-run with no module entered.) A reentrant checkpoint's node was made by the module that called it;
        a non-reentrant recompute is started by whichever saved tensor is unpacked first, a node of some module
        inside the checkpointed one, which is then the nearest around it that says it checkpoints
        (``gradient_checkpointing``, as transformers' layers do)."""
        node = _current_node()
        if node is None:
            return default
        owner = self._module_of_node(node)
        if node.name() == "CheckpointFunctionBackward":
            return owner or default
        while owner:
            if owner in self.checkpointing:
                return owner
            owner = owner.rpartition(".")[0]
        return default

    def claim(self) -> None:
        """Tag every autograd node made since the last claim with the module on top of the stack.

        Called before each forward op (an op's node is made just before the op reaches the mode; an in-place op
        makes its node before the clone it saves) and at each module's entry and exit (a custom autograd
        Function makes its node after its ops ran, still inside its module).
        """
        end = _get_sequence_nr()
        if end > self._next_seq:
            module = self.stack[-1]
            for seq in range(self._next_seq, end):
                self._seq_owner[seq] = module
            self._next_seq = end

    # --- the hook -----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(_aside, "depth", 0):
            return func(*args, **(kwargs or {}))
        if self.unwrap and any(issubclass(t, self.unwrap) for t in types):
            return NotImplemented  # the subclass unwraps and runs its local ops, which come back here
        kwargs = kwargs or {}
        tick()
        info = self._ops.get(id(func))  # an op lives as long as the process; its id hashes faster than the op
        if info is None:
            info = self._ops[id(func)] = _OpInfo(func)
        if self.simulated and func.overloadpacket in _SAME_DTYPE:
            kinds = {a.dtype for a in args if isinstance(a, torch.Tensor)}
            if len(kinds) > 1:  # the CPU and CUDA kernels refuse this; the meta kernels let it through
                raise RuntimeError(f"{info.name}: operands of different dtypes "
                                   f"({', '.join(sorted(str(k).replace('torch.', '') for k in kinds))}); a real run "
                                   "refuses them (convert the input to the model's dtype, or use autocast)")
        key = known = None
        if self.memo is not None and info.memo is not None:
            key = memo.key(func, args, kwargs)
            known = self.memo.entries.get(key) if key is not None else None
        if known is not None:
            self.memo.hits += 1
            out = known.make(args)
        else:
            try:
                out = call_simulated(func, args, kwargs) if self.simulated else func(*args, **kwargs)
            except Exception:
                if self.simulated:
                    self.needs_values = info.name
                raise
        if self.simulated and info.noted:
            note_values(func, args, kwargs, out)
        if info.hidden:
            return out

        phase = self.phase
        if phase == "backward" and torch.is_grad_enabled() and _current_node() is not None:
            # The engine runs a node's backward ops with grad mode off; an op that runs with it on while a node is
            # being run is a forward op re-run by activation checkpointing (reentrant or not), inside its
            # module's hooks again. (Before the engine starts, the seed gradient is made with grad mode on.)
            phase = "recompute"
        if phase in FORWARD_PHASES:
            module = self.stack[-1]
            if phase == "recompute" and len(self.stack) == 1:
                module = self._recomputed_module(module)
            if self.graph:
                self.claim()
        elif phase == "backward":
            module = self._module_of_node(_current_node())
        else:
            module = ""

        if known is not None:
            flops, nbytes, dtype, status, out_bytes = known.count
        else:
            flops, nbytes, dtype, status, out_bytes = self._count(info, args, kwargs, out)
            if key is not None:
                made = memo.entry(info.memo, out, (flops, nbytes, dtype, status, out_bytes))
                if made is not None:
                    self.memo.entries[key] = made
                    self.memo.misses += 1
        if phase == "forward" and info.zero != formulas.VIEW:
            self.written += out_bytes
        row = (info.name, dtype, info.family, status)
        acc = self.rows[(module,) + row[:1] + (phase,) + row[1:]]
        acc[0] += flops
        acc[1] += nbytes
        acc[2] += 1
        self.flops += flops
        self.moved += nbytes
        if self.recording is not None:
            self.recording.append((row, flops, nbytes, out_bytes if info.zero != formulas.VIEW else 0))
        return out

    # --- replayed modules (memo.linears_replayed) ---------------------------------------------------------------
    def record(self, stop: bool = False) -> Optional[list]:
        """Start keeping each op's accounting in a list (returned), or stop."""
        self.recording = None if stop else []
        return self.recording

    def replay(self, ops: list) -> None:
        """Count recorded ops again, as ops of the module now running in the current phase."""
        module, phase = self.stack[-1], self.phase
        rows = self.rows
        for (name, dtype, family, status), flops, nbytes, out_bytes in ops:
            acc = rows[(module, name, phase, dtype, family, status)]
            acc[0] += flops
            acc[1] += nbytes
            acc[2] += 1
            self.flops += flops
            self.moved += nbytes
            if phase == "forward":
                self.written += out_bytes
        if self.memo is not None:
            self.memo.hits += len(ops)

    def _count(self, info: _OpInfo, args, kwargs, out) -> tuple:
        """(FLOPs, bytes, the dtype it computes in, status, bytes of its outputs) of one call."""
        ref = _compute_dtype_ref(args, out)
        dtype = _dtype_name(ref.dtype) if ref is not None else ""
        out_bytes = None

        if info.zero is not None:
            flops, status = 0, ZERO
            if info.zero == formulas.VIEW:
                nbytes = 0
            else:
                out_bytes = _tensor_bytes(out)
                nbytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + out_bytes
        elif info.formula is not None:
            status = COUNTED
            try:
                if info.values:
                    res = info.formula(*args, out_shape=_to_shapes(out), **kwargs)
                else:
                    res = info.formula(*_to_shapes(args), out_shape=_to_shapes(out),
                                       **{k: _to_shapes(v) for k, v in kwargs.items()})
            except formulas.NeedsValues:
                if self.simulated:
                    self.needs_values = info.name
                    raise
                self.errors[info.name] = "needs tensor values"
                res, status = 0, UNCOUNTED
            except Exception as exc:  # a formula that cannot read these arguments must not pass as zero
                self.errors[info.name] = reason(exc)
                res, status = 0, UNCOUNTED
            if isinstance(res, tuple):
                flops = int(res[0])
                # elements may be a Fraction (a collective's ring share): bytes are whole
                nbytes = int(res[1] * (ref.element_size() if ref is not None else 1))
            else:
                flops = int(res)
                out_bytes = _tensor_bytes(out)
                nbytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + out_bytes
        else:
            flops, status = 0, UNCOUNTED
            out_bytes = _tensor_bytes(out)
            nbytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + out_bytes

        if flops and ref is not None and not (ref.dtype.is_floating_point or ref.dtype.is_complex):
            flops = 0  # integer and boolean arithmetic is not floating-point work
        if out_bytes is None:
            out_bytes = 0 if info.zero == formulas.VIEW else _tensor_bytes(out)
        return flops, nbytes, dtype, status, out_bytes


@contextmanager
def counting(model, inputs=None, *, device: str = "meta", as_device: str = "cpu", grad: bool = False,
             optimizer=None, optimizer_model=None, remember: bool = False, state: Optional[dict] = None,
             given: Optional["AsGiven"] = None):
    """The counter around whatever runs inside: ``model``'s parameters and buffers swapped for stand-ins (meta, or
    views of the real ones on ``device``), kernels chosen as on ``as_device``, every module's ops attributed to it.
    Yields (counter, stand-in inputs); set ``counter.phase`` to name the phase of the ops that follow, and read
    them with ``rows_of(counter)``. ``optimizer`` (with ``grad``) is rebuilt over the stand-ins as
    ``counter.optimizer``. ``remember``: remember the result of each call on meta tensors for the next call like
    it (memo.py), for a count that repeats its calls (a generation's decode steps). ``given`` (an ``AsGiven``):
    the model and inputs run as they are instead of on stand-ins."""
    if given is None:
        fake_device = autocast_device() if device == "meta" else None
        make = StandIns(device, fake_device)
        named_params = dict(model.named_parameters())
        stepped = grad and optimizer is not None
        params = {n: make.param(p, True, stepped) for n, p in named_params.items()}
        params.update({n: make.param(b, False, True) for n, b in model.named_buffers()})
        param_owner = {id(params[n]): n.rpartition(".")[0] for n in named_params}
        inputs = make.inputs(inputs)
        mode, unwrap = make.mode, ()
    else:
        fake_device, params = None, None
        param_owner = {id(p): n.rpartition(".")[0] for n, p in model.named_parameters()}
        mode, unwrap = given.mode, given.unwrap
    counter = _Counter(param_owner, simulated_run=device == "meta", unwrap=unwrap,
                       remember=remember and fake_device is None and given is None)
    counter.checkpointing = {n for n, m in model.named_modules()
                             if n and getattr(m, "gradient_checkpointing", False) is True}
    if not grad:
        counter.optimizer = None
    elif given is not None:
        counter.optimizer = optimizer
    else:
        counter.optimizer = rebuild_optimizer(optimizer, params, optimizer_model or model)
    if state is not None:
        state["counter"] = counter
    with ExitStack() as stack:
        if mode is not None:
            stack.enter_context(mode)
        if device == "meta":
            stack.enter_context(kernels_as(as_device))
            stack.enter_context(known_values())
        counter.graph = grad  # without grad no autograd node is made: none to tag with its module
        counter.stack = stack.enter_context(module_stack(model, on_change=counter.claim if grad else None,
                                                         on_output=counter.record_output))
        if counter.memo is not None:
            stack.enter_context(memo.linears_replayed(model, counter))
        if params is not None:
            stack.enter_context(stand_ins(model, params))
        stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
        stack.enter_context(counter)
        yield counter, inputs


def rows_of(counter: _Counter) -> list:
    """The counter's rows as records: module, op, phase, dtype, family, status, flops, bytes, calls."""
    return [dict(module=k[0], op=k[1], phase=k[2], dtype=k[3], family=k[4], status=k[5], flops=v[0], bytes=v[1],
                 calls=v[2]) for k, v in counter.rows.items()]


def _run(model, inputs, *, backward, loss_fn, device, optimizer, as_device, optimizer_model=None, state=None,
         given=None):
    """One count of the step; returns (counter, phases, notes, stand-in inputs). ``state["counter"]`` keeps the
    counter for a caller that needs to read it after the run raised. ``given`` (an ``AsGiven``): run the model
    and inputs as they are instead of on stand-ins."""
    fake_device = autocast_device() if device == "meta" and given is None else None
    notes = []
    phases = ["forward"] + (["backward"] if backward else [])
    with counting(model, inputs, device=device, as_device=as_device, grad=backward, optimizer=optimizer,
                  optimizer_model=optimizer_model, state=state, given=given) as (counter, inputs):
        opt = counter.optimizer
        output = call_model(model, inputs)
        counter.record_output("", output)  # the root is not hooked: its output is what the call returned
        if backward:
            loss = (loss_fn or default_loss)(output)
            check_loss(loss, "loss_fn" if loss_fn is not None else "the default loss")
            counter.claim()  # the loss's nodes belong to the root
            counter.phase = "backward"
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
                if any(k[2] == "recompute" for k in counter.rows):
                    phases.append("recompute")
            else:  # a parameter-free model on inputs that need no gradient: there is nothing to differentiate
                notes.append("nothing in the step requires a gradient: its backward computes nothing")
                opt = None
            if opt is not None:
                counter.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
                phases.append("optimizer")
    if fake_device is not None:
        notes.append(f"autocast on {fake_device}: counted on fake {fake_device} tensors, so that its casts apply")
    return counter, phases, notes, inputs


class AsGiven:
    """Count a model as it is (no stand-ins): a model the caller sharded (FSDP2, tensor parallel), whose
    parameters its hooks swap during the step. ``mode``: a fake-tensor mode the step runs under (its tensors made
    there); ``unwrap``: tensor subclasses counted through the local ops they run (DTensor)."""

    def __init__(self, mode=None, unwrap: tuple = ()):
        self.mode = mode
        self.unwrap = tuple(unwrap)


def count_step(
    model: torch.nn.Module,
    inputs,
    *,
    backward: bool = True,
    loss_fn: Optional[Callable] = None,
    device: str = "meta",
    optimizer=None,
    model_name: str = "",
    as_device: str = "cpu",
    fallback_to_cpu: bool = True,
    given: Optional[AsGiven] = None,
) -> FlopReport:
    """Count one training step (forward, and backward/optimizer when asked) of ``model`` on ``inputs``.

    On meta (the default), ops with run-time kernel choices take the kernel ``as_device`` ("cpu" or "cuda") would;
    a forward that needs tensor values is counted on the CPU instead (``fallback_to_cpu``), or fails in one line.
    The caller's model is given back unchanged (``step.preserved``), except with ``given`` (``AsGiven``): the
    model then runs as it is, on its own parameters and the inputs as passed (no stand-ins, no fallback). The
    count is the same on every run: the step draws its random numbers from a fixed seed on a fork of torch's
    generator (``step.seeded``).
    """
    device = str(device)
    name = model_name or type(model).__name__
    meta_extra = {"device": device}
    with seeded(device):
        if given is not None:
            counter, phases, notes, used = _run(model, inputs, backward=backward, loss_fn=loss_fn, device=device,
                                                optimizer=optimizer, as_device=as_device, given=given)
            if device == "meta":
                meta_extra["as"] = as_device
        else:
            with preserved(model):
                counter, phases, notes, used, meta_extra = _run_protected(
                    model, inputs, name, backward=backward, loss_fn=loss_fn, device=device, optimizer=optimizer,
                    as_device=as_device, fallback_to_cpu=fallback_to_cpu)

    rows = rows_of(counter)
    notes = notes + [f"formula for {op} failed: {err}" for op, err in counter.errors.items()]
    return FlopReport.from_rows(
        rows, model=name, batch_size=batch_size_of(used, default=None),
        estimator="dispatch", phases=phases, notes=notes, meta={**meta_extra, "params": owned_params(model),
                                                                "module_types": _module_types(model),
                                                                "module_outputs": dict(counter.outputs),
                                                                **_tied(model)},
    )


def _run_protected(model, inputs, name, *, backward, loss_fn, device, optimizer, as_device, fallback_to_cpu):
    """The step on stand-ins, on meta with the CPU fallback where its forward needs values."""
    meta_extra = {"device": device}
    if device != "meta":
        counter, phases, notes, used = _run(model, inputs, backward=backward, loss_fn=loss_fn, device=device,
                                            optimizer=optimizer, as_device=as_device)
    else:
        meta_extra["as"] = as_device
        needed, state = None, {}
        try:
            # undone before a fallback: a module that cached meta tensors on itself (an eval-mode detector's
            # anchors) would hand them to the CPU run
            with preserved(model):
                counter, phases, notes, used = _run(model, inputs, backward=backward, loss_fn=loss_fn,
                                                    device="meta", optimizer=optimizer, as_device=as_device,
                                                    state=state)
        except Exception as exc:
            failed = state.get("counter")
            needed = fallback.meta_limit(exc, failed.needs_values if failed is not None else None)
            if needed is None or not fallback_to_cpu:
                raise
            written = failed.written if failed is not None else 0
        if needed is not None:
            counter, phases, notes, used = _on_cpu(model, inputs, name, needed, written, backward=backward,
                                                   loss_fn=loss_fn, optimizer=optimizer, as_device=as_device)
            meta_extra = {"device": "cpu", "fallback": needed}
    return counter, phases, notes, used, meta_extra


def _on_cpu(model, inputs, name, needed, written, **step):
    """The step again on the CPU with real tensors, where the memory it needs is there."""
    need = fallback.step_bytes(model, inputs, written, step["backward"])
    free = fallback.available_bytes()
    why = f"its forward needs tensor values ({needed}), which meta tensors do not have"
    if free and need > free:
        raise fallback.NeedsRealTensors(
            f"{name}: {why}; counting it on the CPU needs about {fallback.gib(need)} and {fallback.gib(free)} is "
            "available: count it with --device cpu (device='cpu') on a machine with the memory")
    real = fallback.real_model(model)
    values = random_on(inputs, "cpu", generator=torch.Generator().manual_seed(0))
    note = f"counted on the CPU with real tensors: {why}"
    print(f"flopcount: {note}", file=sys.stderr)
    with preserved(real):
        counter, phases, notes, used = _run(real, values, device="cpu", optimizer_model=model, **step)
    return counter, phases, [note] + notes, used


def owned_params(model: torch.nn.Module) -> Dict[str, int]:
    """Module path -> parameters it owns directly, for every module in model order (a shared parameter counts
    once, at its first path, as ``named_parameters`` lists it)."""
    owned = {name: 0 for name, _ in model.named_modules()}
    for name, p in model.named_parameters():
        owner = name.rpartition(".")[0]
        owned[owner] = owned.get(owner, 0) + p.numel()
    return owned


def _module_types(model: torch.nn.Module) -> Dict[str, str]:
    """Module path -> its class name (``Conv2d``, ``LlamaDecoderLayer``), for the module tree."""
    return {name: type(m).__name__ for name, m in model.named_modules()}


def _tied(model: torch.nn.Module) -> Dict[str, Dict[str, str]]:
    """``{"tied": {...}}``, or nothing for a model without tied parameters: parameter path -> the path it is
    counted under, for each parameter that is another one (a language model's output layer sharing the input
    embedding's weight): counted once, at its first path, so its module would show 0 parameters without saying
    why."""
    first: Dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return {"tied": tied} if tied else {}


class DispatchEstimator:
    """flopcount's own counter: every aten op, forward and backward (and optimizer), per module, with bytes."""

    name = "dispatch"
    capabilities = Capabilities(phases=("forward", "backward", "recompute", "optimizer"), devices=("meta", "cpu", "cuda"),
                                loss_fn=True, real_weights=False, kernels=("cpu", "cuda"))

    def estimate(self, request: Request) -> FlopReport:
        return count_step(request.model, request.inputs, backward=request.backward, loss_fn=request.loss_fn,
                          device=request.device or "meta", optimizer=request.optimizer,
                          model_name=request.model_name, as_device=request.as_device)
