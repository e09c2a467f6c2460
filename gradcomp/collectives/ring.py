"""Ring reduce-scatter, all-gather and all-reduce (Patarasuk & Yuan 2009; what gloo and NCCL use).

The flat tensor is cut into p chunks (sizes differ by at most one element). Reduce-scatter takes
p - 1 steps: at step t rank r sends chunk (r - t - 1) mod p to its right neighbour and adds the chunk
(r - t - 2) mod p arriving from its left, so that rank r ends owning the reduced chunk r. All-gather
then passes the reduced chunks around the ring in p - 1 more steps.

Cost: 2 (p - 1) messages of n / p elements per rank: 2 (p - 1) alpha + 2 (p - 1) / p n beta. Each step
is cut into segments that move on as soon as they arrive (see :func:`run`).
"""

from __future__ import annotations

from torch import Tensor

from gradcomp.collectives.link import Link, segments
from gradcomp.collectives.ops import ReduceOp
from gradcomp.workspace import Workspace

SEGMENT_BYTES = 4 << 20
"""Default segment size: small enough to overlap reductions with transfers on large tensors, large
enough that per-message latency stays small; the best of the sizes measured (``docs/collectives.md``)."""

_scratch = Workspace()


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` near-equal chunks of ``numel`` elements (the first ones larger)."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


Step = tuple[int, int, bool]
"""(chunk sent, chunk received, whether the received chunk is reduced into ours or copied)."""


def reduce_scatter_steps(rank: int, size: int) -> list[Step]:
    """p - 1 steps after which ``rank`` owns the reduced chunk ``rank``."""
    return [((rank - t - 1) % size, (rank - t - 2) % size, True) for t in range(size - 1)]


def all_gather_steps(rank: int, size: int) -> list[Step]:
    """p - 1 steps that pass every rank's own chunk around the ring."""
    return [((rank - t) % size, (rank - t - 1) % size, False) for t in range(size - 1)]


def run(
    link: Link,
    flat: Tensor,
    bounds: list[tuple[int, int]],
    steps: list[Step],
    op: ReduceOp = ReduceOp.SUM,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Run ring ``steps`` (each sends to the right and receives from the left), pipelined by segment.

    From the second step on, a step sends the chunk the previous step received, so each segment
    travels on as soon as it has arrived (and been reduced): transfers of one step overlap the
    reductions and transfers of the previous one, instead of waiting for the whole chunk.
    Receives for a step are posted a step ahead; reductions receive into two alternating buffers.
    """
    if link.size == 1 or not steps:
        return
    right, left = (link.rank + 1) % link.size, (link.rank - 1) % link.size
    largest = max(stop - start for start, stop in bounds)
    buffers = [_scratch.take(f"ring.incoming{i}", largest, flat.dtype, flat.device) for i in (0, 1)]

    def chunk(index: int) -> Tensor:
        start, stop = bounds[index]
        return flat[start:stop]

    def pieces(index: int) -> list[tuple[int, int]]:
        return segments(chunk(index).numel(), flat.element_size(), segment_bytes)

    def receive_into(u: int) -> Tensor:
        _, received, reduce = steps[u]
        return buffers[u % 2][: chunk(received).numel()] if reduce else chunk(received)

    def post_receives(u: int) -> list[list]:
        target = receive_into(u)
        return [link.start(receive=target[a:b], source=left) for a, b in pieces(steps[u][1])]

    sends = [link.start(send=chunk(steps[0][0])[a:b], to=right) for a, b in pieces(steps[0][0])]
    receives = post_receives(0)
    for u, (_, received, reduce) in enumerate(steps):
        following = post_receives(u + 1) if u + 1 < len(steps) else []
        target, incoming = chunk(received), receive_into(u)
        for (a, b), works in zip(pieces(received), receives, strict=True):
            link.wait(works)
            if reduce:
                op.combine(target[a:b], incoming[a:b])
            if u + 1 < len(steps):  # the next step sends exactly this segment on
                sends.append(link.start(send=target[a:b], to=right))
        receives = following
    for works in sends:
        link.wait(works)


def reduce_scatter(
    link: Link, flat: Tensor, op: ReduceOp, bounds: list[tuple[int, int]], segment_bytes: int = SEGMENT_BYTES
) -> None:
    """In place: afterwards chunk ``link.rank`` of ``flat`` holds the reduction over all ranks."""
    run(link, flat, bounds, reduce_scatter_steps(link.rank, link.size), op, segment_bytes)


def all_gather(link: Link, flat: Tensor, bounds: list[tuple[int, int]], segment_bytes: int = SEGMENT_BYTES) -> None:
    """In place: chunk ``link.rank`` of ``flat`` is this rank's; afterwards every chunk is filled."""
    run(link, flat, bounds, all_gather_steps(link.rank, link.size), segment_bytes=segment_bytes)


def all_reduce(link: Link, flat: Tensor, op: ReduceOp, segment_bytes: int = SEGMENT_BYTES) -> None:
    """In place ring all-reduce of a contiguous flat tensor: reduce-scatter and all-gather as one
    pipeline (the all-gather's first step sends the chunk the reduce-scatter's last step finished)."""
    bounds = chunk_bounds(flat.numel(), link.size)
    steps = reduce_scatter_steps(link.rank, link.size) + all_gather_steps(link.rank, link.size)
    run(link, flat, bounds, steps, op, segment_bytes)
