"""Choosing a method per bucket with the cost model: what the ``auto`` hook decides with.

:func:`choose` predicts the step with every candidate on every bucket (:func:`gradcomp.cost.step.predict`),
starts from the best single candidate, then tries each other candidate bucket by bucket and keeps
what shortens the predicted step (a bucket that backward hides anyway can stay cheap to compress,
the exposed last one can take the smallest payload). The first candidate is the baseline (the
uncompressed gradient): unless the choice is predicted faster than it by more than ``margin``,
the baseline stays, so that noise in the measurements never buys a lossy method nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from gradcomp.cost.cluster import Cluster
from gradcomp.cost.kernels import KernelCost
from gradcomp.cost.step import Method, Workload, predict

MARGIN = 0.05
"""How much faster than the baseline (the uncompressed gradient) a choice must be predicted to be
taken: 5%, about how much kernel timings vary from run to run. The planner's recommendation holds
methods to the same margin (:data:`gradcomp.cost.plan.MARGIN`)."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """Per bucket, the index of its candidate; the predicted step; every candidate's alone; why."""

    per_bucket: tuple[int, ...]
    predicted_s: float
    uniform_s: tuple[float, ...]
    reason: str


def choose(
    workload: Workload,
    candidates: Sequence[Method],
    cluster: Cluster,
    kernels: Callable[[str], KernelCost],
    margin: float = MARGIN,
) -> Choice:
    """The per-bucket choice among ``candidates`` (the first is the baseline) for ``workload``."""
    if not candidates:
        raise ValueError("choosing needs at least one candidate")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    buckets = len(workload.buckets())

    def step(assignment: Sequence[int]) -> float:
        return predict(workload, [candidates[i] for i in assignment], cluster, kernels).step_s

    uniform = tuple(step([c] * buckets) for c in range(len(candidates)))
    best = min(range(len(candidates)), key=lambda c: uniform[c])
    assignment = [best] * buckets
    current = uniform[best]
    for _ in range(2):  # two passes: a later bucket's change can make an earlier one's worth it
        for b in range(buckets):
            for c in range(len(candidates)):
                trial = [*assignment[:b], c, *assignment[b + 1 :]]
                seconds = step(trial)
                if seconds < current * (1 - 1e-9):
                    assignment, current = trial, seconds
    if current > uniform[0] * (1 - margin):
        assignment, current = [0] * buckets, uniform[0]
    return Choice(tuple(assignment), current, uniform, explain(candidates, assignment, current, uniform, margin))


def explain(
    candidates: Sequence[Method],
    assignment: Sequence[int],
    predicted_s: float,
    uniform_s: Sequence[float],
    margin: float,
) -> str:
    """Why: the choice per bucket against the baseline (the first candidate), and every candidate alone."""
    alone = ", ".join(f"{m.label} {t * 1e3:.1f} ms" for m, t in zip(candidates, uniform_s, strict=True))
    if all(c == 0 for c in assignment):
        return f"{candidates[0].label}: nothing is predicted more than {margin:.0%} faster (each alone: {alone})"
    chosen = ", ".join(f"bucket {b}: {candidates[c].label}" for b, c in enumerate(assignment))
    return (
        f"{chosen}; predicted {predicted_s * 1e3:.1f} ms per step, {uniform_s[0] / predicted_s:.2f}x faster than "
        f"{candidates[0].label} (each alone: {alone})"
    )
