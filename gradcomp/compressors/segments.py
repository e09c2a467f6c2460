"""The tensors of a part of a flat buffer, as one call of a compressor takes them.

The engine compresses a bucket part by part (its plan's parts: :mod:`gradcomp.engine.plan`), and
hands a compressor all the tensors of a part at once (``Compressor.compress_part`` and the
methods beside it) as :class:`Segments`: where each tensor lies in the buffer, its shape, and the key
of its state. A compressor may compress them one by one (the default) or in a few kernels for the
whole part, keeping each tensor's own semantics (its chunks, scales, k and state).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Segments:
    """Tensors of a flat buffer: their offsets (elements), shapes and state keys, in order."""

    offsets: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    keys: tuple[Hashable, ...]
    """Each tensor's state key; None for a run of an element-wise, stateless compressor's elements."""

    def __post_init__(self) -> None:
        if not len(self.offsets) == len(self.shapes) == len(self.keys):
            raise ValueError(f"{len(self.offsets)} offsets, {len(self.shapes)} shapes and {len(self.keys)} keys")

    def __len__(self) -> int:
        return len(self.offsets)

    def views(self, buffer: Tensor) -> list[Tensor]:
        """Each tensor as a view of ``buffer`` (flat), in its shape."""
        return [
            buffer[offset : offset + math.prod(shape)].view(shape)
            for offset, shape in zip(self.offsets, self.shapes, strict=True)
        ]


@functools.lru_cache(maxsize=256)
def end_to_end(segments: Segments) -> tuple[int, int] | None:
    """Where a part's tensors lie in its buffer, (start, stop), when they lie end to end in order
    (as the plan cuts a bucket's parts, but for a per-tensor policy's); else None."""
    if not len(segments):
        return None
    at = segments.offsets[0]
    for offset, shape in zip(segments.offsets, segments.shapes, strict=True):
        if offset != at:
            return None
        at += math.prod(shape)
    return segments.offsets[0], at
