"""Mark a training loop's steps, phases and modules as NVTX ranges (the ``nvtx`` package, domain ``flopcount``).

The loop itself stays as it is::

    with flopcount.recording.nvtx.annotate(model):           # steps are found: forward ... end of the optimizer's step
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    @flopcount.recording.nvtx.annotate(model)                # or: every call of a step function is one step
    def train_step(x, y): ...

The ranges, all push/pop ranges of registered strings in the domain, so that they nest per thread:

* ``step N`` (N counts from 0 per annotator): from the model's forward to the end of the optimizer's step;
* ``forward``, ``backward``, ``optimizer`` inside a step: forward runs from the model's forward (the loss is in
  it, as ``flopcount count`` counts it) to ``backward()``; backward is the ``torch.autograd.backward`` call;
  optimizer is ``Optimizer.step`` (the global step hooks of torch.optim);
* ``forward: PATH`` and ``backward: PATH`` for every module call, PATH dotted from the root (``layer1.0.conv1``),
  the root itself as ``[ClassName]``. A module's backward runs from the first of its autograd nodes to start to
  the next node after its last one (so the engine's gradient accumulation after a node stays with its module,
  where the dispatch counter puts it; the model's own range ends with its last node), on the thread that runs
  the backward: the device's thread on a GPU. A module's nodes are the autograd nodes its call made: the
  sequence numbers autograd gave out between its forward pre and post hooks.

Why the autograd graph and not ``register_full_backward_hook``: full backward hooks pass a module's outputs through
an identity Function, and an in-place op on such an output (``ReLU(inplace=True)`` after a batch norm in every
torchvision ResNet) then raises. Hooks on the graph's nodes change neither values nor the graph.

Without a profiler the nvtx package hands out a no-op domain; the annotator then installs nothing at all, so an
unprofiled run is the plain loop. Nothing here changes a value: hooks only read sequence numbers and the graph.
"""
from __future__ import annotations

import bisect
import functools
import threading
from typing import Callable, List, Optional

import torch
from torch.utils._pytree import tree_leaves

from flopcount.base.errors import FlopcountError
from flopcount.profiles.range_texts import DOMAIN, PHASES, STEP_PREFIX, module_label, module_text, parse_text  # noqa: F401

# ARGB; the nvtx package takes an int as it is
COLORS = {"step": 0xFF8C8C8C, "forward": 0xFF2CA02C, "backward": 0xFFD62728, "optimizer": 0xFF1F77B4}
MODULE_COLORS = {"forward": 0xFF98DF8A, "backward": 0xFFFF9896}

_get_seq = torch._C._autograd._get_sequence_nr


def _import_nvtx():
    try:
        import nvtx
    except ImportError:
        raise FlopcountError('the nvtx package is not installed; install it with: pip install "flopcount[nvtx]"'
                             ) from None
    return nvtx


def resolve_domain(domain="flopcount"):
    """The nvtx package's domain of that name, or None where the package hands out its no-op domain (no profiler
    attached, or NVTX_DISABLE set). Anything that is not a string is taken as a domain object as it is."""
    if not isinstance(domain, str):
        return domain
    nvtx = _import_nvtx()
    d = nvtx.get_domain(domain)
    if not getattr(nvtx, "enabled", lambda: True)() or type(d).__name__ == "DummyDomain":
        return None
    return d


# --- the ranges of one thread -----------------------------------------------------------------------------------
class _Ranges(threading.local):
    def __init__(self):
        self.stack: List[list] = []  # [done, text] per pushed range, innermost last
        self.calls: List["_Call"] = []  # forward module calls open on this thread
        self.task = None  # the backward (graph task) whose end this thread waits for
        self.backward_open: List["_Call"] = []


class _Marker:
    """Pushes and pops the domain's ranges. A range is ended by marking it done; it is popped once every range
    above it on its thread is done too, so the pushes and pops of a thread always nest."""

    def __init__(self, domain):
        self.domain = domain
        self.local = _Ranges()
        self._attrs = {}

    def push(self, text: str, color: int) -> list:
        attrs = self._attrs.get(text)
        if attrs is None:  # the package registers the message once; the attributes are reused
            attrs = self._attrs[text] = self.domain.get_event_attributes(message=text, color=color)
        self.domain.push_range(attrs)
        entry = [False, text]
        self.local.stack.append(entry)
        return entry

    def end(self, entry: Optional[list], now: bool = True) -> None:
        if entry is not None:
            entry[0] = True
            if now:
                self.flush()

    def flush(self) -> None:
        stack = self.local.stack
        while stack and stack[-1][0]:
            stack.pop()
            self.domain.pop_range()

    def close_all(self) -> None:
        for entry in self.local.stack:
            entry[0] = True
        self.flush()


