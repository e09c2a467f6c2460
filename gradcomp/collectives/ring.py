"""Ring reduce-scatter, all-gather and all-reduce (Patarasuk & Yuan 2009; what gloo and NCCL use).

The flat tensor is cut into p chunks (sizes differ by at most one element). Reduce-scatter takes
p - 1 steps: at step t rank r sends chunk (r - t - 1) mod p to its right neighbour and adds the chunk
(r - t - 2) mod p arriving from its left, so that rank r ends owning the reduced chunk r. All-gather
then passes the reduced chunks around the ring in p - 1 more steps.

Cost: 2 (p - 1) messages of n / p elements per rank: 2 (p - 1) alpha + 2 (p - 1) / p n beta. Each step
is cut into segments: the reduction of one segment overlaps the transfer of the next.
"""

from __future__ import annotations

from torch import Tensor

from gradcomp.collectives.link import Link
from gradcomp.collectives.ops import ReduceOp
from gradcomp.compressors.workspace import Workspace

SEGMENT_BYTES = 1 << 20
"""Default segment size: small enough to overlap reduction with transfer, large enough that the
per-message overhead stays small."""

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


def _segments(numel: int, element_size: int, segment_bytes: int) -> list[tuple[int, int]]:
    per_segment = max(1, segment_bytes // element_size)
    return [(s, min(s + per_segment, numel)) for s in range(0, numel, per_segment)]


def reduce_scatter(
    link: Link, flat: Tensor, op: ReduceOp, bounds: list[tuple[int, int]], segment_bytes: int = SEGMENT_BYTES
) -> None:
    """In place: afterwards chunk ``link.rank`` of ``flat`` holds the reduction over all ranks."""
    p, r = link.size, link.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    largest = max(stop - start for start, stop in bounds)
    incoming = _scratch.take("ring.incoming", largest, flat.dtype, flat.device)
    for t in range(p - 1):
        send_start, send_stop = bounds[(r - t - 1) % p]
        recv_start, recv_stop = bounds[(r - t - 2) % p]
        send = flat[send_start:send_stop]
        target = flat[recv_start:recv_stop]
        received = incoming[: target.numel()]
        receive_segments = _segments(target.numel(), flat.element_size(), segment_bytes)
        receives = [link.start(receive=received[a:b], source=left) for a, b in receive_segments]
        sends = [
            link.start(send=send[a:b], to=right) for a, b in _segments(send.numel(), flat.element_size(), segment_bytes)
        ]
        for (a, b), works in zip(receive_segments, receives, strict=True):
            link.wait(works)
            op.combine(target[a:b], received[a:b])
        for works in sends:
            link.wait(works)


def all_gather(link: Link, flat: Tensor, bounds: list[tuple[int, int]], segment_bytes: int = SEGMENT_BYTES) -> None:
    """In place: chunk ``link.rank`` of ``flat`` is this rank's; afterwards every chunk is filled."""
    p, r = link.size, link.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    for t in range(p - 1):
        send_start, send_stop = bounds[(r - t) % p]
        recv_start, recv_stop = bounds[(r - t - 1) % p]
        send, target = flat[send_start:send_stop], flat[recv_start:recv_stop]
        works = [
            link.start(receive=target[a:b], source=left)
            for a, b in _segments(target.numel(), flat.element_size(), segment_bytes)
        ]
        works += [
            link.start(send=send[a:b], to=right) for a, b in _segments(send.numel(), flat.element_size(), segment_bytes)
        ]
        for w in works:
            link.wait(w)


def all_reduce(link: Link, flat: Tensor, op: ReduceOp, segment_bytes: int = SEGMENT_BYTES) -> None:
    """In place ring all-reduce of a contiguous flat tensor."""
    bounds = chunk_bounds(flat.numel(), link.size)
    reduce_scatter(link, flat, op, bounds, segment_bytes)
    all_gather(link, flat, bounds, segment_bytes)
