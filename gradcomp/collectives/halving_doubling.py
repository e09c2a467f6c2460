"""Recursive halving / doubling all-reduce (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005).

With p' the largest power of two not above p, the r = p - p' extra ranks first fold: each even rank
below 2r hands its whole tensor to the odd rank above it and waits. The p' remaining ranks then
reduce-scatter by recursive halving (lg p' exchanges of n/2, n/4, ... with partners at distance
p'/2, p'/4, ...) and all-gather by recursive doubling (the same exchanges backwards). Finally the odd
ranks hand the result back to their even partners.

Cost for p a power of two: 2 lg p alpha + 2 (p - 1) / p n beta: ring's bandwidth with logarithmic
latency. Folding adds two whole-tensor messages for the extra ranks.
"""

from __future__ import annotations

from torch import Tensor

from gradcomp.collectives.link import Link
from gradcomp.collectives.ops import ReduceOp
from gradcomp.collectives.ring import SEGMENT_BYTES, chunk_bounds
from gradcomp.compressors.workspace import Workspace

_scratch = Workspace()


def all_reduce(link: Link, flat: Tensor, op: ReduceOp, segment_bytes: int = SEGMENT_BYTES) -> None:
    """In place all-reduce of a contiguous flat tensor, for any number of ranks.

    Each exchange is segmented, so that reducing one segment overlaps receiving the next.
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

    blocks = chunk_bounds(flat.numel(), power)
    low, high = 0, power  # the block range this rank is still responsible for
    steps: list[tuple[int, tuple[int, int], tuple[int, int]]] = []
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

        link.exchange_segmented(flat[give_start:give_stop], partner, received, partner, segment_bytes, reduce_segment)
        steps.append((partner, (keep_start, keep_stop), (give_start, give_stop)))
        low, high = keep
        mask >>= 1
    for partner, (keep_start, keep_stop), (give_start, give_stop) in reversed(steps):
        link.exchange(send=flat[keep_start:keep_stop], to=partner, receive=flat[give_start:give_stop], source=partner)

    if rank < 2 * extra:  # an odd rank: return the result to the even one folded into it
        link.exchange(send=flat, to=rank - 1)
