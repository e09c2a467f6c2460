"""Scratch buffers reused between calls.

Allocating a fresh 100 MB tensor costs more than the arithmetic done on it (page faults dominate:
``docs/benchmarks.md``, "Why the kernels look as they do"). Compressors therefore keep their
temporaries here. Payload tensors are never workspace buffers: they must stay valid while they are
in flight, after the next call began.
Buffers belong to the calling thread: the engine compresses in DDP's backward thread while its
executor decompresses the previous bucket, and the two must never share a scratch buffer.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor


class Workspace:
    """Named scratch buffers, grown on demand and kept for reuse.

    Memory cost: the largest request seen for each (name, dtype, device) in each thread that asks,
    for the instance's life. A buffer handed out by :meth:`take` is valid until the same thread's
    next :meth:`take` of the same name.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def _buffers(self) -> dict[tuple[str, torch.dtype, torch.device], Tensor]:
        """This thread's buffers."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        return buffers

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat, uninitialised buffer of ``numel`` elements."""
        slot = (name, dtype, torch.device(device))
        buffers = self._buffers
        buffer = buffers.get(slot)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            buffers[slot] = buffer
        return buffer[:numel]

    def nbytes(self) -> int:
        """Bytes held by this thread's buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Release this thread's buffers."""
        self._buffers.clear()
