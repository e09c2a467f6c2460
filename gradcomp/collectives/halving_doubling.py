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

from torch import Tensor

from gradcomp.collectives.link import Link, Pending, segments
from gradcomp.collectives.ops import ReduceOp
from gradcomp.collectives.ring import SEGMENT_BYTES, chunk_bounds
from gradcomp.workspace import Workspace

_scratch = Workspace()

SHORT_BYTES = 64 << 10
"""Up to this size, whole-tensor recursive doubling (lg p messages of n) beats halving-doubling
(2 lg p messages of n/2, n/4, ...): the latency terms dominate (MPICH switches at 2 KiB on fast
networks; a message costs more on loopback between processes, so the crossover is higher: see
``docs/benchmarks.md``)."""


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
    short = flat.numel() * flat.element_size() <= short_bytes or flat.numel() < power
    # recursive doubling receives every step's message at once; halving needs less than n in all
    rounds = power.bit_length() - 1
    incoming = _scratch.take("hd.incoming", flat.numel() * (max(rounds, 1) if short else 1), flat.dtype, flat.device)

    def real(virtual: int) -> int:
        """The rank that plays virtual rank ``virtual`` among the power-of-two participants."""
        return 2 * virtual + 1 if virtual < extra else virtual + extra

    # Fold the extra ranks into their odd neighbours.
    if rank < 2 * extra:
        if rank % 2 == 0:
            link.exchange(send=flat, to=rank + 1)
            link.exchange(receive=flat, source=rank + 1)
            return
        folded = incoming[: flat.numel()]
        link.exchange(receive=folded, source=rank - 1)
        op.combine(flat, folded)
    virtual = rank // 2 if rank < 2 * extra else rank - extra

    if short:
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
    at each step (a + b on one side, b + a on the other: equal bits), so results stay identical.
    All receives are posted first, into separate buffers, so that no message waits for its receive."""
    partners = [real(virtual ^ (1 << k)) for k in range(power.bit_length() - 1)]
    n = flat.numel()
    receives = [link.start(receive=incoming[k * n : (k + 1) * n], source=q) for k, q in enumerate(partners)]
    sends: list[list[Pending]] = []
    for k, partner in enumerate(partners):
        sends.append(link.start(send=flat, to=partner))
        link.wait(receives[k])
        for works in sends:  # flat is about to change: what was sent from it must be out
            link.wait(works)
        sends.clear()
        op.combine(flat, incoming[k * n : (k + 1) * n])


_Plan = list[tuple[int, tuple[int, int], tuple[int, int]]]
"""Per halving step: the partner, the element range kept, the range given."""


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
    """Reduce-scatter by recursive halving, then all-gather by recursive doubling.

    Every receive of a phase is posted before its first send (the halving's into separate parts of
    ``incoming``, the doubling's straight into place), so no message waits for its receive; each
    transfer is segmented so that reductions overlap the segments still arriving.
    """
    plans = _plan(flat.numel(), power, virtual, real)

    def pieces(size: int) -> list[tuple[int, int]]:
        return segments(size, flat.element_size(), segment_bytes)

    sends = _halve(link, flat, op, plans, incoming, pieces)
    for works in sends:  # the doubling receives into the ranges the halving sent from
        link.wait(works)
    _double(link, flat, plans, pieces)


def _plan(numel: int, power: int, virtual: int, real: Callable[[int], int]) -> _Plan:
    """The halving's steps for virtual rank ``virtual`` of ``power``: whom it meets, what it keeps and gives."""
    blocks = chunk_bounds(numel, power)
    plans: _Plan = []
    low, high, mask = 0, power, power >> 1
    while mask:
        middle = (low + high) // 2
        keep, give = ((low, middle), (middle, high)) if virtual & mask == 0 else ((middle, high), (low, middle))
        plans.append(
            (
                real(virtual ^ mask),
                (blocks[keep[0]][0], blocks[keep[1] - 1][1]),
                (blocks[give[0]][0], blocks[give[1] - 1][1]),
            )
        )
        low, high = keep
        mask >>= 1
    return plans


def _halve(
    link: Link,
    flat: Tensor,
    op: ReduceOp,
    plans: _Plan,
    incoming: Tensor,
    pieces: Callable[[int], list[tuple[int, int]]],
) -> list[list[Pending]]:
    """Halving: receive the partner's half of what we keep, reduce it in, segment by segment; the
    sends still in flight come back (wait for them before reusing the ranges they send from)."""
    parts, offset = [], 0
    for _, (keep_start, keep_stop), _ in plans:
        parts.append(incoming[offset : offset + keep_stop - keep_start])
        offset += keep_stop - keep_start
    receives = [
        [link.start(receive=part[a:b], source=partner) for a, b in pieces(part.numel())]
        for (partner, _, _), part in zip(plans, parts, strict=True)
    ]
    sends: list[list[Pending]] = []
    for (partner, (keep_start, keep_stop), (give_start, give_stop)), part, waiting in zip(
        plans, parts, receives, strict=True
    ):
        given = flat[give_start:give_stop]
        sends += [link.start(send=given[a:b], to=partner) for a, b in pieces(given.numel())]
        kept = flat[keep_start:keep_stop]
        for (a, b), works in zip(pieces(part.numel()), waiting, strict=True):
            link.wait(works)
            op.combine(kept[a:b], part[a:b])
    return sends


def _double(link: Link, flat: Tensor, plans: _Plan, pieces: Callable[[int], list[tuple[int, int]]]) -> None:
    """Doubling: the halving's exchanges backwards, whole results this time, straight into place."""
    receives = [
        [
            link.start(receive=flat[give_start + a : give_start + b], source=partner)
            for a, b in pieces(give_stop - give_start)
        ]
        for partner, _, (give_start, give_stop) in reversed(plans)
    ]
    sends: list[list[Pending]] = []
    for (partner, (keep_start, keep_stop), _), waiting in zip(reversed(plans), receives, strict=True):
        kept = flat[keep_start:keep_stop]
        sends += [link.start(send=kept[a:b], to=partner) for a, b in pieces(kept.numel())]
        for works in waiting:
            link.wait(works)
    for works in sends:
        link.wait(works)
