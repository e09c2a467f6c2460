"""``run.json``: what a run was (config, task, environment), how it ended (status, metrics, error).

Written by rank 0 when a run starts (status ``running``) and ends (``finished``, or ``stopped`` at
``stop_at``), and by the launcher when a run fails (``failed``, with the error). A sweep decides from
the status alone what to skip on a rerun: ``finished`` runs are kept, all others run again.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from importlib import metadata
from typing import Any

import torch

from gradcomp.bench.report import machine

STATUSES = ("running", "finished", "stopped", "failed")


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
    """Write run.json atomically (a reader never sees half a file)."""
    if record.get("status") not in STATUSES:
        raise ValueError(f"run status must be one of {STATUSES}, got {record.get('status')!r}")
    os.makedirs(out, exist_ok=True)
    record = {**record, "updated": now()}
    temporary = path(out) + ".tmp"
    with open(temporary, "w") as file:
        json.dump(record, file, indent=2, default=str)
        file.write("\n")
    os.replace(temporary, path(out))


def record_failure(out: str, name: str, config: dict[str, Any], error: str) -> None:
    """Mark a run failed, keeping what rank 0 had written about it."""
    record = read(out) or {"name": name, "config": config, "started": now()}
    record.update(status="failed", error=error)
    write(out, record)
