"""The counter: a ``TorchDispatchMode`` that accumulates (module, op, phase, dtype) -> [flops, bytes, calls].

Backward ops are attributed to the module whose forward created the autograd node that runs them: in forward,
every autograd node created while a module is on top of the stack (its sequence number) is tagged with that module,
at each op and at each module's entry and exit; in backward, ``torch._C._current_autograd_node()`` names the node
being run. Gradient accumulation into a parameter goes to the parameter's module.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flopcount import formulas
from flopcount.formulas import per_count
from flopcount.base.errors import reason
from flopcount.base.progress import tick
from flopcount.base.report import COUNTED, UNCOUNTED, ZERO
from flopcount.counting import memo
from flopcount.counting.kernels import call_simulated
from flopcount.counting.known_values import note as note_values
from flopcount.counting.ops import (OpInfo, compute_dtype_ref, cached_dtype_name, tensor_bytes, to_shapes, op_info,
                                    shape_label)

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


class FlopCounter(TorchDispatchMode):
    """Accumulates (module, op, phase, dtype) -> [flops, bytes, calls]."""

    def __init__(self, param_owner: Dict[int, str], simulated_run: bool = False, unwrap: tuple = (),
                 remember: bool = False):
        super().__init__()
        # tensor subclasses counted through the ops they run on their local tensors (DTensor), never as themselves
        self.unwrap = tuple(unwrap)
        self.simulated = simulated_run
        # results and counts of calls on meta tensors, for a count that repeats them (memo.py)
        # one memo per counter: its entries hold counts made by this count's formulas, so that no count reuses
        # another's (one with formulas of its own, one without)
        self.memo = memo.Memo() if remember and simulated_run else None
        # formulas= of the count this counter is built for: they take the table's place for its ops
        self.own_formulas = per_count.current()
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
        self._ops: Dict[int, OpInfo] = {}  # the OpInfos this count has checked
        self._seq_owner: Dict[int, str] = {}
        self._next_seq = _get_sequence_nr()  # the first autograd node not yet tagged
        self._param_owner = param_owner
        self.outputs: Dict[str, str] = {}  # module path -> its first forward call's output (``shape_label``)
        self.called: Dict[str, None] = {"": None}  # module paths whose forward ran (the root is the step's call)

    def record_output(self, module: str, output) -> None:
        """The output of a module's first call only: a module called again (a shared activation, a checkpointed
        layer's recompute in backward) keeps the shape of the call that came first in the forward. Every module
        called is noted in ``called`` (in the order of first calls), whatever it returned."""
        if module not in self.called:
            self.called[module] = None
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

    def _info(self, func) -> OpInfo:
        """What this count knows of ``func``: the process's OpInfo, or a copy with this count's own formula."""
        info = op_info(func)
        own = self.own_formulas.get(info.name) if self.own_formulas else None
        return info if own is None else info.with_formula(own)

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
            info = self._ops[id(func)] = self._info(func)
        if self.simulated and info.same_dtype:
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
                out = call_simulated(func, args, kwargs) if self.simulated and info.routed else func(*args, **kwargs)
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
        acc = self.rows[(module, info.name, phase, dtype, info.family, status)]
        acc[0] += flops
        acc[1] += nbytes
        acc[2] += 1
        self.flops += flops
        self.moved += nbytes
        if self.recording is not None:
            self.recording.append(((info.name, dtype, info.family, status), flops, nbytes,
                                   out_bytes if info.zero != formulas.VIEW else 0))
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

    def _count(self, info: OpInfo, args, kwargs, out) -> tuple:
        """(FLOPs, bytes, the dtype it computes in, status, bytes of its outputs) of one call."""
        ref = compute_dtype_ref(args, out)
        dtype = cached_dtype_name(ref.dtype) if ref is not None else ""
        out_bytes = None

        if info.zero is not None:
            flops, status = 0, ZERO
            if info.zero == formulas.VIEW:
                nbytes = 0
            else:
                out_bytes = tensor_bytes(out)
                nbytes = tensor_bytes(args) + tensor_bytes(kwargs) + out_bytes
        elif info.formula is not None:
            status = COUNTED
            try:
                if info.values:
                    res = info.formula(*args, out_shape=to_shapes(out), **kwargs)
                else:
                    res = info.formula(*to_shapes(args), out_shape=to_shapes(out),
                                       **{k: to_shapes(v) for k, v in kwargs.items()})
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
                out_bytes = tensor_bytes(out)
                nbytes = tensor_bytes(args) + tensor_bytes(kwargs) + out_bytes
        else:
            flops, status = 0, UNCOUNTED
            out_bytes = tensor_bytes(out)
            nbytes = tensor_bytes(args) + tensor_bytes(kwargs) + out_bytes

        if flops and ref is not None and not (ref.dtype.is_floating_point or ref.dtype.is_complex):
            flops = 0  # integer and boolean arithmetic is not floating-point work
        if out_bytes is None:
            out_bytes = 0 if info.zero == formulas.VIEW else tensor_bytes(out)
        return flops, nbytes, dtype, status, out_bytes

