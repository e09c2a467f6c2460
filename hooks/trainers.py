"""What the integrations with trainers (Lightning, Accelerate) share: a step's statistics as logger
metrics, and every rank's hook state in one checkpoint.

Trainers write a checkpoint from one rank, but each rank's hook state is its own (error feedback's
residuals are what that rank has not sent yet): :func:`every_rank` gathers them when the checkpoint is
written (a collective: every rank calls it, as trainers ask every rank for the state), and
:func:`own_rank` picks this rank's back when it is loaded.
"""

from __future__ import annotations

from typing import Any

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
