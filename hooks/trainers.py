"""What the integrations with trainers (Lightning, Accelerate, the Hugging Face Trainer) share: a step's
statistics as logger metrics, and every rank's hook state in the trainer's checkpoints.

Trainers write a checkpoint from one rank, but each rank's hook state is its own (error feedback's
residuals are what that rank has not sent yet). Where the trainer keeps custom state in one file
(Lightning, Accelerate), :func:`every_rank` gathers them when the checkpoint is written (a collective:
every rank calls it, as trainers ask every rank for the state), and :func:`own_rank` picks this rank's
back when it is loaded. Where it writes a file per rank itself (the Hugging Face Trainer's RNG states),
:func:`save_own` writes this rank's beside them and :func:`load_own` reads it back: no collective, and
on nodes without a shared disk each node keeps its own ranks' states, as it keeps their RNG states.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradcomp.engine.stats import StepStats
from gradcomp.state import TrainingHookState


def metrics(step: StepStats) -> dict[str, float]:
    """A step's statistics as ``hook/*`` metrics: ``wire_mb``, ``payload_mb``, ``compression_ratio``,
    ``communicate_ms``, ``buckets`` and, across nodes, ``inter_node_mb``."""
    values = {
        "hook/wire_mb": step.wire_bytes / 1e6,
        "hook/payload_mb": step.payload_bytes / 1e6,
        "hook/compression_ratio": step.compression_ratio,
        "hook/communicate_ms": (step.communicate_s or 0.0) * 1e3,
        "hook/buckets": float(step.buckets or 0),
    }
    if step.inter_node_bytes is not None:
        values["hook/inter_node_mb"] = step.inter_node_bytes / 1e6
    return values


def every_rank(state: TrainingHookState) -> dict[str, Any]:
    """Every rank's ``state.state_dict()``, in rank order: a collective over the world."""
    return gathered(state.state_dict())


def gathered(mine: Any) -> dict[str, Any]:
    """Every rank's ``mine``, in rank order, as :func:`own_rank` reads it back: a collective."""
    everyone: list[Any] = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def own_rank(saved: dict[str, Any]) -> Any:
    """This rank's state from what :func:`every_rank` (or :func:`gathered`) returned; a checkpoint
    of another world size is refused."""
    ranks = saved["ranks"]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if len(ranks) != world:
        raise ValueError(f"the checkpoint holds the hook states of {len(ranks)} ranks; this run has {world}")
    return ranks[rank]


def own_file(folder: str | os.PathLike[str]) -> Path:
    """Where :func:`save_own` writes this rank's hook state in ``folder``: ``gradcomp_rank<r>.pt``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Path(folder) / f"gradcomp_rank{rank}.pt"


def save_own(state: TrainingHookState, folder: str | os.PathLike[str], step: int) -> Path:
    """This rank's ``state.state_dict()``, saved at trainer step ``step``, into :func:`own_file` (no
    collective: every rank calls it for itself). Returns the file."""
    path = own_file(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "hook": state.state_dict()}, path)
    return path


def load_own(state: TrainingHookState, folder: str | os.PathLike[str], step: int) -> None:
    """Restore this rank's hook state from what :func:`save_own` wrote in ``folder`` at trainer step
    ``step``. Refused, with the reason: no file for this rank (a checkpoint written without gradcomp,
    or by fewer ranks), a file of another step; the state itself refuses another spec or world size."""
    path = own_file(folder)
    if not path.is_file():
        raise FileNotFoundError(
            f"no gradcomp hook state at {path}: resume from a checkpoint written with the hook (each rank "
            "writes its own file), by as many ranks as this run has"
        )
    saved = torch.load(path, weights_only=True)
    if saved["step"] != step:
        raise ValueError(f"{path} holds the hook state of step {saved['step']}; the run resumes at step {step}")
    state.load_state_dict(saved["hook"])
