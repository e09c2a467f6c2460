"""``run.json``: what a run was (config, task, environment), how it ended (status, metrics, error).

Written by rank 0 when a run starts (status ``running``) and ends (``finished``, or ``stopped`` at
``stop_at``), and by the launcher when a run fails (``failed``, with the error) or is stopped by
SIGTERM or Ctrl-C (``interrupted``). A sweep decides from
the status alone what to skip on a rerun: ``finished`` runs are kept, all others run again.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import glob
import json
import os
import platform
import socket
import sys
import tempfile
from collections.abc import Iterator
from importlib import metadata
from typing import IO, Any

import torch

from gradcomp.bench.report import machine

STATUSES = ("running", "finished", "stopped", "failed", "interrupted")


def environment(world_size: int, backend: str, network: str, threads: int) -> dict[str, Any]:
    """Versions and the machine, for run.json."""

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        **machine(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python_implementation": platform.python_implementation(),
        "gradcomp": version("gradcomp"),
        "numpy": version("numpy"),
        "tensorboard": version("tensorboard"),
        "cuda_version": torch.version.cuda,
        "world_size": world_size,
        "backend": backend,
        "network": network,
        "threads_per_rank": threads,
        "cpus": os.cpu_count(),
        "torchrun": "TORCHELASTIC_RUN_ID" in os.environ,
        "argv": sys.argv,
    }


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def path(out: str) -> str:
    return os.path.join(out, "run.json")


def read(out: str) -> dict[str, Any] | None:
    """The run.json in ``out``, or None if there is none (or it is unreadable: a run cut short while writing)."""
    try:
        with open(path(out)) as file:
            record = json.load(file)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write(out: str, record: dict[str, Any]) -> None:
    """Write run.json atomically (a reader never sees half a file, two writers never share a file)."""
    if record.get("status") not in STATUSES:
        raise ValueError(f"run status must be one of {STATUSES}, got {record.get('status')!r}")
    os.makedirs(out, exist_ok=True)
    record = {**record, "updated": now()}
    with atomic(path(out), "w") as file:
        json.dump(record, file, indent=2, default=str)
        file.write("\n")


@contextlib.contextmanager
def atomic(target: str, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file that replaces ``target`` only once written whole (a unique temporary beside it)."""
    # The writer's pid in the name: a temporary of no live writer is stale (remove_stale_temporaries)
    handle, temporary = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(target)), prefix=f"{TEMPORARY}{os.getpid()}-"
    )
    try:
        with os.fdopen(handle, mode) as file:
            yield file
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


TEMPORARY = ".tmp-"
"""How :func:`atomic`'s temporaries are named: ``.tmp-<writer's pid>-<random>``."""


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporaries in ``directory`` that no live process writes (a writer killed while
    saving, by SIGKILL or a power cut, leaves its temporary: a checkpoint's size); the names removed.
    One of an earlier version, whose name holds no pid, is stale too: call this where no other run
    writes (a run directory, under its :func:`lock`)."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if not name.startswith(TEMPORARY):
                continue
            pid = name[len(TEMPORARY) :].split("-", 1)[0]
            if pid.isdigit() and _alive(int(pid)):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, name))
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


RUN_LOCK = ".run.lock"
"""The file a run holds locked in its directory while it runs (:func:`lock`)."""


def lock(out: str) -> contextlib.AbstractContextManager[None]:
    """Hold ``OUT/.run.lock`` while a run writes to ``out``: a second run on the same directory (two
    ``--resume auto`` at once) is refused instead of writing its steps, events and checkpoints
    between the first's."""
    check_out(out)
    os.makedirs(out, exist_ok=True)
    refusal = f"another run is writing in {out} ({{holder}}): wait for it to end, or give another --out"
    return exclusive(os.path.join(out, RUN_LOCK), refusal)


@contextlib.contextmanager
def exclusive(lock_path: str, refusal: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (created if need be; it says the holder's pid) for the
    block; held by another process, a ``ValueError`` of ``refusal`` (its ``{holder}``: the holder's
    pid). The lock ends with the process that holds it, however it ends (``fcntl.flock``)."""
    with open(lock_path, "a+") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            raise ValueError(refusal.format(holder=file.read().strip() or "another process")) from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()}")
        file.flush()
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def record_failure(out: str, name: str, config: dict[str, Any], error: str, status: str = "failed") -> None:
    """Mark a run failed (or ``status``: ``interrupted``, by SIGTERM or Ctrl-C), keeping what rank 0
    had written about it. A finished run stays finished: an attempt that fails before it starts (a
    refused resume) changes nothing of it."""
    record = read(out) or {"name": name, "config": config, "started": now()}
    if record.get("status") == "finished":
        return
    record.update(status=status, error=error)
    write(out, record)


def check_out(out: str) -> None:
    """Refuse, before any rank starts, an output that cannot hold a run: a file, or a directory
    (or the nearest existing parent of one to create) that this process cannot write."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out {out!r} is a file, not a directory for the run")
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"out {out!r}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"out {out!r}: {existing} is not writable")


def prepare(out: str, checkpoint: str, resume: str | None, overwrite: bool) -> None:
    """Make ``out`` ready for a run, before its ranks start, so that two runs never mix in one
    directory (TensorBoard would interleave their curves).

    A directory that holds another run (a run.json, events or a checkpoint) is refused unless the
    run resumes (``resume``: what it continues is checked against its settings when loaded) or
    ``overwrite`` removes that run first. A run that resumes but finds no checkpoint starts over, so
    the events of the earlier attempt are removed too.
    """
    check_out(out)
    remove_stale_temporaries(out)
    events = glob.glob(os.path.join(out, "events.out.tfevents.*"))
    record = read(out)
    held = [p for p in (path(out), checkpoint) if os.path.exists(p)] + events
    if not held:
        return
    if overwrite or (resume == "auto" and not os.path.isfile(checkpoint)):
        for stale in held:
            os.remove(stale)
        return
    if resume is None:
        what = f"a {record.get('status')} run of {record.get('config', {}).get('hook')!r}" if record else "a run"
        raise ValueError(
            f"{out} holds {what}: continue it with --resume auto, or start over with --overwrite (which removes "
            "its events, checkpoint and run.json), or give another --out"
        )
