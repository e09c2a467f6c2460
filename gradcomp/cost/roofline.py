"""Kernel costs on a device this machine is not: a roofline from the bytes each compressor's kernels move.

Compression kernels are memory-bound: a few operations per element read and written once. On a
device that cannot be timed here (``gradcomp plan --device h100``) a kernel costs the bytes it reads
and writes over the device's memory bandwidth, plus a fixed cost per kernel (the launch, and
PyTorch's dispatch on the host). What the kernels are and what they move is not guessed: the
compressor runs here, on the CPU, on the accelerator's paths (``gradcomp.host.as_accelerator``),
under a ``TorchDispatchMode`` that records every operator with its tensors' sizes (views move
nothing and launch nothing). :func:`kernel_cost` turns that into the planner's
:class:`~gradcomp.cost.kernels.KernelCost` at a few sizes, as :func:`gradcomp.cost.kernels.measure`
does from timings.

A fused kernel (:mod:`gradcomp.compressors.fusion`: the quantizers' and sign's encode and decode)
counts as the one kernel a GPU compiles it to, reading and writing its tensors once.

It is an estimate until calibrated on the device itself: it assumes every kernel streams at the
bandwidth (a selection such as ``torch.topk`` takes several passes on a GPU and counts as one; a
small kernel reaches less), and that kernels do not overlap. Costs: running each spec once per size
on this CPU (a fraction of a second to a few seconds per spec).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradcomp import host
from gradcomp.bench.compressors import gradient
from gradcomp.compressors import fusion, make_compressor, parse_spec
from gradcomp.cost.kernels import KernelCost, Sample, fit, time_tensor

STREAMING = 0.8
"""The share of a device's peak memory bandwidth that streaming kernels reach (copy and triad
kernels reach 80-90% on recent GPUs)."""
SIDES = (64, 256, 1024, 2048)
"""Square matrices the kernels are counted on: 4K to 4.2M elements (beyond, in proportion)."""
FREE_OPS = frozenset(
    {"empty", "empty_strided", "empty_like", "resize_", "set_", "lift_fresh", "_unsafe_view", "_local_scalar_dense"}
)
"""Operators that move no data on the device besides the views (allocation; ``_unsafe_view``, a
view its schema does not mark; a host read is the gate's business)."""


@dataclasses.dataclass(frozen=True)
class Device:
    """What the roofline prices kernels with."""

    name: str
    peak_bandwidth: float
    """Bytes per second of the device's memory, as its maker states it."""
    launch_s: float
    """Seconds per kernel besides its bytes: the launch and PyTorch's dispatch of one operator."""
    description: str

    @property
    def bandwidth(self) -> float:
        return self.peak_bandwidth * STREAMING

    def seconds(self, kernels: int, moved_bytes: float) -> float:
        return kernels * self.launch_s + moved_bytes / self.bandwidth


DEVICES = {
    "h200": Device("h200", 4.8e12, 5e-6, "NVIDIA H200 (HBM3e, 4.8 TB/s)"),
    "h100": Device("h100", 3.35e12, 5e-6, "NVIDIA H100 SXM (HBM3, 3.35 TB/s)"),
    "a100": Device("a100", 2.039e12, 5e-6, "NVIDIA A100 80GB SXM (HBM2e, 2.04 TB/s)"),
    "l4": Device("l4", 300e9, 5e-6, "NVIDIA L4 (GDDR6, 300 GB/s)"),
}
"""The devices ``gradcomp plan --device`` knows (``cpu`` is this machine, timed)."""


@dataclasses.dataclass
class Traffic:
    """What a piece of code asked of the device: kernels launched and bytes read and written."""

    kernels: int = 0
    moved_bytes: int = 0


class _Recorder(TorchDispatchMode):
    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in FREE_OPS:
            return result
        inputs, _ = tree_flatten((args, kwargs or {}))
        outputs, _ = tree_flatten(result)
        touched = {id(t): t for t in (*inputs, *outputs) if isinstance(t, torch.Tensor)}
        self.traffic.kernels += 1
        self.traffic.moved_bytes += sum(t.numel() * t.element_size() for t in touched.values())
        return result


def traffic(run: Callable[[], None], fused: bool = False) -> Traffic:
    """The kernels ``run`` launches and the bytes they move, on an accelerator's paths: its eager
    operators, or with ``fused`` what a device that compiles the fused kernels launches (each one
    kernel reading and writing its tensors once: :func:`gradcomp.compressors.fusion.observing`)."""
    found = Traffic()

    def kernel(_: object, tensors: list[torch.Tensor]) -> None:
        found.kernels += 1
        found.moved_bytes += sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())

    observing = fusion.observing(kernel) if fused else contextlib.nullcontext()
    with host.as_accelerator(), _Recorder(found), observing:
        run()
    return found


def kernel_cost(spec: str, device: Device, sides: tuple[int, ...] = SIDES, seed: int = 0) -> KernelCost:
    """``spec``'s kernels on ``device`` by the roofline, at square matrices of ``sides``."""
    compressor = make_compressor(parse_spec(spec), seed=seed)

    def clock(run: Callable[[], None]) -> float:
        moved = traffic(run, fused=True)  # a GPU compiles the fused kernels (Triton: GRADCOMP_COMPILE=auto)
        return device.seconds(moved.kernels, moved.moved_bytes)

    samples: list[Sample] = []
    for side in sides:
        x = gradient(side * side, seed).view(side, side)
        samples += time_tensor(compressor, x, ("roofline", side), clock=clock)
    return fit(samples)


class RooflineTable:
    """Kernel costs by spec for ``device``, estimated on first use (and remembered): a drop-in for
    :class:`gradcomp.cost.kernels.KernelTable` in the planner."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.known: dict[str, KernelCost] = {}
        self.timed_here: list[str] = []  # nothing is timed: the estimate is counted

    def __call__(self, spec: str) -> KernelCost:
        canonical = str(parse_spec(spec))
        if canonical not in self.known:
            self.known[canonical] = kernel_cost(canonical, self.device)
        return self.known[canonical]
