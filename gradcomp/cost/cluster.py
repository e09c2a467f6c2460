"""Collective times on a cluster: ranks in nodes, a link inside a node and one between nodes.

:mod:`gradcomp.collectives.cost_model` prices the all-reduce algorithms on one uniform link. A
cluster has two: ``intra`` between the ranks of a node (NVLink, shared memory) and ``inter`` between
nodes. Each rank has its own path to the network (one NIC per GPU, as in DGX/HGX nodes), so ranks
of a node that send across at the same time do not share bandwidth; with ``shared_uplink`` a node
has one uplink its ranks share (a NIC per node, as the emulated clusters of :mod:`gradcomp.netem`),
and k of them crossing at once each get 1 / k of it (a node-major ring crosses one rank per node
per round: the same either way). A round of an algorithm costs alpha + bytes x beta on the link it crosses; a
round in which some pairs stay inside nodes and others cross is paced by the crossing ones.

With ``p`` ranks, ``L`` per node, ``N = p / L`` nodes, a tensor of ``n`` bytes (per rank):

====================  =========================================================================
ring (native)         2 (p - 1) rounds of n / p: the ring crosses node boundaries in every round
tree                  2 ceil(lg p) rounds of n; a round at distance >= L crosses
halving_doubling      rounds at distance 1, 2, 4, ...: those at distance >= L cross (the
                      flat formula otherwise, folding extra ranks first)
hierarchical          ring reduce-scatter inside nodes, a ring all-reduce of n / L across
                      nodes (the L local ranks in parallel, each on its own path), all-gather inside
in_network            SHARP-like: reduce-scatter inside nodes, every rank sends its n / L once to the
                      switch, which reduces, and receives the result once (2 alpha + n / L beta), then
                      all-gather inside nodes
all_gather            ring: p - 1 rounds, each rank forwards one rank's c bytes per round
all_to_all            pairwise exchange: p - 1 rounds, each rank sends c / p to one peer per round
====================  =========================================================================

``native`` is the backend's own all-reduce: gloo's is a segmented ring, NCCL's a ring (or a tree
at scale); it is priced as the ring, on the link costs fitted from the backend's own collectives
when a calibration profile gives them (:mod:`gradcomp.cost.profile`).
"""

from __future__ import annotations

import dataclasses
import math

from gradcomp.collectives.cost_model import LinkCosts, all_reduce_seconds, power_below, ring_traffic
from gradcomp.collectives.halving_doubling import SHORT_BYTES

