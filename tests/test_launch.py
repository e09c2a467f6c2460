"""The rank launcher: results in rank order, and every failure mode a clear error, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from gradcomp.launch import RankError, free_port, spawn


def identify(rank: int, world: int, offset: int) -> tuple[int, int, int]:
    return rank + offset, world, dist.get_world_size()


def fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def die_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


def hang(rank: int, world: int) -> None:
    time.sleep(3600)


def test_results_come_back_in_rank_order() -> None:
    assert spawn(3, identify, (10,), timeout=60) == [(10, 3, 3), (11, 3, 3), (12, 3, 3)]


def test_a_raising_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed.*ValueError: rank one is unhappy"):
        spawn(2, fail_on_rank_one, timeout=60)


def test_a_dying_rank_is_reported() -> None:
    with pytest.raises(RankError, match=r"ranks \[1\] died without a result \(exit codes \{1: 7\}\)"):
        spawn(2, die_on_rank_one, timeout=60)


def test_a_hanging_rank_times_out_and_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0\] of 1 did not finish within 8 s"):
        spawn(1, hang, timeout=8)
    assert time.monotonic() - start < 30


def abort_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        os.abort()  # what gloo does on a collective mismatch
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_named() -> None:
    with pytest.raises(RankError, match=r"ranks \[1\] died without a result \(exit codes \{1: SIGABRT\}\)"):
        spawn(2, abort_on_rank_one, timeout=60, group_timeout=10)


def test_free_port_is_a_valid_port() -> None:
    assert 1024 <= free_port() < 65536
    with pytest.raises(ValueError, match="world_size"):
        spawn(0, identify)
