"""Scratch buffers reused between calls.

Allocating a fresh 100 MB tensor costs more than the arithmetic done on it: on the reference
machine ``x.abs()`` on 25M floats takes 51 ms allocating and 9 ms into an existing buffer (page
faults dominate). Compressors therefore keep their temporaries here. Payload tensors are never
workspace buffers: they must stay valid while they are in flight, after the next call began.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Workspace:
    """Named scratch buffers, grown on demand and kept for reuse.

    Memory cost: the largest request seen for each (name, dtype, device), for the instance's life.
    A buffer handed out by :meth:`take` is valid until the next :meth:`take` of the same name.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat, uninitialised buffer of ``numel`` elements."""
        slot = (name, dtype, torch.device(device))
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[slot] = buffer
        return buffer[:numel]

    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()
