"""Distributed tests: start gloo ranks with a deadline, collect every rank's failures, assert here.

A rank target is a module-level function ``target(rank, world, *args)`` (ranks import it by name).
It runs every check of its scenario inside one group of ranks (starting a rank costs seconds) and
returns its failures: a list of strings (a :class:`Failures`), or a dict holding that list under
``"failures"`` beside any figures the parent asserts on. :func:`run_checks` starts the group and
fails the test with every rank's failures, each naming its rank; :func:`spawn_ranks` only starts it.
Inside the ranks, :func:`identical_on_all_ranks` and :func:`torch_all_reduce` are the references.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradcomp.launch import spawn
from tests.rank_pool import poolable, run_in_pool

# No group of ranks may take longer than this (pytest's own limit per test, pyproject.toml).
MAX_TIMEOUT = 300.0
# Failures shown per test: the first ones are the informative ones, the rest often consequences.
SHOWN = 20


def stay_until_written(record: str, at_most: float) -> None:
    """Stay alive and silent, as a peer stuck in user code does, until ``record`` exists (the peer
    under test wrote what it saw) or ``at_most`` seconds have passed: a fault test then lasts as long
    as the wait it checks, not a fixed sleep sized for the slowest machine."""
    deadline = time.monotonic() + at_most
    while not Path(record).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def peer_stops(rank: int, how: str, record: str, attempt: Callable[[], object], kept: Callable[[], object],
               at_most: float) -> None:
    """A fault scenario at 2 ranks, called by both at the same point: rank 1 stops, frozen by SIGSTOP
    (``how="frozen"``; rank 0 wakes it when done) or alive and silent (``"alive"``, as a peer that
    failed in user code, for at most ``at_most`` s); rank 0 runs ``attempt`` (its next communicating
    call) and writes to ``record``, with ``repr``, how long it took, the error it raised (type: message)
    and the type of the error the hook state kept, ``kept()``."""
    pids: list[int | None] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        if how == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 has its error and wakes this one up
        else:
            stay_until_written(record, at_most)
        return
    began = time.monotonic()
    try:
        attempt()
        error = "no error"
    except RuntimeError as caught:  # gradcomp's PeerError, or autograd's or DDP's wrapping of it
        error = f"{type(caught).__name__}: {caught}"
    elapsed = time.monotonic() - began
    if how == "frozen":
        os.kill(pids[1], signal.SIGCONT)  # type: ignore[arg-type]
    Path(record).write_text(repr({"elapsed": elapsed, "error": error, "kept": type(kept()).__name__}))


class Failures(list[str]):
    """A rank's failures, collected as its checks run (a failed check does not stop the others)."""

    def expect(self, ok: bool, what: str) -> None:
        """Record ``what`` as a failure unless ``ok``."""
        if not ok:
            self.append(what)


def spawn_ranks(
    world: int,
    target: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    timeout: float,
    group_timeout: float = 60.0,
    network: str = "loopback",
    fresh: bool = False,
    backend: str = "gloo",
) -> list[Any]:
    """Every rank's result of ``target(rank, world, *args)``, in rank order, within ``timeout`` seconds.

    On loopback the ranks come from the session's pool of ``world`` ranks (``tests/rank_pool.py``:
    started once, checked after every target); ``fresh`` starts ranks of their own instead, for a
    target that breaks its group on purpose (a frozen or dead peer), as does setting the environment
    variable ``GRADCOMP_FRESH_RANKS=1`` for the whole run.
    Raises :class:`gradcomp.launch.RankError` if a rank raises, dies or misses the deadline.
    """
    assert 0 < timeout <= MAX_TIMEOUT, f"a group of ranks needs a deadline of at most {MAX_TIMEOUT:.0f} s"
    if network == "loopback" and backend == "gloo" and not fresh and poolable():
        return run_in_pool(world, target, args, timeout, group_timeout)
    return spawn(world, target, args, timeout=timeout, group_timeout=group_timeout, network=network, backend=backend)


def failures_of(results: Sequence[Any]) -> list[str]:
    """Every rank's failures, each as ``rank r of p: failure``."""
    messages = []
    for rank, result in enumerate(results):
        failures = result["failures"] if isinstance(result, dict) else result
        if not isinstance(failures, list):
            raise TypeError(f"rank {rank} returned {type(result).__name__}, not its failures")
        messages += [f"rank {rank} of {len(results)}: {failure}" for failure in failures]
    return messages


def assert_no_failures(results: Sequence[Any]) -> None:
    """Fail with the first failures of every rank, if any rank had one."""
    messages = failures_of(results)
    more = f"\n... and {len(messages) - SHOWN} more" if len(messages) > SHOWN else ""
    assert not messages, "\n".join(messages[:SHOWN]) + more


def run_checks(world: int, target: Callable[..., Any], args: Sequence[Any] = (), **options: Any) -> list[Any]:
    """:func:`spawn_ranks` (the same ``options``) for a target that returns its failures; assert that
    none failed, and return the results (for the figures that the parent checks across ranks)."""
    results = spawn_ranks(world, target, args, **options)
    assert_no_failures(results)
    return results


# -- inside the ranks ---------------------------------------------------------------------------


def identical_on_all_ranks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (the same shape on every rank) is bitwise the same on every rank.

    Its bytes are gathered as int32 words (gloo gathers no 1- or 2-byte types), so every dtype
    compares bit for bit: -0.0 differs from 0.0, and NaNs compare by their bits.
    """
    words = _words(tensor)
    copies = [torch.empty_like(words) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, words)
    return all(torch.equal(copy, words) for copy in copies)


def identical_each_on_all_ranks(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each of ``tensors`` (the same shapes on every rank) is bitwise the same on every rank,
    as :func:`identical_on_all_ranks` says, in one all-gather for them all (one per tensor costs a
    collective each: most of a test that checks hundreds of small results)."""
    words = [_words(t) for t in tensors]
    mine = torch.cat(words) if words else torch.zeros(0, dtype=torch.int32)
    copies = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, mine)
    theirs = [copy.split([w.numel() for w in words]) for copy in copies]  # per rank, per tensor
    return [all(torch.equal(pieces[i], w) for pieces in theirs) for i, w in enumerate(words)]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as int32 words, zero-padded (gloo gathers no 1- or 2-byte types)."""
    raw = _bytes(tensor)
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - raw.numel() % 4)])
    return raw.view(torch.int32)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def parameters_identical_on_all_ranks(parameters: Sequence[torch.Tensor]) -> bool:
    """Whether every parameter (or gradient) is bitwise the same on every rank."""
    return identical_on_all_ranks(torch.cat([_bytes(p) for p in parameters]))


TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # gloo has no AVG: divided by p afterwards
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


def torch_all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """torch's own all-reduce of a copy of ``x`` (``avg`` as the sum over p): the reference."""
    reference = x.clone()
    dist.all_reduce(reference, op=TORCH_OPS[op])
    if op == "avg":
        reference /= dist.get_world_size()
    return reference
