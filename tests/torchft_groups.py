"""torchft replica groups for the tests: each rank of a test's world a replica group of one, under
a lighthouse that rank 0 serves (the world's own group only hands the lighthouse's address round)."""

from __future__ import annotations

import contextlib
import pickle
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist


def replica_manager(rank: int, world: int, lighthouse: str, timeout: float = 30.0, asynchronous: bool = True) -> Any:
    """This rank as a replica group of one under the lighthouse (``asynchronous``: its quorum formed
    while the step's forward runs, as for DDP; synchronous for local SGD and DiLoCo)."""
    from gradcomp.experiments.replicas import one_rank_group

    return one_rank_group(f"replica{rank}", lighthouse, min_groups=world, timeout=timeout, synchronous=not asynchronous)


@contextlib.contextmanager
def served_lighthouse(rank: int, world: int) -> Iterator[str]:
    """Rank 0 serves a lighthouse for the block; every rank gets its address. It goes once every rank
    is done with it (one per run: the last run's replicas are gone)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=world) if rank == 0 else None
    address = [server.address() if server is not None else ""]
    dist.broadcast_object_list(address, src=0)
    try:
        yield address[0]
    finally:
        dist.barrier()
        if server is not None:
            server.shutdown()


@contextlib.contextmanager
def replica(rank: int, world: int, asynchronous: bool = True) -> Iterator[Any]:
    """This rank as a replica group of one under a lighthouse of its own, for the block."""
    with served_lighthouse(rank, world) as lighthouse:
        manager = replica_manager(rank, world, lighthouse, asynchronous=asynchronous)
        try:
            yield manager
        finally:
            manager.shutdown(wait=False)


def lose_and_restart(target: Callable[..., None], arguments: Callable[[int, bool], tuple[Any, ...]], die_at: int,
                     shared: dict[str, Any], results: Any) -> dict[int, tuple[Any, ...]]:  # fmt: skip
    """Three replica groups, each ``target(*arguments(replica, dies))`` in a process of its own under
    a lighthouse of its own (``arguments`` gets its address as ``shared["lighthouse"]``); the third
    dies (SIGKILL, by its own hand) and is started again once the others' progress
    (``shared["progress"]``, posted by replica 0) is three past ``die_at``. Returns what each put on
    ``results`` (pickled: replica first, then its outcome), by replica."""
    from torchft.coordination import LighthouseServer

    from gradcomp.launch import rank_context

    context = rank_context()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    shared["lighthouse"] = lighthouse.address()
    processes = [context.Process(target=target, args=arguments(r, r == 2)) for r in range(3)]
    finished: dict[int, tuple[Any, ...]] = {}
    try:
        for process in processes:
            process.start()
        processes[2].join(timeout=120)
        assert processes[2].exitcode == -9, "the third group was to die by SIGKILL"
        deadline = time.monotonic() + 60
        while shared["progress"].value < die_at + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shared["progress"].value >= die_at + 3, "the two groups left did not go on"
        processes.append(context.Process(target=target, args=arguments(2, False)))
        processes[-1].start()
        for _ in range(3):
            replica, *rest = pickle.loads(results.get(timeout=150))
            finished[replica] = tuple(rest)
    except queue.Empty:
        pytest.fail(f"only replicas {sorted(finished)} finished")
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        lighthouse.shutdown()
    assert sorted(finished) == [0, 1, 2]
    return finished