ALL_REDUCE = ("native", "ring", "tree", "halving_doubling", "hierarchical", "in_network")
"""The all-reduce algorithms a :class:`Cluster` prices."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``ranks`` ranks, ``local_size`` per node, and the links between them.

    ``native_all_reduce`` and ``native_all_gather`` are the link costs the backend's own collectives
    show when measured (a calibration profile); without them the backend is priced as a ring on
    ``inter`` (``intra`` inside a single node).
    """

    ranks: int
    inter: LinkCosts
    local_size: int = 1
    intra: LinkCosts | None = None
    native_all_reduce: LinkCosts | None = None
    native_all_gather: LinkCosts | None = None
    shared_uplink: bool = False
    """True: ``inter`` is one uplink per node that its ranks share (a NIC per node, as the emulated
    clusters of :mod:`gradcomp.netem` build): a round in which k ranks of a node cross at once takes k
    times the bytes' time. False: each rank has its own path at ``inter`` (a NIC per GPU)."""

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.local_size < 1:
            raise ValueError(f"need ranks >= 1 and local_size >= 1, got {self.ranks} and {self.local_size}")
        if self.ranks % self.local_size:
            raise ValueError(f"{self.local_size} ranks per node do not divide {self.ranks} ranks")

    @property
    def nodes(self) -> int:
        return self.ranks // self.local_size

    @property
    def inside(self) -> LinkCosts:
        """The link between two ranks of one node."""
        return self.intra or self.inter

    @property
    def slowest(self) -> LinkCosts:
        """The link that paces a round crossing nodes (the intra link when there is one node)."""
        return self.inter if self.nodes > 1 else self.inside

    def all_reduce(self, algo: str, n_bytes: float) -> float:
        """Seconds of one all-reduce of ``n_bytes`` per rank with ``algo`` (one of :data:`ALL_REDUCE`)."""
        p, local = self.ranks, self.local_size
        if n_bytes < 0:
            raise ValueError(f"n_bytes must be >= 0, got {n_bytes}")
        if p == 1:
            return 0.0
        if algo == "native":
            return all_reduce_seconds("ring", n_bytes, p, self.native_all_reduce or self.slowest)
        if algo == "ring":
            return all_reduce_seconds("ring", n_bytes, p, self.slowest)
        if algo in ("hierarchical", "in_network"):
            inside = all_reduce_seconds("ring", n_bytes, local, self.inside) if local > 1 else 0.0
            shard = n_bytes / local
            if self.nodes == 1:
                across = 0.0
            elif algo == "hierarchical":
                across = all_reduce_seconds("ring", shard, self.nodes, self.crossing(local))
            else:  # the switch reduces: one send and one receive of the shard per rank
                across = 2 * self.inter.alpha + shard * self.crossing(local).beta
            return inside + across
        if self.nodes == 1 or local == 1:  # one link everywhere: the flat formulas
            if algo not in ("tree", "halving_doubling"):
                raise ValueError(f"unknown all-reduce algorithm {algo!r}; valid: {', '.join(ALL_REDUCE)}")
            return all_reduce_seconds(algo, n_bytes, p, self.slowest)
        if algo == "tree":
            rounds = math.ceil(math.log2(p))
            return 2 * sum(self._hop(1 << k, n_bytes) for k in range(rounds))
        if algo == "halving_doubling":
            return self._halving_doubling(n_bytes)
        raise ValueError(f"unknown all-reduce algorithm {algo!r}; valid: {', '.join(ALL_REDUCE)}")

    def all_reduce_bytes(self, algo: str, n_bytes: float) -> float:
        """Bytes one rank sends in one all-reduce of ``n_bytes`` with ``algo`` (the tree: a rank that
        sends to its parent and to its children: 2 n, the most any rank sends per round)."""
        p, local = self.ranks, self.local_size
        if p == 1:
            return 0.0
        if algo in ("native", "ring"):
            return ring_traffic(p) * n_bytes
        if algo == "tree":
            return 2 * n_bytes
        if algo == "halving_doubling":
            power = power_below(p)
            return ring_traffic(power) * n_bytes + (0.0 if power == p else n_bytes)
        inside = ring_traffic(local) * n_bytes
        if algo == "hierarchical":
            return inside + ring_traffic(self.nodes) * n_bytes / local
        if algo == "in_network":
            return inside + (n_bytes / local if self.nodes > 1 else 0.0)
        raise ValueError(f"unknown all-reduce algorithm {algo!r}; valid: {', '.join(ALL_REDUCE)}")

    def all_gather(self, payload_bytes: float) -> float:
        """Seconds of an all-gather in which every rank contributes ``payload_bytes`` (a ring)."""
        if self.ranks == 1:
            return 0.0
        link = self.native_all_gather or self.slowest
        return (self.ranks - 1) * (link.alpha + payload_bytes * link.beta)

    def all_to_all(self, payload_bytes: float) -> float:
        """Seconds of an all-to-all in which every rank sends ``payload_bytes`` split evenly over all
        ranks (its own share stays): p - 1 pairwise rounds of ``payload_bytes / p``."""
        p = self.ranks
        if p == 1:
            return 0.0
        if not self.shared_uplink or self.nodes == 1:
            link = self.slowest
            return (p - 1) * (link.alpha + payload_bytes / p * link.beta)
        # round k: rank r sends to r + k; on a shared uplink a round takes as long as the most ranks
        # of a node crossing at once (ranks numbered node by node, every node alike)
        seconds = 0.0
        for k in range(1, p):
            crossing = sum((r + k) % p // self.local_size != 0 for r in range(self.local_size))
            link = self.crossing(crossing) if crossing else self.inside
            seconds += link.alpha + payload_bytes / p * link.beta
        return seconds

    def crossing(self, senders: int, link: LinkCosts | None = None) -> LinkCosts:
        """The link across nodes (or ``link``, a fit of the backend's collectives across them) as
        ``senders`` ranks of one node see it when they cross at once: the same on a path per rank,
        ``senders`` times slower per byte on a shared uplink."""
        link = link or self.inter
        if not self.shared_uplink or senders <= 1:
            return link
        return dataclasses.replace(link, beta=link.beta * senders)

    def _hop(self, distance: int, n_bytes: float) -> float:
        """One round between ranks ``distance`` apart (ranks numbered node by node): every rank of a
        node crosses at once when the distance reaches across nodes."""
        link = self.crossing(self.local_size) if distance >= self.local_size else self.inside
        return link.alpha + n_bytes * link.beta

    def _halving_doubling(self, n_bytes: float) -> float:
        power = power_below(self.ranks)
        rounds = int(math.log2(power))
        fold = 0.0 if power == self.ranks else 2 * self._hop(self.ranks, n_bytes)
        if n_bytes <= SHORT_BYTES:  # recursive doubling: lg p rounds of the whole tensor
            return sum(self._hop(1 << k, n_bytes) for k in range(rounds)) + fold
        # reduce-scatter halves the data at each doubling distance; the all-gather mirrors it
        return 2 * sum(self._hop(1 << k, n_bytes / (2 << k)) for k in range(rounds)) + fold
