"""Which ops share an argument rule: what a caller that knows only an op's argument sizes (a profile's marker)
must infer for the op's formula, and from what.

Part of the one op table: the profile readers ask here which rule an op follows rather than keep lists of op names
of their own. ``role(packet)`` is one of:

* ``conv``: a convolution; output size from the backward node, or from the recorded stride, padding and
  dilation; groups from the channel counts;
* ``conv_transpose``: a transposed convolution, output size from the backward node;
* ``conv_backward``: ``convolution_backward``, which gradients it computed (``output_mask``);
* ``conv_backward_legacy``: the cuDNN convolution backward ops of PyTorch 1.x (``legacy.py``): which gradients,
  and the weight's size from the forward op;
* ``max_pool``: a max-pool, whose window a marker lacks;
* ``batch_norm`` / ``batch_norm_backward``: training or not, which gradients;
* ``norm_backward``: layer, group and RMS norm backward, which gradients (``output_mask``);
* ``attention``: a fused attention op (its family), whose undefined bias is recorded like a 0-dim tensor;
* ``""``: none of these.
"""
from __future__ import annotations

from flopcount.formulas.registry import FAMILY

ROLE = {}


def _add(role: str, *names: str) -> None:
    for name in names:
        ROLE["aten." + name] = role


_add("conv", "convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution", "miopen_convolution",
     "cudnn_convolution_relu", "cudnn_convolution_add_relu", "miopen_depthwise_convolution")
_add("conv_transpose", "cudnn_convolution_transpose", "miopen_convolution_transpose")
_add("conv_backward", "convolution_backward")
_add("conv_backward_legacy", "cudnn_convolution_backward", "cudnn_convolution_backward_input",
     "cudnn_convolution_backward_weight")
_add("max_pool", *(f"max_pool{d}d{s}" for d in (1, 2, 3) for s in ("", "_with_indices")))
_add("batch_norm", "native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
_add("batch_norm_backward", "native_batch_norm_backward")
_add("norm_backward", "native_layer_norm_backward", "native_group_norm_backward", "_fused_rms_norm_backward")


def role(packet: str) -> str:
    """The argument rule of ``aten.<name>`` (or ``aten::<name>``): a key above, or ``""``."""
    packet = packet.replace("::", ".", 1)
    if not packet.startswith("aten."):
        packet = "aten." + packet
    got = ROLE.get(packet, "")
    if not got and FAMILY.get(packet) == "attention":
        return "attention"
    return got
