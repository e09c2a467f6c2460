"""What the benchmark reads of a hooked model's per-step records (``state.steps()``): the bytes one
rank sent and the engine's phases. The only place in ``gradcomp bench ddp``/``fsdp`` that reads
them, so a change of their layout changes here alone."""

from __future__ import annotations

import statistics

from gradcomp import hooks
from gradcomp.engine.stats import wire_bytes
from gradcomp.experiments.bench.modes import State

PHASES = ("compress", "decompress", "communicate", "tail")
"""The engine's phases that ``gradcomp bench ddp`` reports per step, in its second table."""


def wire(state: State, timed: int, world: int) -> float:
    """Bytes one rank sends per step, the mean over the last ``timed`` steps: measured by gradcomp where
    it moves the bytes, else what the backend's ring sends (:func:`gradcomp.engine.stats.wire_bytes`)."""
    recorded = state.steps()[-timed:] if timed else []
    return statistics.fmean(wire_bytes(s, world) for s in recorded) if recorded else 0.0


def phases(state: State, timed: int) -> dict[str, float] | None:
    """gradcomp's hooks: the medians over the last ``timed`` steps of each phase's ms per step (None for
    torch's own, which the engine does not time, and for noop)."""
    if not isinstance(state, (hooks.HookState, hooks.AutoState)):
        return None
    recorded = state.steps()[-timed:] if timed else []
    if not recorded:
        return None
    return {name: statistics.median(s[f"{name}_s"] for s in recorded) * 1e3 for name in PHASES}
