"""Start p ranks of a function on this machine, each in its own process with a gloo group.

Used by ``gradcomp bench``, the training runs started here and the distributed tests. Ranks meet
through a file store in a private temporary directory, so nothing listens for the rendezvous on
any network, and gloo binds to loopback (``lo``): a local run exposes no port beyond this machine.
Every rank's result (or traceback) comes back to the caller; a rank that hangs or dies is a clear
error after ``timeout`` seconds, and every process is killed, never left behind (a rank also ends
with the process that started it, should that be killed before it can clean up). With ``network=``
(a :mod:`gradcomp.netem` profile) the ranks run inside emulated network namespaces and gloo uses
their interface there; the namespaces are gone when ``spawn`` returns.

Ranks start from a fork server (:func:`rank_context`) that imported torch and gradcomp once, so a
rank starts in a few milliseconds instead of the seconds of a fresh interpreter's imports (most of a
short training run's CPU time on a small machine); each rank gets the caller's environment, working
directory and path as they are when it starts. ``GRADCOMP_START_METHOD=spawn`` starts fresh
interpreters instead.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import pickle
import queue
import select
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from gradcomp import netem

logger = logging.getLogger(__name__)


START_METHOD = "GRADCOMP_START_METHOD"
"""The environment variable that chooses how ranks start: ``forkserver`` (the default where the
platform has it) or ``spawn``."""
PRELOAD = ["torch", "torch.distributed"]
"""What the fork server imports once, for every rank it starts: torch, then what the layers above the
core add with :func:`preload` as they are imported."""


def preload(module: str) -> None:
    """Have the fork server import ``module`` once, for every rank it starts, rather than each rank
    importing it itself (a 2-rank start whose ranks import the hooks themselves takes 1 to 1.5 s on
    2 cores; with them preloaded, under 0.1 s). The layers above the core call it for themselves when they are
    imported, so the core names none of them: a process that starts ranks has imported what they
    run. A process's fork server starts at its first rank and reads the list then; a module added
    after that is imported by each rank that needs it, as without a fork server."""
    if module not in PRELOAD:
        PRELOAD.append(module)


def rank_context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The multiprocessing context ranks start from: a fork server that imported :data:`PRELOAD`
    (started at the first rank, one per process, with the list as it is then), or ``spawn`` where
    :data:`START_METHOD` asks for it or the platform has no fork server. Never plain ``fork``:
    forking a process that runs threads (a training loop's, gloo's) can copy a held lock."""
    method = os.environ.get(START_METHOD) or (
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_METHOD}={method!r}: valid start methods are forkserver and spawn")
    if method == "spawn":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


class RankError(RuntimeError):
    """A rank raised, died or hung.

    Its text is one line where every rank raised the same error of a user's (:func:`is_user_error`:
    a ValueError or TypeError, bad input, with the same message on every rank): that message, once.
    Otherwise it holds every failed rank's traceback (the first failure is often a consequence of
    another's). :attr:`report` always holds every traceback, for a run's record or ``--verbose``."""

    def __init__(
        self, message: str, report: str | None = None, *, user_error: bool = False, summary: str | None = None
    ) -> None:
        super().__init__(message)
        self.report = message if report is None else report
        """Every failed rank's traceback (or what happened to the ranks that gave none)."""
        self.user_error = user_error
        """Whether every rank raised the same user error, which the text then is, in one line."""
        self.summary = summary or (message if user_error else (message.strip().splitlines() or [""])[-1])
        """One line: the user's error, or the first failed rank's error (``rank 0 of 2: PeerError: ...``),
        or what happened (``ranks [1] died ...``)."""


USER_ERRORS = (ValueError, TypeError)
"""What bad input raises (``gradcomp.errors``): a user's mistake, reported as its message alone."""


