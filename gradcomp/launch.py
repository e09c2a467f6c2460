"""Start p ranks of a function on this machine, each in its own process with a gloo group.

Used by ``gradcomp bench`` and by the distributed tests. Ranks meet on loopback at a port the OS
picks; every rank's result (or traceback) comes back to the caller; a rank that hangs or dies is a
clear error after ``timeout`` seconds, and every process is killed, never left behind.
(Emulated networks will start the same ranks inside network namespaces.)
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


class RankError(RuntimeError):
    """A rank raised, died or hung."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (bind to port 0: the OS chooses)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def spawn(
    world_size: int,
    target: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    backend: str = "gloo",
    group_timeout: float = 60.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` ranks; return results in rank order.

    ``target`` must be importable by name (a module-level function): ranks start by ``spawn``.
    ``group_timeout`` bounds every collective inside the ranks; ``timeout`` bounds the whole run.
    Raises :class:`RankError` with the rank's traceback if any rank fails, dies or times out.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[tuple[int, str, Any]] = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, port, backend, group_timeout, threads, target, tuple(args), results),
            name=f"gradcomp-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise RankError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if r not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    codes = {r: processes[r].exitcode for r in dead}
                    raise RankError(f"ranks {dead} died without a result (exit codes {codes})") from None
                continue
            outcomes[rank] = (status, value)
    finally:
        for process in processes:
            process.join(timeout=5 if len(outcomes) == world_size else 0)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
    failed = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if failed:
        # The first failure is often a consequence (a peer's connection closed): show them all.
        reports = "\n".join(f"rank {r} of {world_size} failed:\n{failed[r]}" for r in sorted(failed))
        raise RankError(reports)
    return [outcomes[r][1] for r in range(world_size)]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    group_timeout: float,
    threads: int,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    results: multiprocessing.Queue[tuple[int, str, Any]],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout),
        )
        results.put((rank, "ok", target(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # Tearing a group down can block on peers that failed; the parent has what it needs.
        results.close()
        results.join_thread()
        os._exit(0)
