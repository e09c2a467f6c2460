"""Fragments of a model's parameters and the steps at which each one synchronizes.

Streaming DiLoCo (Douillard et al., 2025) synchronizes a model in fragments at staggered steps, so
that the link carries a fragment at a time instead of the whole model at once: the same bytes per
``every`` steps, a peak ``fragments`` times lower, and each fragment's communication free to overlap
the next inner steps.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence


def split(sizes: Sequence[int], count: int) -> list[list[int]]:
    """The indices of tensors of ``sizes`` elements in ``count`` contiguous fragments of about equal
    size: fragment ``f`` ends at the tensor whose running total first reaches ``(f + 1) / count`` of
    the whole, and every fragment holds at least one tensor.

    Contiguous in the model's order, so a fragment is a run of layers. Raises ValueError when there are
    fewer tensors than fragments.
    """
    if count < 1:
        raise ValueError(f"fragments must be >= 1, got {count}")
    if len(sizes) < count:
        raise ValueError(f"{count} fragments need at least as many parameter tensors; the model has {len(sizes)}")
    totals = list(itertools.accumulate(sizes))
    ends, start = [], 0
    for f in range(count):
        # the earliest end reaching this fragment's share, leaving a tensor for each fragment after it
        share = totals[-1] * (f + 1) / count
        end = bisect.bisect_left(totals, share) + 1
        end = max(start + 1, min(end, len(sizes) - (count - 1 - f)))
        ends.append(end)
        start = end
    ends[-1] = len(sizes)
    return [list(range(begin, end)) for begin, end in zip([0, *ends[:-1]], ends, strict=True)]


def due(step: int, every: int, count: int) -> list[int]:
    """The fragments that synchronize after inner step ``step`` (counted from 1): fragment ``f`` every
    ``every`` steps at offset ``(f + 1) * every // count``, so the last one synchronizes at the
    multiples of ``every``, and with one fragment the whole model does (DiLoCo)."""
    return [f for f in range(count) if step % every == (f + 1) * every // count % every]
