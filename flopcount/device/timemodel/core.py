"""The time of one op on one device, from numbers only (no torch, no pandas): what every caller of the time model
asks.

An op's GPU time is the largest of three terms:

* **compute**: its FLOPs at the achievable share of the matrix (or vector) peak. A matrix product is cut into
  output tiles that run in *waves* over the device's SMs: a wave that is not full takes as long as a full one
  (wave quantisation), and each tile pays a fixed cost, worth ``k_overhead`` steps of its K loop, for loading and
  writing back. The library picks the tile (and a split of K where the tiles are too few to fill the SMs) that
  finishes first; so does the model, among a few standard tile shapes.
* **memory**: its bytes at the achievable share of the bandwidth, with a ramp for small transfers: a transfer of
  ``bandwidth_half_bytes`` reaches half of it (the bytes in flight that cover the memory latency).
* **floor**: the least time of a kernel, per kernel launched (a reduction's kernels, which combine partial
  results across blocks, have a floor of their own).

The host's launch cost runs beside the GPU: in eager mode each kernel costs ``host_launch_s`` on the CPU; a step is
*host-bound* where its launches take longer than its GPU work, and then takes the launches' time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

COMPUTE, MEMORY, LAUNCH, NONE = "compute", "memory", "launch", "-"
# output tile shapes (rows x columns) the matrix libraries choose among (CUTLASS/cuBLAS and rocBLAS kernels are
# named by them: ..._256x128_..., ..._128x64_...): the model takes the one that finishes first
TILES: Tuple[Tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
SPLIT_K_MIN = 256  # the least K a split of K leaves to each part


@dataclass(frozen=True)
class Params:
    """The time model's parameters for one kind of device (fitted, see ``data/time_model.json``)."""

    matrix_efficiency: float  # share of the tensor-core peak a large, well-tiled GEMM reaches
    k_overhead: float  # a tile's fixed cost (prologue, epilogue), in steps of its K loop
    bandwidth_efficiency: float  # share of the datasheet bandwidth a large transfer reaches
    bandwidth_half_bytes: float  # the transfer size that reaches half of that
    kernel_floor_s: float  # the least GPU time of one kernel
    host_launch_s: float  # CPU time to dispatch and launch one kernel in eager mode
    vector_efficiency: float = 0.5  # share of the vector peak an elementwise kernel's arithmetic reaches
    reduction_floor_s: float = 0.0  # the least time of a reduction's kernel (it combines across blocks)
    fma_efficiency: float = 0.0  # the same share for a product on the FMA units (fp32 without TF32); 0: as above
    unaligned_efficiency: float = 0.0  # the tensor-core share where an operand's rows are not 16-byte aligned; 0: same
    matrix_setup_s: float = 0.0  # a product kernel's fixed time: filling its load pipeline, draining its epilogue
    broadcast_efficiency: float = 0.0  # the bandwidth share of an elementwise kernel whose inputs broadcast; 0: same


REDUCING = frozenset({"reduction", "norm", "softmax", "loss"})  # families whose kernels reduce across blocks


def reduces(op: str, family: str) -> bool:
    """Whether an op's kernels reduce across blocks (``REDUCING`` families): a loss's backward does not (each
    element's gradient is its own: ``mse_loss_backward``, ``binary_cross_entropy_with_logits_backward``)."""
    if family == "loss" and str(op).endswith("_backward"):
        return False
    return family in REDUCING


