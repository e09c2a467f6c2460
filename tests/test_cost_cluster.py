"""Collective times on clusters of nodes against hand-computed rounds, and the flat model where they meet."""

from __future__ import annotations

import math

import pytest

from gradcomp.collectives.cost_model import LinkCosts, all_reduce_seconds
from gradcomp.cost.cluster import ALL_REDUCE, Cluster

INTER = LinkCosts(alpha=1e-4, beta=1e-9)  # 100 us, 1 GB/s per rank
INTRA = LinkCosts(alpha=2e-6, beta=1e-11)  # 2 us, 100 GB/s
N = 64e6  # bytes per rank


def test_one_link_everywhere_is_the_flat_model() -> None:
    for p in (2, 3, 8, 12):
        flat = Cluster(p, INTER)
        for algo in ("ring", "tree", "halving_doubling"):
            assert flat.all_reduce(algo, N) == pytest.approx(all_reduce_seconds(algo, N, p, INTER))
        assert flat.all_reduce("native", N) == pytest.approx(all_reduce_seconds("ring", N, p, INTER))


def test_multi_node_rounds_by_hand() -> None:
    cluster = Cluster(8, INTER, local_size=2, intra=INTRA)
    a_i, b_i, a_e, b_e = INTRA.alpha, INTRA.beta, INTER.alpha, INTER.beta
    # the ring crosses a node boundary in each of its 2 (p - 1) rounds of n / p
    assert cluster.all_reduce("ring", N) == pytest.approx(14 * (a_e + N / 8 * b_e))
    # tree: distance 1 stays inside a node, distances 2 and 4 cross; each round twice (reduce, broadcast)
    assert cluster.all_reduce("tree", N) == pytest.approx(2 * ((a_i + N * b_i) + 2 * (a_e + N * b_e)))
    # halving-doubling: distance 1 moves n / 2 inside, distances 2 and 4 move n / 4 and n / 8 across
    expected = 2 * ((a_i + N / 2 * b_i) + (a_e + N / 4 * b_e) + (a_e + N / 8 * b_e))
    assert cluster.all_reduce("halving_doubling", N) == pytest.approx(expected)
    # hierarchical: a ring inside each node of 2, then a ring of n / 2 over the 4 nodes
    inside = 2 * (a_i + N / 2 * b_i)
    assert cluster.all_reduce("hierarchical", N) == pytest.approx(inside + 6 * (a_e + N / 2 / 4 * b_e))
    # in-network: the switch reduces; each rank sends its shard once and receives the sum once
    assert cluster.all_reduce("in_network", N) == pytest.approx(inside + 2 * a_e + N / 2 * b_e)


def test_bytes_each_rank_sends() -> None:
    flat, nodes = Cluster(8, INTER), Cluster(8, INTER, local_size=2, intra=INTRA)
    assert flat.all_reduce_bytes("ring", N) == flat.all_reduce_bytes("native", N) == pytest.approx(2 * 7 / 8 * N)
    assert flat.all_reduce_bytes("halving_doubling", N) == pytest.approx(2 * 7 / 8 * N)
    assert Cluster(6, INTER).all_reduce_bytes("halving_doubling", N) == pytest.approx(2 * 3 / 4 * N + N)
    assert flat.all_reduce_bytes("tree", N) == 2 * N
    assert nodes.all_reduce_bytes("hierarchical", N) == pytest.approx(2 * 1 / 2 * N + 2 * 3 / 4 * N / 2)
    assert nodes.all_reduce_bytes("in_network", N) == pytest.approx(2 * 1 / 2 * N + N / 2)
    assert Cluster(1, INTER).all_reduce_bytes("ring", N) == 0


def test_in_network_reduction_beats_the_ring_at_scale() -> None:
    big = Cluster(1024, INTER, local_size=8, intra=INTRA)
    ring, switch = big.all_reduce("ring", N), big.all_reduce("in_network", N)
    assert switch < ring / 2  # half the bytes across nodes, 2 latencies instead of 2 (p - 1)
    assert big.all_reduce("hierarchical", N) < ring


def test_gathers_and_all_to_all() -> None:
    cluster = Cluster(4, INTER)
    assert cluster.all_gather(1e6) == pytest.approx(3 * (INTER.alpha + 1e6 * INTER.beta))
    assert cluster.all_to_all(1e6) == pytest.approx(3 * (INTER.alpha + 1e6 / 4 * INTER.beta))
    fitted = LinkCosts(alpha=5e-4, beta=2e-9)
    measured = Cluster(4, INTER, native_all_reduce=fitted, native_all_gather=fitted)
    assert measured.all_reduce("native", N) == pytest.approx(all_reduce_seconds("ring", N, 4, fitted))
    assert measured.all_gather(1e6) == pytest.approx(3 * (fitted.alpha + 1e6 * fitted.beta))


def test_one_rank_costs_nothing_and_bad_input_is_refused() -> None:
    alone = Cluster(1, INTER)
    assert all(alone.all_reduce(a, N) == 0 for a in ALL_REDUCE)
    assert alone.all_gather(N) == alone.all_to_all(N) == 0
    with pytest.raises(ValueError, match="do not divide"):
        Cluster(6, INTER, local_size=4)
    with pytest.raises(ValueError, match="ranks >= 1"):
        Cluster(0, INTER)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'star'"):
        Cluster(4, INTER).all_reduce("star", N)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'star'"):
        Cluster(8, INTER, local_size=2).all_reduce("star", N)
    with pytest.raises(ValueError, match=">= 0"):
        Cluster(4, INTER).all_reduce("ring", -1)
    assert math.isfinite(Cluster(6, INTER, local_size=2).all_reduce("halving_doubling", N))


def test_a_shared_uplink_divides_among_the_ranks_crossing_at_once() -> None:
    """A NIC per node: a node-major ring crosses one rank per node per round (unchanged); the
    hierarchical shards cross from every local rank at once (L times the bytes' time); all-to-all's
    rounds as many times as ranks of a node cross in them."""
    inter, intra = LinkCosts(0.01, 1e-6), LinkCosts(0.0, 1e-9)
    own = Cluster(4, inter, local_size=2, intra=intra)
    shared = Cluster(4, inter, local_size=2, intra=intra, shared_uplink=True)
    assert shared.all_reduce("ring", 1e6) == own.all_reduce("ring", 1e6)
    assert shared.all_gather(1e6) == own.all_gather(1e6)
    inside = all_reduce_seconds("ring", 1e6, 2, intra)
    assert own.all_reduce("hierarchical", 1e6) == pytest.approx(inside + 2 * 0.01 + 5e5 * 1e-6)
    assert shared.all_reduce("hierarchical", 1e6) == pytest.approx(inside + 2 * 0.01 + 2 * 5e5 * 1e-6)
    # rank r sends to r + k: k = 1 and 3, one rank of each node crosses; k = 2, both do
    assert shared.all_to_all(4e6) == pytest.approx(3 * 0.01 + (1 + 2 + 1) * 1e6 * 1e-6)
    # a calibrated fit of the backend's collectives across nodes shares the uplink alike
    fit = LinkCosts(0.002, 3e-6)
    assert shared.crossing(2, fit) == LinkCosts(0.002, 6e-6) and own.crossing(2, fit) == fit
    assert own.all_to_all(4e6) == pytest.approx(3 * (0.01 + 1e6 * 1e-6))
    assert shared.crossing(1) == inter and shared.crossing(2).beta == 2e-6 and own.crossing(2) == inter
