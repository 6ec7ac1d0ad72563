"""The dispatch estimator: flopcount's own counting engine (``flopcount.counting``) behind the estimator protocol."""
from __future__ import annotations

from flopcount.base.report import FlopReport
from flopcount.counting import count_step
from flopcount.estimators.base import Capabilities, Request


class DispatchEstimator:
    """flopcount's own counter: every aten op, forward and backward (and optimizer), per module, with bytes."""

    name = "dispatch"
    capabilities = Capabilities(phases=("forward", "backward", "recompute", "optimizer"),
                                devices=("meta", "cpu", "cuda"), loss_fn=True, real_weights=False,
                                kernels=("cpu", "cuda"), formulas=True)

    def estimate(self, request: Request) -> FlopReport:
        """Count the request's step op by op with the dispatch counter."""
        return count_step(request.model, request.inputs, backward=request.backward, loss_fn=request.loss_fn,
                          device=request.device or "meta", optimizer=request.optimizer,
                          model_name=request.model_name, as_device=request.as_device)
