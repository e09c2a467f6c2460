"""Binomial-tree reduce and broadcast, and the all-reduce made of both.

Reduce: in round k (k = 0, 1, ...) every rank whose relative rank has bit k set sends its partial
result to the rank 2**k below and drops out; the others add what they receive. Broadcast runs the
same tree backwards. Every message carries the whole tensor.

Cost: 2 ceil(lg p) (alpha + n beta) for the all-reduce: the fewest messages of any algorithm here,
so the fastest for small tensors; the most bytes for large ones.
"""

from __future__ import annotations

from torch import Tensor

from gradcomp.collectives.link import Link
from gradcomp.collectives.ops import ReduceOp
from gradcomp.workspace import Workspace

_scratch = Workspace()


def reduce(link: Link, flat: Tensor, op: ReduceOp, root: int = 0) -> None:
    """In place: afterwards ``flat`` on ``root`` holds the reduction (other ranks: partial results)."""
    p = link.size
    relative = (link.rank - root) % p
    incoming = _scratch.take("tree.incoming", flat.numel(), flat.dtype, flat.device)
    mask = 1
    while mask < p:
        if relative & mask:
            link.exchange(send=flat, to=(relative - mask + root) % p)
            return
        if relative + mask < p:
            link.exchange(receive=incoming, source=(relative + mask + root) % p)
            op.combine(flat, incoming)
        mask <<= 1


def broadcast(link: Link, flat: Tensor, root: int = 0) -> None:
    """In place: afterwards every rank holds ``root``'s ``flat``."""
    p = link.size
    relative = (link.rank - root) % p
    mask = 1
    while mask < p:
        if relative & mask:
            link.exchange(receive=flat, source=(relative - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if relative + mask < p:
            link.exchange(send=flat, to=(relative + mask + root) % p)
        mask >>= 1


def all_reduce(link: Link, flat: Tensor, op: ReduceOp, segment_bytes: int = 0) -> None:
    """Binomial reduce to rank 0, then binomial broadcast from it. Whole tensors travel (no segments:
    ``segment_bytes`` is ignored), as the tree is for small tensors."""
    reduce(link, flat, op)
    broadcast(link, flat)
