"""Groups of gloo ranks kept for the whole test session, so that a test pays for its checks, not for
starting ranks (a rank forks from :func:`gradcomp.launch.rank_context`'s server, which imported
torch once, then imports the test module and joins a group: most of a short distributed test's time
on CI's 2 cores).

A :class:`RankPool` of ``world`` ranks runs one target at a time, each rank in the process it was
started in, inside the group it joined once. Before each target the ranks reset what a fresh process
would have (torch's seed, its thread count); after it they check that they are still in step: no
operation left on gradcomp's executor, and a small all-reduce on the world and on every group
gradcomp made that lands within :data:`HEALTH_TIMEOUT`. A pool that fails that check, or whose target
failed, died or missed its deadline, is closed (every process killed) and the next test starts a new
one: a test never inherits a broken group. Tests that break groups on purpose (a frozen or dead
peer) ask ``spawn_ranks(..., fresh=True)`` and get ranks of their own (``tests/distributed.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from gradcomp.launch import LOOPBACK, RankError, adopt, end_with, failure, failure_of, rank_context, spawn

HEALTH_TIMEOUT = datetime.timedelta(seconds=10)
"""How long the ranks' check after a target may wait for a peer: a healthy group answers in ms."""
MAX_POOLS = 3
"""Pools kept at once (the least recently used is closed first): each rank holds a few hundred MB."""


class RankPool:
    """``world`` ranks in one gloo group (collectives bounded by ``group_timeout`` seconds)."""

    def __init__(self, world: int, group_timeout: float) -> None:
        context = rank_context()
        self.world = world
        self._directory = tempfile.mkdtemp(prefix="gradcomp-pool-")
        store = os.path.join(self._directory, "store")
        self._tasks = [context.Queue() for _ in range(world)]
        self._results: multiprocessing.Queue[tuple[int, int, str, Any, bool]] = context.Queue()
        self._serial = 0
        self._processes = [
            context.Process(
                target=_rank_main,
                args=(rank, world, store, group_timeout, self._tasks[rank], self._results, dict(os.environ),
                      os.getpid()),
                name=f"gradcomp-pool-rank-{rank}",
                daemon=True,
            )
            for rank in range(world)
        ]
        for process in self._processes:
            process.start()
        self.open = True

    def run(self, target: Callable[..., Any], args: Sequence[Any], timeout: float) -> list[Any]:
        """Every rank's ``target(rank, world, *args)``, in rank order, within ``timeout`` seconds;
        :class:`RankError` (and the pool closed) if a rank raises, dies or misses the deadline."""
        self._serial += 1
        for tasks in self._tasks:
            tasks.put((self._serial, target, tuple(args)))
        outcomes: dict[int, tuple[str, Any, bool]] = {}
        try:
            self._collect(outcomes, timeout)
        except BaseException:
            self.close()
            raise
        if not all(healthy for _, _, healthy in outcomes.values()):
            self.close()  # the results stand; the group may not: the next test gets a new one
        failed = {r: value for r, (status, value, _) in outcomes.items() if status == "error"}
        if failed:
            raise failure_of(failed, self.world)  # as gradcomp.launch.spawn reports them
        return [outcomes[r][1] for r in range(self.world)]

    def _collect(self, outcomes: dict[int, tuple[str, Any, bool]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world)) - set(outcomes))
                raise RankError(f"ranks {missing} of {self.world} did not finish within {timeout:.0f} s")
            try:
                rank, serial, status, value, healthy = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._processes) if r not in outcomes and not p.is_alive()]
                if dead:
                    raise RankError(f"ranks {dead} of {self.world} died without a result") from None
                continue
            if serial == self._serial:
                outcomes[rank] = (status, value, healthy)

    def close(self) -> None:
        """Kill every rank and remove the group's store."""
        if not self.open:
            return
        self.open = False
        for process in self._processes:
            process.kill()
        for process in self._processes:
            process.join()
        self._results.close()
        for tasks in self._tasks:
            tasks.close()
        shutil.rmtree(self._directory, ignore_errors=True)


