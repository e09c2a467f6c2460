"""The cost model against its closed forms and the crossovers it must predict."""

from __future__ import annotations

import pytest

from gradcomp.collectives import cost_model
from gradcomp.collectives.cost_model import LinkCosts, all_reduce_seconds, busbw, bytes_sent, fastest

SLOW = LinkCosts(alpha=1e-3, beta=1e-9)  # 1 ms latency, 1 GB/s


def test_ring_matches_the_alpha_beta_formula() -> None:
    n, p = 100e6, 8
    assert all_reduce_seconds("ring", n, p, SLOW) == pytest.approx(2 * 7 * 1e-3 + 2 * 7 / 8 * n * 1e-9)


def test_small_messages_prefer_few_messages_and_large_ones_bandwidth() -> None:
    # short tensors: recursive doubling's lg p messages < the tree's 2 lg p < the ring's 2 (p - 1)
    assert fastest(4096, 16, SLOW) == "halving_doubling"
    assert all_reduce_seconds("tree", 4096, 16, SLOW) < all_reduce_seconds("ring", 4096, 16, SLOW)
    big = 256e6
    assert all_reduce_seconds("tree", big, 16, SLOW) > 2 * all_reduce_seconds("ring", big, 16, SLOW)
    ring, hd = all_reduce_seconds("ring", big, 16, SLOW), all_reduce_seconds("halving_doubling", big, 16, SLOW)
    # the same bandwidth term; halving-doubling pays 2 lg p latencies instead of 2 (p - 1)
    assert ring - hd == pytest.approx((2 * 15 - 2 * 4) * SLOW.alpha)


def test_hierarchical_moves_a_local_size_th_across_groups() -> None:
    fast, slow = LinkCosts(alpha=1e-5, beta=1e-11), LinkCosts(alpha=1e-3, beta=1e-9)
    flat = all_reduce_seconds("ring", 1e9, 32, slow)
    two_level = all_reduce_seconds("hierarchical", 1e9, 32, fast, local_size=8, across=slow)
    assert two_level < flat / 4


def test_bytes_and_busbw() -> None:
    assert bytes_sent("ring", 1000, 4) == 1500
    assert bytes_sent("halving_doubling", 1 << 20, 4) == 1.5 * (1 << 20)
    assert bytes_sent("tree", 1000, 4) == 6000
    assert busbw(1e9, 2, 1.0) == 1e9
    with pytest.raises(ValueError, match="no closed form"):
        bytes_sent("halving_doubling", 1 << 20, 3)


def test_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'star'"):
        all_reduce_seconds("star", 1, 2, SLOW)
    with pytest.raises(ValueError, match="local_size"):
        all_reduce_seconds("hierarchical", 1, 6, SLOW, local_size=4)
    with pytest.raises(ValueError, match=">= 0"):
        LinkCosts(alpha=-1, beta=0)
    assert all_reduce_seconds("ring", 1e6, 1, SLOW) == 0.0
    assert set(cost_model.MODELED) == {"ring", "tree", "halving_doubling", "hierarchical"}
