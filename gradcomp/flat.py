"""Flat buffers holding several tensors back to back: a DDP bucket, a fragment, a joined payload.

A neutral utility (it imports only torch): the compressors, the engine, the synchronizer and the
cost model all cut flat buffers into the tensors they hold with :func:`views`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from torch import Tensor


def views(flat: Tensor, shapes: Iterable[Sequence[int]]) -> list[Tensor]:
    """The tensors of ``shapes`` that ``flat`` holds back to back, as views of it (no copy): what a
    tensor writes into its view lands in ``flat``. ``flat`` may hold more than they need."""
    parts, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        parts.append(flat[start : start + size].view(tuple(shape)))
        start += size
    return parts


def numel(shapes: Iterable[Sequence[int]]) -> int:
    """Elements that tensors of ``shapes`` hold in all."""
    return sum(math.prod(shape) for shape in shapes)