class _Call:
    """One call of a module in a forward with grad: the autograd nodes it made are the sequence numbers
    [s0, s1) (forward ops run on one thread, which numbers nodes in order)."""

    __slots__ = ("label", "s0", "s1", "parent", "members", "chain", "exits", "left", "task", "entry")

    def __init__(self, label, s0, parent):
        self.label, self.s0, self.s1, self.parent = label, s0, s0, parent
        # the outermost call holds every call under it, in the order they began
        self.members = parent.members if parent is not None else []
        self.members.append(self)
        self.chain = None
        self.exits = 0  # its nodes with no edge to another of its nodes: the last of them ends its backward
        self.left, self.task, self.entry = 0, None, None


def _chain(call: _Call) -> tuple:
    if call.chain is None:
        up = _chain(call.parent) if call.parent is not None else ()
        call.chain = up + (call,)
    return call.chain


class _Session:
    """The hooks of one ``with annotate(...)`` (or one decorated call), removed on close."""

    def __init__(self, owner: "annotate", domain, auto_steps: bool):
        self.owner = owner
        self.marker = _Marker(domain)
        self.auto_steps = auto_steps
        self.thread = threading.get_ident()
        self.step = self.phase = None
        self.phase_name = None
        self.backward_seen = self.optimizer_seen = False
        self.handles = []
        self.closed = False
        self._patched = None
        model = owner.model
        if model is not None:
            for path, module in model.named_modules():
                label = module_label(path, module)
                text = module_text("forward", label)
                root = module is model
                self.handles.append(module.register_forward_pre_hook(
                    functools.partial(self._module_pre, label, text, root)))
                self.handles.append(module.register_forward_hook(
                    functools.partial(self._module_post, root), always_call=True))
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self.handles.append(register_optimizer_step_post_hook(self._optimizer_post))
        self._patch_backward()

    # --- steps and phases (the loop's own thread) --------------------------------------------------------------
    def open_step(self) -> None:
        if self.step is None:
            self.step = self.marker.push(f"{STEP_PREFIX}{self.owner.steps}", COLORS["step"])
            self.owner.steps += 1
            self.backward_seen = False

    def close_step(self) -> None:
        self.set_phase(None)
        self.marker.end(self.step)
        self.step = None

    def set_phase(self, name: Optional[str]) -> None:
        if name == self.phase_name:
            return
        self.marker.end(self.phase)
        self.phase, self.phase_name = None, None
        if name is not None and self.step is not None:
            self.phase, self.phase_name = self.marker.push(name, COLORS[name]), name

    def _mine(self) -> bool:
        return threading.get_ident() == self.thread

    def _patch_backward(self) -> None:
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(*args, **kwargs):
            mine = not self.closed and self._mine() and self.step is not None
            if mine:
                self.set_phase("backward")
            try:
                return original(*args, **kwargs)
            finally:
                if mine:
                    self.backward_seen = True
                    if self.phase_name == "backward":
                        self.set_phase(None)

        backward._flopcount_session = self  # lets a later session's close unwind past this one once it is closed
        self._patched = (original, backward)
        torch.autograd.backward = backward

    def _optimizer_pre(self, optimizer, args, kwargs):
        if self._mine():
            self.set_phase("optimizer")

    def _optimizer_post(self, optimizer, args, kwargs):
        if self._mine():
            self.set_phase(None)
            self.optimizer_seen = True
            if self.auto_steps and self.step is not None:
                self.close_step()

    # --- module forward ----------------------------------------------------------------------------------------
    def _module_pre(self, label, text, root, module, args):
        local = self.marker.local
        if root and self._mine():
            # a loop without an optimizer: a step ends where the next forward begins
            if self.auto_steps and self.step is not None and self.backward_seen and not self.optimizer_seen:
                self.close_step()
            if torch.is_grad_enabled():
                if self.auto_steps:
                    self.open_step()
                self.set_phase("forward")
        entry = self.marker.push(text, MODULE_COLORS["forward"])
        call = None
        if torch.is_grad_enabled():
            call = _Call(label, _get_seq(), local.calls[-1][1] if local.calls else None)
        local.calls.append((entry, call))

    def _module_post(self, root, module, args, output):
        local = self.marker.local
        if not local.calls:
            return
        entry, call = local.calls.pop()
        self.marker.end(entry)
        if call is not None:
            call.s1 = _get_seq()
            if call.parent is None:  # the outermost call is over: its graph is complete
                self._arm(call.members, output)

    # --- module backward: hooks on the graph's nodes -----------------------------------------------------------
    def _arm(self, calls: List[_Call], output) -> None:
        calls = [c for c in calls if c.s1 > c.s0]
        if not calls:
            return
        starts = [c.s0 for c in calls]
        lo, hi = calls[0].s0, calls[0].s1

        def innermost(seq):
            c = calls[bisect.bisect_right(starts, seq) - 1]
            while c.s1 <= seq:
                c = c.parent
            return c

        todo = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        while todo:
            node = todo.pop()
            seq = node._sequence_nr()
            if not lo <= seq < hi or seq in seen:  # made outside this call tree, or AccumulateGrad
                continue
            seen.add(seq)
            nexts = [n for n, _ in node.next_functions if n is not None]
            nseq = [n._sequence_nr() for n in nexts]
            chain = _chain(innermost(seq))
            # the calls holding an edge's far end are a prefix of the chain (outermost first): the node is an
            # exit of every call below the longest such prefix
            depth = 0
            for q in nseq:
                if depth and not chain[depth - 1].s0 <= q < chain[depth - 1].s1:
                    continue  # held by fewer calls than an edge already seen
                while depth < len(chain) and chain[depth].s0 <= q < chain[depth].s1:
                    depth += 1
            exits = chain[depth:]
            for c in exits:
                c.exits += 1
            node.register_prehook(functools.partial(self._node_pre, chain))
            if exits:
                node.register_hook(functools.partial(self._node_post, exits))
            todo.extend(n for n, q in zip(nexts, nseq) if lo <= q < hi)

    def _node_pre(self, chain, grad_outputs):
        if self.closed:  # a graph made inside the annotated loop, run backward after it
            return
        local = self.marker.local
        task = torch._C._current_graph_task_id()
        if task != local.task:
            local.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self.marker.flush()  # modules whose last node has run end here, after the engine's accumulation
        for c in chain:
            if c.task != task:
                c.task, c.left = task, c.exits
                c.entry = self.marker.push(module_text("backward", c.label), MODULE_COLORS["backward"])
                local.backward_open.append(c)

    def _node_post(self, exits, grad_inputs, grad_outputs):
        for c in reversed(exits):
            c.left -= 1
            if c.left == 0:
                # the outermost call ends the model's backward at once, on the thread that ran it, without
                # waiting for the engine's final callback (which need not run on this thread)
                self.marker.end(c.entry, now=c.parent is None)

    def _backward_done(self):
        # a module whose nodes did not all run (backward(inputs=...)) ends here
        local = self.marker.local
        for c in local.backward_open:
            self.marker.end(c.entry, now=False)
        local.backward_open = []
        local.task = None
        self.marker.flush()

    def close(self) -> None:
        self.closed = True
        for h in self.handles:
            h.remove()
        self.handles = []
        if self._patched is not None and torch.autograd.backward is self._patched[1]:
            # blocks exited out of order: an earlier-closed session's wrapper may sit below this one; unwind to
            # the first function that is not a closed session's, so nothing stays patched once all are closed
            restored = self._patched[0]
            while getattr(getattr(restored, "_flopcount_session", None), "closed", False):
                restored = restored._flopcount_session._patched_original
            torch.autograd.backward = restored
        if self._patched is not None:
            self._patched_original = self._patched[0]  # a closed wrapper left in place passes calls through
        self._patched = None
        if self.step is not None:
            self.close_step()
        self.marker.close_all()