def is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is a user's (bad input: a ValueError or TypeError), whose message says all a
    user needs, rather than a defect or a failure between ranks, whose traceback matters."""
    return isinstance(error, USER_ERRORS)


class Failure(NamedTuple):
    """What a rank that raised sends back: its traceback, and the error in one line."""

    traceback: str
    line: str
    """``PeerError: message`` (the type's name, then the message on one line: :func:`one_line`)."""
    user_error: bool
    message: str
    """The message alone, on one line: what a user's error is reported as."""


def one_line(error: BaseException, *, named: bool = True) -> str:
    """``error`` as one line: its type's name (unless ``named`` is false) and its message (the lines
    of a longer one joined)."""
    message = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    if not named:
        return message or type(error).__name__
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def failure(error: BaseException) -> Failure:
    """What a rank sends back for ``error``, raised by its target (inside the ``except`` that caught it)."""
    return Failure(traceback.format_exc(), one_line(error), is_user_error(error), one_line(error, named=False))


def failure_of(failed: dict[int, Failure], world_size: int) -> RankError:
    """The error for ranks that raised (rank -> :class:`Failure`): the one line every rank raised
    alike when it is a user's error, else every rank's traceback."""
    report = "\n".join(f"rank {r} of {world_size} failed:\n{failed[r].traceback}" for r in sorted(failed))
    lines = {failure.line for failure in failed.values()}
    if len(failed) == world_size and len(lines) == 1 and all(f.user_error for f in failed.values()):
        return RankError(f"{failed[0].message} (all {world_size} ranks)", report, user_error=True)
    # The first failure is often a consequence (a peer's connection closed): show them all.
    first = min(failed)
    return RankError(report, summary=f"rank {first} of {world_size}: {failed[first].line}")


class Place(NamedTuple):
    """Where a rank runs: its network namespace (None: this machine's), the interface gloo uses, and
    on an emulated cluster its node, the ranks per node (torchrun's ``GROUP_RANK``,
    ``LOCAL_WORLD_SIZE``; None on one switch, where the caller's environment says) and its node's switch."""

    namespace: str | None
    interface: str
    node: int | None = None
    per_node: int | None = None
    switch: str | None = None
    """On an emulated cluster, the namespace of the rank's node switch (``netem.NODE_SWITCH``)."""


LOOPBACK = "lo"


def spawn(
    world_size: int,
    target: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    backend: str = "gloo",
    group_timeout: float = 60.0,
    threads: int = 1,
    network: str | netem.Network = "loopback",
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` ranks; return results in rank order.

    ``target`` must be importable by name (a module-level function): ranks import it.
    ``group_timeout`` bounds every collective inside the ranks; ``timeout`` bounds the whole run.
    ``network`` is a :class:`gradcomp.netem.Profile` or :class:`~gradcomp.netem.Cluster`, or its text
    (``loopback``, ``1gbit``, ``nodes=2x2,intra=10gbit,inter=100mbit``, ...). On a cluster each rank
    finds its node's layout where torchrun puts it: ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``.
    Raises :class:`RankError` if any rank fails, dies or times out (with each failed rank's traceback;
    a user's error that every rank raised alike, a ValueError or TypeError, in one line: its message,
    once), and :class:`gradcomp.netem.NetemError` if the network cannot be built here.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    profile = netem.parse(network) if isinstance(network, str) else network
    options = (timeout, backend, group_timeout, threads)
    with tempfile.TemporaryDirectory(prefix="gradcomp-store-") as directory:
        store = os.path.join(directory, "store")  # private to this user (0700), removed at the end
        if not profile.emulated:
            return _spawn(world_size, target, tuple(args), [Place(None, LOOPBACK)] * world_size, store, *options)
        with netem.EmulatedNetwork(world_size, profile) as net:
            places = [Place(net.namespace(r), netem.INTERFACE) for r in range(world_size)]
            if isinstance(profile, netem.Cluster):
                places = [
                    p._replace(node=profile.node(r), per_node=profile.per_node, switch=net.node_switch(profile.node(r)))
                    for r, p in enumerate(places)
                ]
            return _spawn(world_size, target, tuple(args), places, store, *options)


def _spawn(
    world_size: int,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    places: list[Place],
    store: str,
    timeout: float,
    backend: str,
    group_timeout: float,
    threads: int,
) -> list[Any]:
    context = rank_context()
    results: multiprocessing.Queue[tuple[int, str, Any]] = context.Queue()  # (rank, "ok" or "error", what)
    common = (store, backend, group_timeout, threads, target, args, results, dict(os.environ), os.getpid())
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, places[rank], *common),
            name=f"gradcomp-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        for process in processes:  # inside: what interrupts the start (SIGTERM) kills those started
            process.start()
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
                    codes = "{" + ", ".join(f"{r}: {_exit_status(processes[r].exitcode)}" for r in dead) + "}"
                    raise RankError(f"ranks {dead} died without a result (exit codes {codes})") from None
                continue
            outcomes[rank] = (status, value)
    finally:
        for process in (p for p in processes if p.pid is not None):  # started
            process.join(timeout=5 if len(outcomes) == world_size else 0)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
    failed = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if failed:
        raise failure_of(failed, world_size)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def adopt(environment: dict[str, str]) -> None:
    """Take the caller's environment as it was when the rank started (a fork server's is its own,
    from when it started)."""
    if os.environ != environment:
        os.environ.clear()
        os.environ.update(environment)


def end_with(launcher: int) -> None:
    """End this rank (exit status 1) as soon as the process that started it ends. A rank's parent is
    the fork server (or, started by ``spawn``, an orphan's new parent), so a launcher killed before
    its cleanup (SIGKILL, a SIGTERM without a handler) would leave its ranks training on alone, to
    the end of the run or of the group's timeout. Costs a thread blocked in ``poll`` on a pidfd
    (Linux; elsewhere it polls the pid once a second)."""
    threading.Thread(target=_watch, args=(launcher,), name="gradcomp-launcher-watch", daemon=True).start()


def _watch(launcher: int) -> None:
    """Wait for the launcher's end, then end this process."""
    try:
        if hasattr(os, "pidfd_open"):
            poll = select.poll()
            poll.register(os.pidfd_open(launcher), select.POLLIN)  # readable once the launcher has ended
            poll.poll()
        else:  # pragma: no cover - macOS
            while True:
                os.kill(launcher, 0)
                time.sleep(1.0)
    except ProcessLookupError:  # already gone
        pass
    logger.error("the launcher (pid %d) of this rank (pid %d) ended; ending it too", launcher, os.getpid())
    os._exit(1)


def _exit_status(code: int | None) -> str:
    """``-6`` -> ``"SIGABRT"`` (killed by a signal), else the exit code."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return str(code)


def _rank_main(
    rank: int,
    world_size: int,
    place: Place,
    store: str,
    backend: str,
    group_timeout: float,
    threads: int,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    results: multiprocessing.Queue[tuple[int, str, Any]],
    environment: dict[str, str],
    launcher: int,
) -> None:
    try:
        adopt(environment)
        # First, before torch starts any thread: a thread inherits its creator's network namespace.
        if place.namespace is not None:
            netem.enter(place.namespace)
        os.environ["GLOO_SOCKET_IFNAME"] = place.interface
        if place.node is not None and place.per_node is not None:  # the node's layout, as torchrun gives it
            os.environ.update(LOCAL_RANK=str(rank % place.per_node), LOCAL_WORLD_SIZE=str(place.per_node),
                              GROUP_RANK=str(place.node), **{netem.NODE_SWITCH: place.switch or ""})  # fmt: skip
        end_with(launcher)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout),
        )
        value = target(rank, world_size, *args)
        # Stay until every rank is done with the group: a rank that exits at once (a quick target)
        # can close its end of the mesh while a slower peer is still connecting to it, failing that
        # peer's init ("Connection closed by peer"). A failed peer's exit ends this wait at once.
        if dist.is_initialized():  # (the target may have destroyed the group itself)
            with contextlib.suppress(RuntimeError):
                dist.barrier()
        # Pickled here, by value: the queue's own pickler would share a tensor's storage through
        # a file descriptor that this process serves until it exits, which it does at once below
        # (a parent that reads late then finds the connection reset).
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as error:
        results.put((rank, "error", failure(error)))
    finally:
        # Tearing a group down can block on peers that failed; the parent has what it needs.
        results.close()
        results.join_thread()
        os._exit(0)
