"""Recursive halving / doubling all-reduce (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005).

With p' the largest power of two not above p, the r = p - p' extra ranks first fold: each even rank
below 2r hands its whole tensor to the odd rank above it and waits. The p' remaining ranks then
reduce-scatter by recursive halving (lg p' exchanges of n/2, n/4, ... with partners at distance
p'/2, p'/4, ...) and all-gather by recursive doubling (the same exchanges backwards). Finally the odd
ranks hand the result back to their even partners. Short tensors (up to ``SHORT_BYTES``) skip the
halving and exchange the whole tensor with partners at distance 1, 2, 4, ... (lg p' messages), as
MPICH does.

Cost for p a power of two: 2 lg p alpha + 2 (p - 1) / p n beta (long), lg p (alpha + n beta) (short):
ring's bandwidth with logarithmic latency. Folding adds two whole-tensor messages for the extra ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from gradcomp.collectives.link import Link
from gradcomp.collectives.ops import ReduceOp
from gradcomp.collectives.ring import SEGMENT_BYTES, chunk_bounds
from gradcomp.compressors.workspace import Workspace

_scratch = Workspace()

SHORT_BYTES = 64 << 10
"""Up to this size, whole-tensor recursive doubling (lg p messages of n) beats halving-doubling
(2 lg p messages of n/2, n/4, ...): the latency terms dominate (MPICH switches at 2 KiB on fast
networks; on loopback here messages cost about 0.1-1 ms each, so the crossover is higher)."""


def all_reduce(
    link: Link, flat: Tensor, op: ReduceOp, segment_bytes: int = SEGMENT_BYTES, short_bytes: int = SHORT_BYTES
) -> None:
    """In place all-reduce of a contiguous flat tensor, for any number of ranks.

    Tensors up to ``short_bytes`` (or with fewer elements than ranks) take recursive doubling of the
    whole tensor (lg p messages); larger ones halving then doubling, each exchange segmented so that
    reducing one segment overlaps receiving the next.
    """
    p, rank = link.size, link.rank
    if p == 1:
        return
    power = 1 << (p.bit_length() - 1)
    extra = p - power
    incoming = _scratch.take("hd.incoming", flat.numel(), flat.dtype, flat.device)

    def real(virtual: int) -> int:
        """The rank that plays virtual rank ``virtual`` among the power-of-two participants."""
        return 2 * virtual + 1 if virtual < extra else virtual + extra

    # Fold the extra ranks into their odd neighbours.
    if rank < 2 * extra:
        if rank % 2 == 0:
            link.exchange(send=flat, to=rank + 1)
            link.exchange(receive=flat, source=rank + 1)
            return
        link.exchange(receive=incoming, source=rank - 1)
        op.combine(flat, incoming)
    virtual = rank // 2 if rank < 2 * extra else rank - extra

    if flat.numel() * flat.element_size() <= short_bytes or flat.numel() < power:
        _recursive_doubling(link, flat, op, power, virtual, real, incoming)
    else:
        _halving_doubling(link, flat, op, power, virtual, real, incoming, segment_bytes)

    if rank < 2 * extra:  # an odd rank: return the result to the even one folded into it
        link.exchange(send=flat, to=rank - 1)


def _recursive_doubling(
    link: Link, flat: Tensor, op: ReduceOp, power: int, virtual: int, real: Callable[[int], int], incoming: Tensor
) -> None:
    """lg p' exchanges of the whole tensor with partners at distance 1, 2, 4, ...: the fewest
    sequential messages, for short tensors. Every rank combines the same two halves of the world
    at each step (a + b on one side, b + a on the other: equal bits), so results stay identical."""
    mask = 1
    while mask < power:
        partner = real(virtual ^ mask)
        link.exchange(send=flat, to=partner, receive=incoming, source=partner)
        op.combine(flat, incoming)
        mask <<= 1


def _halving_doubling(
    link: Link,
    flat: Tensor,
    op: ReduceOp,
    power: int,
    virtual: int,
    real: Callable[[int], int],
    incoming: Tensor,
    segment_bytes: int,
) -> None:
    """Reduce-scatter by recursive halving, then all-gather by recursive doubling."""
    blocks = chunk_bounds(flat.numel(), power)
    low, high = 0, power  # the block range this rank is still responsible for
    steps: list[tuple[int, tuple[int, int], tuple[int, int]]] = []
    sends: list[list[dist.Work]] = []  # waited for only before their data is overwritten
    mask = power >> 1
    while mask:
        partner = real(virtual ^ mask)
        middle = (low + high) // 2
        keep, give = ((low, middle), (middle, high)) if virtual & mask == 0 else ((middle, high), (low, middle))
        keep_start, keep_stop = blocks[keep[0]][0], blocks[keep[1] - 1][1]
        give_start, give_stop = blocks[give[0]][0], blocks[give[1] - 1][1]
        received, kept = incoming[: keep_stop - keep_start], flat[keep_start:keep_stop]

        def reduce_segment(a: int, b: int, kept: Tensor = kept, received: Tensor = received) -> None:
            op.combine(kept[a:b], received[a:b])

        link.exchange_segmented(
            flat[give_start:give_stop], partner, received, partner, segment_bytes, reduce_segment, sends
        )
        steps.append((partner, (keep_start, keep_stop), (give_start, give_stop)))
        low, high = keep
        mask >>= 1
    for works in sends:  # the doubling receives into the ranges the halving sent from
        link.wait(works)
    sends.clear()
    for partner, (keep_start, keep_stop), (give_start, give_stop) in reversed(steps):
        link.exchange_segmented(
            flat[keep_start:keep_stop], partner, flat[give_start:give_stop], partner, segment_bytes, None, sends
        )
    for works in sends:
        link.wait(works)
