"""Reads of tensor values on the host: one gate, counted.

On a GPU, reading a tensor's value on the host (a ``bool`` or a number from it, a list of its
values, a ``nonzero`` whose length the host must know) waits until the device has computed it: a
synchronization, which inside a DDP hook (backward's thread) ends the overlap of communication with
backward. Every such read on gradcomp's per-step path goes through this module, so that a step's
reads are counted (``StepStats.host_reads``: the phase of a bucket that made them) and a test can
catch a read that enters the step without it (``tests/host_reads.py``). On the CPU a read costs
nothing more than the conversion; what the count shows is what a GPU would wait for.

Use :func:`flag` for a decision (``if host.flag(torch.isfinite(x).all())``), :func:`values` for
numbers (one read for several: stack them first), :func:`nonzero` for the indices of a mask.

On an accelerator the step decides on the device instead (a masked commit with ``torch.where``, a
range handled by a power-of-two prescale), at the price of work a read could have skipped (the
commit's pass, the prescale's multiplications). On the CPU a read is free (no device to wait for),
and that work is not: code asks :func:`reads_are_free` and on the CPU reads (counted) to skip it,
with :func:`unless` for the common case. Tests prove the accelerator's paths on a CPU under
:func:`as_accelerator`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor


class Counter(Protocol):
    """What counts a phase's reads (a bucket's record)."""

    host_reads: int


_local = threading.local()
"""Per thread: ``counter``, the phase being run (None outside one); ``inside``, True while a read
goes through the gate (what ``tests/host_reads.py`` tells from a read that bypasses it)."""


@contextlib.contextmanager
def counting(counter: Counter) -> Iterator[None]:
    """Count the reads this thread makes meanwhile into ``counter.host_reads``."""
    previous = getattr(_local, "counter", None)
    _local.counter = counter
    try:
        yield
    finally:
        _local.counter = previous


def flag(tensor: Tensor) -> bool:
    """The truth of a one-element tensor (one read)."""
    with _read():
        return bool(tensor)


def values(tensor: Tensor) -> Any:
    """The tensor's values as a (nested) list of Python numbers, or one number for a 0-d tensor (one
    read)."""
    with _read():
        return tensor.tolist()


def nonzero(tensor: Tensor) -> Tensor:
    """The flat indices of the tensor's nonzero elements (one read: their number sizes the result)."""
    with _read():
        return torch.nonzero(tensor).view(-1)


def reads_are_free(device: torch.device) -> bool:
    """Whether a read of a tensor on ``device`` costs no synchronization: True on the CPU (outside
    :func:`as_accelerator`), False on any accelerator."""
    return device.type == "cpu" and not _as_accelerator


def unless(needless: Tensor) -> bool:
    """Whether to do work that ``needless`` (a one-element bool tensor) says would change nothing:
    on the CPU it is read (one read), and the work done only where it is false; on an accelerator
    nothing is read, and the work always done (written so that it changes nothing where
    ``needless`` holds). ``if host.unless(all_ones): x.mul_(scales)``"""
    return not flag(needless) if reads_are_free(needless.device) else True


_as_accelerator = False


@contextlib.contextmanager
def as_accelerator() -> Iterator[None]:
    """Meanwhile, in every thread, CPU tensors take the paths an accelerator's would
    (:func:`reads_are_free` is False): for tests and benchmarks that count reads on a CPU."""
    global _as_accelerator
    previous, _as_accelerator = _as_accelerator, True
    try:
        yield
    finally:
        _as_accelerator = previous


def inside() -> bool:
    """Whether this thread is inside the gate (for ``tests/host_reads.py``)."""
    return getattr(_local, "inside", False)


@contextlib.contextmanager
def _read() -> Iterator[None]:
    counter = getattr(_local, "counter", None)
    if counter is not None:
        counter.host_reads += 1
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = False
