"""THE training step: its loss, its optimizer and the step itself, on a batch made by ``inputs`` and a model called
through ``calls``.

The counter (``estimators.dispatch``), the timer (``timing``), ``utilization``, the peers that run the model, the
profile capture and the study all build their step from here, so that the step that is counted is the step that
is timed: the same default loss (cross-entropy against class 0 for ``(N, C)`` logits, else the sum of the
floating-point outputs), the same default optimizer (SGD, lr 0.01), the same input batch.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_leaves, tree_map

from flopcount.base.api_checks import check_loss
from flopcount.base.errors import FlopcountError
from flopcount.model.calls import call_model


# --- inputs ---------------------------------------------------------------------------------------------------------
def _tensors(x) -> List[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def batch_size_of(inputs, default: Optional[int] = 1) -> Optional[int]:
    """The leading dimension of the first tensor with one (a dict's values in order), else ``default``; for a
    detector's ``(images, targets)`` the number of images."""
    first = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else None
    if isinstance(first, (list, tuple)) and first and all(isinstance(t, torch.Tensor) for t in first):
        return len(first)
    for t in _tensors(inputs):
        if t.dim() > 0:
            return int(t.shape[0])
    return default


def meta_like(x):
    """Every tensor in ``x`` as an empty meta tensor of its shape and dtype (``requires_grad`` kept)."""
    def meta(t):
        if not isinstance(t, torch.Tensor):
            return t
        m = torch.empty_like(t, device="meta")
        return m.requires_grad_(True) if t.requires_grad and m.dtype.is_floating_point else m

    return tree_map(meta, x)


def tokens_of(inputs) -> int:
    """Tokens in a batch of a language model: the elements of its token ids (``input_ids`` of a dict, else the
    first 2-d integer tensor: batch x sequence); 0 for any other input."""
    if isinstance(inputs, dict) and isinstance(inputs.get("input_ids"), torch.Tensor):
        return int(inputs["input_ids"].numel())
    for t in _tensors(inputs):
        if t.dim() == 2 and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
            return int(t.numel())
    return 0


def signature(x) -> tuple:
    """(shape, dtype) of every tensor in ``x``: two batches with the same signature cost the same FLOPs."""
    return tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(x))


def split_batch(item) -> Tuple[object, object]:
    """A DataLoader item -> (inputs, target): ``(x, y)`` pairs, dicts (no target) or a bare tensor."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    if isinstance(item, (tuple, list)) and len(item) == 1:
        return item[0], None
    return item, None


def resolve_device(device) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a torch.device that is there to run on, else one line saying why."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise FlopcountError(f"unknown device {str(device)!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FlopcountError(f"device {str(device)!r} is not available here (no CUDA device); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise FlopcountError(f"device {str(device)!r} is not there: {torch.cuda.device_count()} CUDA device(s)")
    return dev




COUNT_SEED = 0


@contextmanager
def seeded(device: str = "cpu", seed: int = COUNT_SEED) -> Iterator[None]:
    """Run a count on a fixed random stream, and give the caller's back untouched. A training step may draw
    random numbers that decide how much work it does (a detector samples its proposals and keypoints), so an
    unseeded count would change from run to run; seeding the caller's global generator instead would change
    what the caller draws next. The CPU's generator is forked, and a CUDA device's when the count runs there."""
    devices = []
    if str(device).startswith("cuda") and torch.cuda.is_available():
        devices = [torch.device(device).index or 0]
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


# --- loss and optimizer ---------------------------------------------------------------------------------------------
def default_loss(output, target=None):
    """The loss of a step when none is given: the model's own loss where its output carries one (``output.loss``,
    as a transformers model given labels returns); cross-entropy for ``(N, C)`` logits (against ``target``, or class
    0: the study's loss); else the sum of every floating-point output (a dict of losses, as torchvision's detection
    models return in training, is summed)."""
    import torch.nn.functional as F

    own = getattr(output, "loss", None)
    if target is None and isinstance(own, torch.Tensor) and own.dtype.is_floating_point:
        return own

    if isinstance(output, torch.Tensor) and output.dim() == 2 and output.dtype.is_floating_point:
        if target is None:
            target = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)
        return F.cross_entropy(output, target.to(output.device))
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
    if not leaves:
        raise FlopcountError("the model returned no floating-point tensor to take a loss of; pass loss_fn=")
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total


def make_loss(loss_fn: Optional[Callable] = None, target=None) -> Callable:
    """A one-argument loss ``output -> scalar``. A given ``target`` follows the output's device (meta while
    counting) and is passed as ``loss_fn(output, target)``."""
    fn = loss_fn or default_loss
    if target is None:
        return fn if loss_fn is not None else (lambda out: default_loss(out))

    def loss(out):
        ref = out if isinstance(out, torch.Tensor) else _tensors(out)[0]
        t = target.to(ref.device) if isinstance(target, torch.Tensor) else target
        return fn(out, t)

    return loss


def default_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # Plain SGD: its step costs the same every time (no lazily created state), so the counted step and the
    # timed steps agree.
    """The step's optimizer when none is given: SGD, learning rate 0.01, over the trainable parameters."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)


def rebuild_optimizer(optimizer, params: dict, model: torch.nn.Module):
    """An optimizer of the caller's class and settings over ``params`` (name -> stand-in tensor) instead of the
    model's own parameters; ``optimizer`` may also be a factory ``params -> optimizer``."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        real_to_name = {id(p): n for n, p in model.named_parameters()}
        groups = []
        for g in optimizer.param_groups:
            group = {k: v for k, v in g.items() if k != "params"}
            group["params"] = [params[real_to_name[id(p)]] for p in g["params"] if id(p) in real_to_name]
            groups.append(group)
        # Each group carries its own settings; pass on only the defaults this constructor takes by name.
        accepted = inspect.signature(type(optimizer)).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return type(optimizer)(groups, **defaults)
    return optimizer([p for p in params.values() if p.requires_grad])


# --- the step -------------------------------------------------------------------------------------------------------
def train_step_fn(model, *, loss: Callable, optimizer=None) -> Callable:
    """``run(inputs)``: forward, loss, backward, optimizer step, zero_grad (without an optimizer, the gradients
    are dropped instead). Nothing reads a value back to the host, so on a GPU the step only queues work."""

    def run(inputs):
        out = call_model(model, inputs)
        value = loss(out)
        check_loss(value)
        value.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        return value

    return run


def make_train_step(model, batch, *, loss_fn=None, optimizer=None, target=None) -> Callable:
    """A zero-argument training step of ``model`` on ``batch`` (already on the model's device).

    ``loss_fn(output)`` or, with ``target``, ``loss_fn(output, target)``; default: ``default_loss``.
    ``optimizer`` defaults to SGD(lr=0.01) over the model's parameters: the step trains the model.
    The step's ``loss`` and ``optimizer`` are attached to it so that a FLOP count can use the same ones.
    """
    loss = make_loss(loss_fn, target)
    optimizer = optimizer if optimizer is not None else default_optimizer(model)
    run = train_step_fn(model, loss=loss, optimizer=optimizer)

    def step():
        return run(batch)

    step.loss = loss
    step.optimizer = optimizer
    return step
