"""The tensors a count runs on, in place of the caller's: meta (empty), fake (meta data with a device's dispatch,
so that autocast applies as on that device), or real (detached views of the caller's, copied where the step writes
them), and the model's parameters and buffers swapped for them for the whole step."""
from __future__ import annotations

from typing import Optional

import torch

from flopcount.model.step import meta_like


def autocast_device() -> Optional[str]:
    """The device type whose autocast is on around the count (cpu first), or None."""
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                return dev
        except (TypeError, RuntimeError):  # a torch without per-device autocast queries
            return None
    return None


_META = torch.device("meta")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# (device type, shape, strides, dtype) of a tensor -> the strides ``torch.empty_like(t, device="meta")`` gives it:
# for a meta tensor PyTorch finds them in Python (0.1 ms a tensor, a model's worth per count), while they follow
# from those four alone
_STRIDES: dict = {}
_MOST = 4096


def empty_meta(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(t, device="meta")``, the same tensor made faster for a plain strided one seen before."""
    if type(t) not in _PLAIN or t.layout is not torch.strided or any(getattr(t, "names", None) or ()):
        return torch.empty_like(t, device="meta")
    key = (t.device.type, t.shape, t.stride(), t.dtype)
    strides = _STRIDES.get(key)
    if strides is None:
        m = torch.empty_like(t, device="meta")
        if len(_STRIDES) >= _MOST:
            _STRIDES.clear()
        _STRIDES[key] = m.stride()
        return m
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=_META)


class StandIns:
    """Makes the tensors a count runs on: meta (empty), fake (meta data, a device's dispatch: autocast applies as
    on that device), or real (detached views of the caller's, copied where the step writes them)."""

    def __init__(self, device: str, fake_device: Optional[str] = None):
        self.device = device
        self.mode = None
        if fake_device is not None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            self.mode = FakeTensorMode(allow_non_fake_inputs=True)
            self.fake_device = torch.device(fake_device)

    def _empty(self, t: torch.Tensor) -> torch.Tensor:
        m = empty_meta(t)
        if self.mode is None:
            return m
        from torch._subclasses.fake_tensor import FakeTensor

        return FakeTensor(self.mode, m, self.fake_device)

    def param(self, t: torch.Tensor, is_param: bool, written: bool) -> torch.Tensor:
        """The stand-in of parameter or buffer ``t`` on the count's device (an empty meta tensor on meta)."""
        if self.device == "meta":
            s = self._empty(t)
        elif is_param and not written:
            s = t.detach()  # shares storage: no copy; gradients land on this new leaf, not on the caller's tensor
        else:
            s = t.detach().clone()  # written in place (batch-norm statistics, an optimizer step): never the caller's
        if is_param and t.requires_grad:
            s.requires_grad_(True)
        return s

    def inputs(self, inputs):
        """The inputs as the count takes them: new leaves on the count's device, never the caller's tensors."""
        if self.device != "meta":
            def leaf(x):  # a new leaf: the backward must not accumulate into the caller's tensor's .grad
                if not isinstance(x, torch.Tensor):
                    return x
                t = x.detach().to(self.device)
                return t.requires_grad_(True) if x.requires_grad else t

            return torch.utils._pytree.tree_map(leaf, inputs)
        if self.mode is None:
            return meta_like(inputs)

        def fake(x):
            if not isinstance(x, torch.Tensor):
                return x
            f = self._empty(x)
            return f.requires_grad_(True) if x.requires_grad and f.dtype.is_floating_point else f

        return torch.utils._pytree.tree_map(fake, inputs)


def stand_ins(model, params):
    """The model's parameters and buffers replaced by the stand-ins for the whole step, forward to optimizer (as
    ``functional_call`` does for one call): a reentrant checkpoint re-runs the forward inside backward, and must
    find the stand-ins there too, never the caller's tensors."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(model, params, tie_weights=True)
