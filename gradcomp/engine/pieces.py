"""Pieces: a large tensor compressed as several, and the step's last bucket sent part by part.

Backward produces the last bucket (the first layers', often the largest tensor: an embedding, the
first projection) when nothing is left to overlap with: everything after it is the step's tail.
With ``HookSpec.pieces = n`` the engine sends that bucket in up to ``n`` parts, each compressed in
the caller's thread while the part before it is on the wire and being decompressed, so the tail
holds one part's compression and one part's communication instead of the whole bucket's each.

A part boundary inside a tensor is a boundary between compressed tensors, so the engine cuts large
tensors into pieces (:func:`cut`) in every bucket, not only the last: a tensor's state (its
error-feedback residual) then has the same keys whichever bucket DDP puts it in, at every step and
after a resume (rule "state per tensor"). Only compressors local to chunks or elements
(``Capabilities.local``) take pieces: cut at a multiple of their chunk, a tensor compressed in pieces
is the tensor compressed whole (bitwise for the deterministic ones).

Cost: a few more, smaller kernels and collectives; nothing more on the wire than alignment.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from gradcomp.compressors.keys import StateKey

PIECE_MIN = 1 << 18
"""Elements a piece holds at least (256K): below, a part's fixed costs (kernel launches, a
collective's latency) outweigh what overlapping it saves."""


def cut(
    keys: Sequence[Hashable], shapes: Sequence[torch.Size], pieces: int, multiple: int, smallest: int = 0
) -> tuple[list[Hashable], list[torch.Size]]:
    """The tensors of ``shapes`` with each large one cut along its first dimension into up to
    ``pieces`` pieces of about :data:`PIECE_MIN` (and ``smallest``) elements or more, each a multiple
    of ``multiple`` elements but the last; piece i of the tensor keyed ``k`` is keyed
    ``StateKey.of(k).of_piece(i)``.
    The pieces are views of the same memory, in order: the buffer does not move."""
    out_keys: list[Hashable] = []
    out_shapes: list[torch.Size] = []
    for key, shape in zip(keys, shapes, strict=True):
        rows = _rows_per_piece(shape, pieces, multiple, max(PIECE_MIN, smallest))
        if rows is None:
            out_keys.append(key)
            out_shapes.append(shape)
            continue
        for i, start in enumerate(range(0, shape[0], rows)):
            out_keys.append(StateKey.of(key).of_piece(i))
            out_shapes.append(torch.Size((min(rows, shape[0] - start), *shape[1:])))
    return out_keys, out_shapes


def _rows_per_piece(shape: torch.Size, pieces: int, multiple: int, least: int) -> int | None:
    """Rows of each piece of a tensor of ``shape``, or None if it stays whole."""
    if len(shape) == 0 or math.prod(shape) == 0:
        return None
    row = math.prod(shape[1:])
    count = min(pieces, math.prod(shape) // least)  # fewer pieces where they would be too small
    if count < 2:
        return None
    step = multiple // math.gcd(multiple, row)  # rows whose elements are a multiple of ``multiple``
    rows = -(-math.ceil(shape[0] / count) // step) * step
    return rows if rows < shape[0] else None


def parts(sizes: Sequence[int], count: int) -> list[range]:
    """Consecutive tensors (of ``sizes`` elements) in up to ``count`` groups of about the same
    elements: a group closes where that brings it closest to its share of what is left."""
    groups: list[range] = []
    start, total, held = 0, sum(sizes), 0
    for index, size in enumerate(sizes):
        held += size
        left = count - len(groups)
        if left < 2 or index + 1 == len(sizes):
            continue
        share = total / left
        if abs(held - share) <= abs(held + sizes[index + 1] - share):
            groups.append(range(start, index + 1))
            start, total, held = index + 1, total - held, 0
    groups.append(range(start, len(sizes)))
    return groups


def spans(numel: int, count: int, multiple: int) -> list[tuple[int, int]]:
    """A flat buffer of ``numel`` elements in up to ``count`` consecutive spans ``(start, stop)``
    of at least :data:`PIECE_MIN` elements, cut at multiples of ``multiple``: a bucket that travels
    whole (the casts) in parts."""
    size = max(-(-numel // count), PIECE_MIN)
    size = -(-size // multiple) * multiple
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]