@dataclass(frozen=True)
class Gemm:
    """A (batched) matrix product ``batch x (m x k) @ (k x n)``."""

    m: int
    n: int
    k: int
    batch: int = 1
    element_bytes: int = 4  # of its operands: what decides whether their rows are 16-byte aligned
    rows: str = "mnk"  # which of m, n, k are an operand's row length somewhere (the others count positions)

    @property
    def aligned(self) -> bool:
        """Whether every operand's rows start on 16 bytes (each of ``rows`` a multiple of 16 bytes' worth of
        elements), so that the tensor-core kernels load 16 bytes at a time; otherwise the libraries fall back to
        kernels that load one element at a time (CUTLASS's ``align1``), which reach a smaller share of the peak. A
        plain or transposed product may hold any of ``m``, ``n``, ``k`` as a row; a convolution's implicit GEMM
        only ``n`` (output channels) and ``k`` (input channels x kernel), its ``m`` counting output pixels; an
        attention kernel only the head size ``n``, its ``m`` and ``k`` counting queries and keys."""
        step = max(1, 16 // max(int(self.element_bytes), 1))
        return all(getattr(self, d) % step == 0 for d in self.rows)

    @property
    def flops(self) -> int:
        """The product's FLOPs, 2 m n k per batch entry."""
        return 2 * self.m * self.n * self.k * self.batch


@dataclass(frozen=True)
class Tiling:
    """How a matrix product is cut into output tiles over the SMs, and the time that gives."""

    tile: Tuple[int, int]
    tiles: int  # output tiles, splits of K included
    split_k: int
    waves: float  # tiles / SMs
    seconds: float


def matrix_share(p: Params, fma: bool, aligned: bool = True) -> float:
    """The share of peak a product reaches: on tensor cores (``aligned`` operands or not), or (``fma``) on the FMA
    units, which load one element at a time anyway."""
    if fma and p.fma_efficiency > 0:
        return p.fma_efficiency
    if not aligned and p.unaligned_efficiency > 0:
        return p.unaligned_efficiency
    return p.matrix_efficiency


def tiling(g: Gemm, sms: int, peak: float, p: Params, tiles: Sequence[Tuple[int, int]] = TILES,
           fma: bool = False) -> Tiling:
    """The tile (and split of K) that finishes ``g`` first on ``sms`` SMs of ``peak`` FLOP/s together, and its
    time: ``ceil(waves) x`` the time of one tile, ``2 tm tn (K / split + k_overhead)`` FLOPs at the per-SM share
    of the peak."""
    if sms <= 0 or peak <= 0:
        raise ValueError("a device needs SMs and a peak for the wave model")
    per_sm = peak * matrix_share(p, fma, g.aligned) / sms
    best = None
    for tm, tn in tiles:
        base = math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.batch
        split = 1
        if base < sms and g.k >= 2 * SPLIT_K_MIN:  # too few tiles to fill the device: split K across SMs
            split = max(1, min(sms // base, g.k // SPLIT_K_MIN))
        count = base * split
        waves = count / sms
        seconds = p.matrix_setup_s + math.ceil(waves) * 2.0 * tm * tn * (g.k / split + p.k_overhead) / per_sm
        if best is None or seconds < best.seconds:
            best = Tiling((tm, tn), count, split, waves, seconds)
    return best


@dataclass(frozen=True)
class OpTime:
    """An op's three times: its compute, its memory traffic and its kernels' floor."""

    compute: float
    memory: float
    floor: float

    @property
    def seconds(self) -> float:
        """The op's predicted time: the largest of its three terms."""
        return max(self.compute, self.memory, self.floor)

    @property
    def bound(self) -> str:
        """Which term sets the time (``launch``: the kernel floor); ``-`` for an op that launches nothing."""
        t = self.seconds
        if t <= 0:
            return NONE
        if self.compute >= t:
            return COMPUTE
        return MEMORY if self.memory >= t else LAUNCH


def memory_seconds(nbytes: float, bandwidth: float, p: Params, broadcast: bool = False) -> float:
    """``bytes`` at the achievable bandwidth, ramped for small transfers: ``(bytes + half) / (bw x eff)``; an
    elementwise kernel whose inputs ``broadcast`` (shapes that differ) reaches ``broadcast_efficiency`` instead: it
    computes each element's offsets and cannot load several elements at once."""
    if nbytes <= 0:
        return 0.0
    share = p.broadcast_efficiency if broadcast and p.broadcast_efficiency > 0 else p.bandwidth_efficiency
    return (nbytes + p.bandwidth_half_bytes) / (bandwidth * share)


def op_time(flops: float, nbytes: float, *, peak: float, bandwidth: float, p: Params, kernels: float = 1,
            matrix: bool = False, gemms: Optional[Iterable[Gemm]] = None, sms: Optional[int] = None,
            reducing: bool = False, fma: bool = False, broadcast: bool = False) -> OpTime:
    """The time of one op (or of ``kernels`` launches of it) on a device of ``peak`` FLOP/s (its precision's) and
    ``bandwidth`` bytes/s.

    A matrix op with its products' shapes (``gemms``) and the device's ``sms`` takes the wave model; a matrix op
    without them, its FLOPs at ``matrix_efficiency`` of the peak; any other op, at ``vector_efficiency``. A
    ``reducing`` op (a sum, a norm: ``REDUCING`` families) has one kernel at the reduction floor; an ``fma``
    product (fp32 without TF32, on the FMA units) reaches ``fma_efficiency`` of its peak instead, and a tensor-core
    product whose operands are not 16-byte aligned ``unaligned_efficiency``; a ``broadcast`` elementwise op moves
    its bytes at ``broadcast_efficiency`` of the bandwidth.
    """
    if gemms is not None and sms:
        gemms = list(gemms)
        shaped = sum(g.flops for g in gemms)
        compute = sum(tiling(g, sms, peak, p, fma=fma).seconds for g in gemms)
        if shaped and flops > shaped:  # FLOPs beyond the products (a bias, a softmax): at the plain rate
            compute += (flops - shaped) / (peak * matrix_share(p, fma))
    elif flops > 0:
        compute = flops / (peak * (matrix_share(p, fma) if matrix else p.vector_efficiency))
    else:
        compute = 0.0
    memory = memory_seconds(nbytes, bandwidth, p, broadcast)
    floor = p.kernel_floor_s * kernels if (flops > 0 or nbytes > 0 or kernels) else 0.0
    if reducing and floor:  # one of its kernels combines across blocks; the others (a loss's pieces) are plain
        floor += max(p.reduction_floor_s - p.kernel_floor_s, 0.0)
    return OpTime(compute, memory, floor)


@dataclass(frozen=True)
class Step:
    """A step's GPU time (its ops one after another on one stream) beside its host launch time."""

    gpu_seconds: float
    launches: int
    host_launch_s: float
    mode: str = "eager"

    @property
    def host_seconds(self) -> float:
        """The host's time to launch the step's kernels."""
        return self.launches * self.host_launch_s

    @property
    def seconds(self) -> float:
        """The host launches ahead of the GPU, asynchronously: the step takes the longer of the two."""
        return max(self.gpu_seconds, self.host_seconds)

    @property
    def host_bound(self) -> bool:
        """Whether the host's launches outlast the GPU's work."""
        return self.host_seconds > self.gpu_seconds


MODES = ("eager", "compiled", "graph")


def launches(kernels: int, matrix_kernels: int, mode: str) -> int:
    """Host launches of a step of ``kernels`` kernels: each one in eager mode; under torch.compile the matrix
    kernels and about one fused kernel per two others (Inductor fuses elementwise chains; a conservative ratio);
    one graph launch for a captured CUDA graph."""
    if mode == "eager":
        return int(kernels)
    if mode == "compiled":
        return int(matrix_kernels + math.ceil((kernels - matrix_kernels) / 2))
    if mode == "graph":
        return 1 if kernels else 0
    raise ValueError(f"unknown launch mode {mode!r}; expected one of {', '.join(MODES)}")