class annotate:
    """Marks steps, phases and (with ``model``) modules as NVTX ranges in domain ``domain``; see the module text.

    A context manager around a loop (steps are found: a step runs from the model's forward to the end of the
    optimizer's step; in a loop without an optimizer, to the next forward after a backward) or a decorator of a
    step function (each call is one step). ``domain`` is a domain name, or a domain object with the nvtx package's
    interface (``get_event_attributes``, ``push_range``, ``pop_range``), e.g. a recording stand-in.
    ``first_step`` numbers the first step.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, *, domain="flopcount", first_step: int = 0):
        from flopcount.base.api_checks import check_domain, check_int, check_model

        if model is not None:
            check_model(model, "annotate's model")
        check_domain(domain)
        check_int("first_step", first_step, 0)
        self.model = model
        self.domain_spec = domain
        self.steps = first_step
        self._domain = resolve_domain(domain)
        self._sessions: List[_Session] = []

    @property
    def active(self) -> bool:
        """False where no profiler is attached: nothing is installed then."""
        return self._domain is not None

    def __enter__(self):
        if self._domain is not None:
            self._sessions.append(_Session(self, self._domain, auto_steps=True))
        return self

    def __exit__(self, *exc):
        if self._sessions:
            self._sessions.pop().close()
        return False

    def __call__(self, fn: Callable) -> Callable:
        if self._domain is None:
            return fn

        @functools.wraps(fn)
        def step(*args, **kwargs):
            session = _Session(self, self._domain, auto_steps=False)
            try:
                session.open_step()
                if self.model is None:  # no forward hook to start it: the step begins in forward
                    session.set_phase("forward")
                return fn(*args, **kwargs)
            finally:
                session.close()

        return step
