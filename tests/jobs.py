"""Helpers for tests that run a training job as a user does (a launcher starts its ranks): run it,
and read what each rank wrote."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_job(command: list[str], out: Path, resume: Path | None = None) -> None:
    """``command`` (a job writing to ``out``, resumed from ``resume`` when given: its last argument)
    from the repository's root with it on the path, one thread a rank; its exit must be clean."""
    out.mkdir(parents=True, exist_ok=True)
    command = [*command, *([] if resume is None else [str(resume)])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def rank_parameters(out: Path, rank: int) -> list[torch.Tensor]:
    """The parameters rank ``rank`` of a job wrote to ``out/rank<r>.pt``."""
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


def alike(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two lists of parameters are bitwise the same."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