_pools: dict[tuple[int, float], RankPool] = {}
_INHERITED = ("LOCAL_WORLD_SIZE",)
"""Environment variables whose value a rank's work reads (the launcher's node layout)."""
_STARTED_IN = (os.getcwd(), tuple(sys.path), tuple(os.environ.get(name) for name in _INHERITED))
"""Where the session's ranks start: a rank imports its target by name, from the parent's directory
and path as they were when it started, and inherits the environment as it was then."""


def poolable() -> bool:
    """Whether a pool's ranks can run what this process would start now: not when the test moved to
    another directory or path (a user's model imported from there), nor set the launcher's layout
    (``LOCAL_WORLD_SIZE``, which fresh ranks inherit), nor with GRADCOMP_FRESH_RANKS=1."""
    now = (os.getcwd(), tuple(sys.path), tuple(os.environ.get(name) for name in _INHERITED))
    return now == _STARTED_IN and not os.environ.get("GRADCOMP_FRESH_RANKS")


def run_in_pool(
    world: int, target: Callable[..., Any], args: Sequence[Any], timeout: float, group_timeout: float
) -> list[Any]:
    """``target`` on the session's pool of ``world`` ranks with ``group_timeout`` (started if need be)."""
    key = (world, group_timeout)
    pool = _pools.pop(key, None)
    if pool is None or not pool.open:
        while len(_pools) >= MAX_POOLS:
            _pools.pop(next(iter(_pools))).close()
        pool = RankPool(world, group_timeout)
    _pools[key] = pool  # the most recently used last
    return pool.run(target, args, timeout)


def spawn_pooled(
    world_size: int,
    target: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    backend: str = "gloo",
    group_timeout: float = 60.0,
    threads: int = 1,
    network: str = "loopback",
) -> list[Any]:
    """:func:`gradcomp.launch.spawn`, with the ranks of a pool where a pool's ranks are what it would
    start (gloo on loopback, one thread each): what the training runs that tests launch use."""
    if backend == "gloo" and threads == 1 and network == "loopback" and poolable():
        return run_in_pool(world_size, target, args, timeout, group_timeout)
    return spawn(world_size, target, args, timeout=timeout, backend=backend, group_timeout=group_timeout,
                 threads=threads, network=network)  # fmt: skip


@atexit.register
def close_all() -> None:
    """Close every pool (at the end of the session)."""
    while _pools:
        _pools.popitem()[1].close()


def _rank_main(
    rank: int,
    world: int,
    store: str,
    group_timeout: float,
    tasks: multiprocessing.Queue[tuple[int, Callable[..., Any], tuple[Any, ...]] | None],
    results: multiprocessing.Queue[tuple[int, int, str, Any, bool]],
    environment: dict[str, str],
    launcher: int,
) -> None:
    adopt(environment)
    end_with(launcher)
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=group_timeout),
    )  # fmt: skip
    seed = torch.initial_seed()
    while (task := tasks.get()) is not None:
        serial, target, args = task
        torch.manual_seed(seed)  # as a fresh process starts
        torch.set_num_threads(1)
        try:
            value, status = target(rank, world, *args), "ok"
        except BaseException as error:
            value, status = failure(error), "error"
        healthy = status == "ok" and _in_step()
        results.put((rank, serial, status, value, healthy))
        if not healthy:
            return


def _in_step() -> bool:
    """Whether the group is ready for the next target: gradcomp's executor idle, and a small
    all-reduce on the world and on every group gradcomp made lands on every rank in time."""
    import torch
    import torch.distributed as dist

    from gradcomp.collectives import executor, groups

    with contextlib.suppress(Exception):
        if executor._executor is not None and executor._executor._pending:
            return False
        for group in [dist.group.WORLD, *groups._private.values()]:
            if group not in dist.distributed_c10d._world.pg_map:
                continue
            flag = torch.ones(1)
            dist.all_reduce(flag, group=group, async_op=True).wait(HEALTH_TIMEOUT)
            if flag.item() != dist.get_world_size(group):
                return False
        return True
    return False
