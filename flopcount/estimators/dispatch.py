"""The dispatch-level counter: every aten op of a training step, forward and backward, attributed to a module.

How it works, and why:

* A ``TorchDispatchMode`` sees every op below autograd, so backward ops are seen as the ops they really are
  (``convolution_backward`` with its output mask, not a guessed 2 x forward).
* The model runs through ``torch.func.functional_call`` with stand-in parameters and buffers: ``meta`` tensors by
  default (no memory, no compute, so a model too large for this machine can still be counted), or detached views
  of the real ones on a real device. The caller's model is never modified and its weights are never copied.
* Backward ops are attributed to the module whose forward created the autograd node that runs them: in forward,
  every autograd node created while a module is on top of the stack (its sequence number) is tagged with that
  module, at each op and at each module's entry and exit; in backward,
  ``torch._C._current_autograd_node()`` names the node being run. Gradient accumulation into a parameter goes to
  the parameter's module.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from .. import formulas
from ..errors import reason
from ..step import batch_size_of, default_loss, meta_like, module_stack, rebuild_optimizer
from ..report import COUNTED, UNCOUNTED, ZERO, FlopReport
from .base import Capabilities, Request

_get_sequence_nr = torch._C._autograd._get_sequence_nr
_current_node = torch._C._current_autograd_node
_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad nodes carry no sequence number


class _OpInfo:
    __slots__ = ("name", "formula", "zero", "family")

    def __init__(self, func):
        self.name = str(func.overloadpacket)
        self.formula = formulas.lookup(self.name)
        self.zero = formulas.ZERO_FLOP.get(self.name)
        self.family = formulas.op_family(self.name)


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


class _Counter(TorchDispatchMode):
    """Accumulates (module, op, phase, dtype) -> [flops, bytes, calls]."""

    def __init__(self, param_owner: Dict[int, str]):
        super().__init__()
        self.phase = "forward"
        self.stack = [""]
        self.rows: Dict[tuple, list] = defaultdict(lambda: [0, 0, 0])
        self.errors: Dict[str, str] = {}
        self._ops: Dict[Any, _OpInfo] = {}
        self._seq_owner: Dict[int, str] = {}
        self._next_seq = _get_sequence_nr()  # the first autograd node not yet tagged
        self._param_owner = param_owner

    # --- module attribution -------------------------------------------------------------------------------
    def _module_of_node(self, node) -> str:
        if node is None:
            return ""
        seq = node._sequence_nr()
        if seq == _NO_SEQUENCE:  # AccumulateGrad: the parameter's module
            var = getattr(node, "variable", None)
            return self._param_owner.get(id(var), "") if var is not None else ""
        return self._seq_owner.get(seq, "")

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
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = _OpInfo(func)

        phase = self.phase
        if phase == "forward":
            module = self.stack[-1]
            self.claim()
        elif phase == "backward":
            module = self._module_of_node(_current_node())
        else:
            module = ""

        ref = _compute_dtype_ref(args, out)
        dtype = str(ref.dtype).replace("torch.", "") if ref is not None else ""

        if info.zero is not None:
            flops, status = 0, ZERO
            nbytes = 0 if info.zero == formulas.VIEW else _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)
        elif info.formula is not None:
            status = COUNTED
            try:
                res = info.formula(*_to_shapes(args), out_shape=_to_shapes(out), **{k: _to_shapes(v) for k, v in kwargs.items()})
            except Exception as exc:  # a formula that cannot read these arguments must not pass as zero
                self.errors[info.name] = reason(exc)
                res, status = 0, UNCOUNTED
            if isinstance(res, tuple):
                flops = int(res[0])
                nbytes = int(res[1]) * (ref.element_size() if ref is not None else 1)
            else:
                flops = int(res)
                nbytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)
        else:
            flops, status = 0, UNCOUNTED
            nbytes = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)

        if flops and ref is not None and not (ref.dtype.is_floating_point or ref.dtype.is_complex):
            flops = 0  # integer and boolean arithmetic is not floating-point work
        acc = self.rows[(module, info.name, phase, dtype, info.family, status)]
        acc[0] += flops
        acc[1] += nbytes
        acc[2] += 1
        return out


def _fused_sdpa_on_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """Scaled-dot-product attention through the fused CPU kernel, or None where that kernel does not apply."""
    if query.device.type != "meta" or enable_gqa or not (query.dim() == key.dim() == value.dim() == 4):
        return None
    if not query.dtype.is_floating_point or (attn_mask is not None and is_causal):
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


@contextmanager
def _sdpa_as_on_cpu():
    """On meta tensors, run scaled-dot-product attention through the fused CPU kernel, as a CPU run would.

    Without this, the meta backend picks the unfused math path (bmm, softmax, bmm, and a materialised causal
    mask), which is not what runs on a real device. The function is swapped in ``torch.nn.functional`` (where
    ``nn.MultiheadAttention`` looks it up) for the duration of the count; a torch-function mode cannot do it, as
    it does not see calls nested inside ``multi_head_attention_forward``.
    """
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        fused = _fused_sdpa_on_meta(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if fused is not None:
            return fused
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _stand_in(t: torch.Tensor, device: str, is_param: bool, written: bool) -> torch.Tensor:
    if device == "meta":
        s = torch.empty_like(t, device="meta")
    elif is_param and not written:
        s = t.detach()  # shares storage: no copy; gradients land on this new leaf, not on the caller's tensor
    else:
        s = t.detach().clone()  # written in place (batch-norm statistics, an optimizer step): never the caller's
    if is_param and t.requires_grad:
        s.requires_grad_(True)
    return s


def _move_inputs(inputs, device: str):
    if device == "meta":
        return meta_like(inputs)
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, inputs)


def _call(model, params, inputs):
    if isinstance(inputs, dict):
        return torch.func.functional_call(model, params, (), inputs)
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    return torch.func.functional_call(model, params, inputs)


def count_step(
    model: torch.nn.Module,
    inputs,
    *,
    backward: bool = True,
    loss_fn: Optional[Callable] = None,
    device: str = "meta",
    optimizer=None,
    model_name: str = "",
) -> FlopReport:
    """Count one training step (forward, and backward/optimizer when asked) of ``model`` on ``inputs``."""
    device = str(device)
    named_params = dict(model.named_parameters())
    stepped = backward and optimizer is not None
    params = {n: _stand_in(p, device, True, stepped) for n, p in named_params.items()}
    params.update({n: _stand_in(b, device, False, True) for n, b in model.named_buffers()})
    param_owner = {id(params[n]): n.rpartition(".")[0] for n in named_params}
    inputs = _move_inputs(inputs, device)
    opt = rebuild_optimizer(optimizer, params, model) if backward else None

    counter = _Counter(param_owner)
    grad = torch.enable_grad() if backward else torch.no_grad()
    sdpa = _sdpa_as_on_cpu() if device == "meta" else nullcontext()
    with module_stack(model, on_change=counter.claim) as counter.stack, grad, sdpa, counter:
        output = _call(model, params, inputs)
        if backward:
            loss = (loss_fn or default_loss)(output)
            counter.claim()  # the loss's nodes belong to the root
            counter.phase = "backward"
            loss.backward()
            if opt is not None:
                counter.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)

    phases = ["forward"] + (["backward"] if backward else []) + (["optimizer"] if opt is not None else [])
    rows = [
        dict(module=k[0], op=k[1], phase=k[2], dtype=k[3], family=k[4], status=k[5], flops=v[0], bytes=v[1], calls=v[2])
        for k, v in counter.rows.items()
    ]
    notes = [f"formula for {op} failed: {err}" for op, err in counter.errors.items()]
    return FlopReport.from_rows(
        rows, model=model_name or type(model).__name__, batch_size=batch_size_of(inputs, default=None),
        estimator="dispatch", phases=phases, notes=notes, meta={"device": device, "params": _owned_params(model)},
    )


def _owned_params(model: torch.nn.Module) -> Dict[str, int]:
    """Module path -> parameters it owns directly, for every module in model order (a shared parameter counts
    once, at its first path, as ``named_parameters`` lists it)."""
    owned = {name: 0 for name, _ in model.named_modules()}
    for name, p in model.named_parameters():
        owner = name.rpartition(".")[0]
        owned[owner] = owned.get(owner, 0) + p.numel()
    return owned


class DispatchEstimator:
    """flopcount's own counter: every aten op, forward and backward (and optimizer), per module, with bytes."""

    name = "dispatch"
    capabilities = Capabilities(phases=("forward", "backward", "optimizer"), devices=("meta", "cpu", "cuda"),
                                loss_fn=True, real_weights=False)

    def estimate(self, request: Request) -> FlopReport:
        return count_step(request.model, request.inputs, backward=request.backward, loss_fn=request.loss_fn,
                          device=request.device or "meta", optimizer=request.optimizer,
                          model_name=request.model_name)
