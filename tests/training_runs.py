"""The real training runs that the training tests read, and readers of their artefacts.

The digits MLP trains at 2 gloo ranks with top-k and error feedback, momentum and a cosine schedule
(so the optimizer, the schedule and the hook all carry state). The run straight through is shared
by every test that reads it (the ``straight_run`` fixture in conftest.py); the resume tests add a
run stopped at step :data:`STOP` and resumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

STEPS, STOP = 40, 17
SETTINGS: dict[str, Any] = {
    "task": "digits",
    "steps": STEPS,
    "batch_size": 32,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.05,
    "schedule": "cosine",
    "warmup_steps": 5,
    "hook": "topk:ratio=0.05,ef=true",
    "ranks": 2,
    "seed": 3,
    "eval_every": 10,
    "log_every": 5,
    "timeout": 120,
    "group_timeout": 60,
}


class TrainingRun(NamedTuple):
    """A finished run: its output directory and the record that ``launch`` returned."""

    out: Path
    record: dict[str, Any]


def train_straight(out: Path) -> TrainingRun:
    """The run of :data:`SETTINGS` straight through, written to ``out``."""
    from gradcomp.experiments.training.config import TrainConfig
    from gradcomp.experiments.training.run import launch

    return TrainingRun(out, launch(TrainConfig(**SETTINGS, out=str(out))))


def scalars(directory: Path) -> Any:
    """The TensorBoard events of a run directory, every scalar loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return events


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state (dicts in key order, lists in order)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in tensors(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def same_checkpoints(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Assert that two checkpoints hold bitwise the same tensors in model, optimizer and hooks (none empty)."""
    for part in ("model", "optimizer", "hooks"):
        held, other = tensors(a[part]), tensors(b[part])
        assert held, part
        assert len(held) == len(other) and all(torch.equal(x, y) for x, y in zip(held, other, strict=True)), part
