"""The alpha-beta-gamma cost model of the all-reduce algorithms (Thakur, Rabenseifner & Gropp 2005).

A message of n bytes costs alpha + n beta (latency plus inverse bandwidth); reducing n bytes costs
n gamma. With p ranks (p' the largest power of two not above p, lg = log2):

=================  ===========================================================================
ring               2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
tree               2 ceil(lg p) (alpha + n beta) + ceil(lg p) n gamma
halving_doubling   long: 2 lg p' alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma;
                   short (n <= SHORT_BYTES): lg p' (alpha + n beta + n gamma);
                   plus, when p != p', 2 (alpha + n beta) + n gamma to fold the extra ranks
hierarchical       ring inside groups of L (reduce-scatter and all-gather) around a ring
                   all-reduce of n / L bytes across the p / L groups, each on its own link
=================  ===========================================================================

Use it to choose: latency terms dominate small tensors (tree, then halving-doubling), bandwidth
terms large ones (ring and halving-doubling tie; tree sends lg p times more). ``bytes_sent`` gives
the exact per-rank traffic that ``gradcomp.collectives`` counts, for tensors that split evenly.
"""

from __future__ import annotations

import dataclasses
import math

from gradcomp.collectives.api import ALGORITHMS, FLAT_ALGORITHMS
from gradcomp.collectives.halving_doubling import SHORT_BYTES

MODELED = tuple(a for a in ALGORITHMS if a != "native")
"""The algorithms this model predicts (the backend's own is not modeled here)."""


def ring_traffic(p: int) -> float:
    """Bytes one rank sends, per byte of the tensor, in a bandwidth-optimal all-reduce of ``p`` ranks
    (a ring; halving-doubling for powers of two): ``2 (p - 1) / p``. Also the factor from algorithm
    bandwidth to bus bandwidth (nccl-tests), and what gloo's and NCCL's ring all-reduces send."""
    return 2 * (p - 1) / p if p > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class LinkCosts:
    """alpha: seconds per message; beta: seconds per byte sent; gamma: seconds per byte reduced."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        values = (self.alpha, self.beta, self.gamma)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"alpha, beta and gamma must be finite numbers >= 0, got {self}")


def power_below(p: int) -> int:
    """The largest power of two not above ``p`` (halving-doubling's core; the other ranks fold in)."""
    return 1 << (p.bit_length() - 1)


def all_reduce_seconds(
    algo: str,
    n_bytes: float,
    p: int,
    network: LinkCosts,
    local_size: int | None = None,
    across: LinkCosts | None = None,
) -> float:
    """Predicted time of one all-reduce of ``n_bytes`` on ``p`` ranks.

    ``hierarchical`` needs ``local_size``; ``across`` is the network between groups (default: the same).
    """
    if p < 1 or n_bytes < 0:
        raise ValueError(f"need p >= 1 and n_bytes >= 0, got p={p}, n_bytes={n_bytes}")
    if p == 1:
        return 0.0
    a, b, g = network.alpha, network.beta, network.gamma
    if algo == "ring":
        return 2 * (p - 1) * a + ring_traffic(p) * n_bytes * b + (p - 1) / p * n_bytes * g
    if algo == "tree":
        rounds = math.ceil(math.log2(p))
        return 2 * rounds * (a + n_bytes * b) + rounds * n_bytes * g
    if algo == "halving_doubling":
        power = power_below(p)
        rounds = int(math.log2(power))
        fold = 0.0 if power == p else 2 * (a + n_bytes * b) + n_bytes * g
        if n_bytes <= SHORT_BYTES:
            return rounds * (a + n_bytes * b + n_bytes * g) + fold
        return 2 * rounds * a + ring_traffic(power) * n_bytes * b + (power - 1) / power * n_bytes * g + fold
    if algo == "hierarchical":
        if local_size is None or local_size < 1 or p % local_size:
            raise ValueError(f"hierarchical needs a local_size dividing p={p}, got {local_size}")
        inside = all_reduce_seconds("ring", n_bytes, local_size, network) if local_size > 1 else 0.0
        return inside + all_reduce_seconds("ring", n_bytes / local_size, p // local_size, across or network)
    raise ValueError(f"unknown algorithm {algo!r}; valid: {', '.join(MODELED)}")


def bytes_sent(algo: str, n_bytes: int, p: int) -> float:
    """Bytes one rank sends in one all-reduce (ring, halving-doubling for powers of two), or all
    ranks together (tree, whose ranks send different amounts)."""
    if algo == "ring" or (algo == "halving_doubling" and n_bytes > SHORT_BYTES and p == power_below(p)):
        return ring_traffic(p) * n_bytes
    if algo == "tree":
        return 2 * (p - 1) * n_bytes
    raise ValueError(f"no closed form for {algo!r} here")


def busbw(n_bytes: float, p: int, seconds: float) -> float:
    """Bus bandwidth as nccl-tests reports it: (n / t) * 2 (p - 1) / p, bytes per second."""
    return n_bytes / seconds * ring_traffic(p)


def fastest(n_bytes: float, p: int, network: LinkCosts) -> str:
    """The flat algorithm (ring, tree or halving-doubling) the model predicts fastest."""
    return min(FLAT_ALGORITHMS, key=lambda a: all_reduce_seconds(a, n_bytes, p, network))
