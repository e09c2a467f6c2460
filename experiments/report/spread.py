"""Whether a method holds on every group, not only on average: its change against each group's baseline
across the groups of a sweep (the cells of a grid of tasks, batch sizes and run lengths).

Groups compare only by the same metric: one :class:`Spread` table per metric key, over the groups that
have a baseline. A method's **change** is its final metric against the baseline's, in percentage
points for accuracy (negative: worse) and in percent of the baseline's value for other metrics (for
loss and perplexity, positive is worse). In one group, seed ``s``'s change is the method's run of seed
``s`` against the baseline's run of seed ``s`` (a seed either lacks is left out; two finished runs of
one seed count as their mean), and the group's change is the mean of its seeds' changes; where no
seed pairs up, each seed is against the baseline's mean (the group's change is then the change of
the means). A table's row, one per method found (not as the baseline) in two groups or more:

- the groups it ran in, and its finished runs and all runs over them;
- the mean of the groups' changes, the worst group's change and the worst single seed's (each with
  its group; ties go to the group shown first);
- the least and the most "fewer bytes" over the groups (:attr:`MethodRuns.fewer_bytes`);
- how many groups' changes are within the target tolerance (``--target-tolerance``: points for
  accuracy, percent for the rest), as the target itself counts it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from gradcomp.experiments.report.analysis import Group, MethodRuns, Metric, short_name

ROUNDING = 1e-9
"""Slack on the tolerance's edge: a change of exactly the tolerance counts as within it, whatever the
floating point makes of ``100 * (0.955 - 0.96)``."""


@dataclasses.dataclass(frozen=True)
class SeedChange:
    """One seed's change in one group (:func:`change`)."""

    group: str
    """The group's name in the table (:func:`group_names`)."""
    seed: int
    change: float
    paired: bool
    """Against the baseline's run of the same seed; False: against the baseline's mean (no seed paired up)."""


@dataclasses.dataclass(frozen=True)
class GroupChange:
    """A method's change in one group: the mean of its seeds' changes."""

    group: str
    change: float
    seeds: tuple[SeedChange, ...]

    @property
    def paired(self) -> bool:
        return all(seed.paired for seed in self.seeds)


@dataclasses.dataclass(frozen=True)
class MethodSpread:
    """One method across the groups it ran in (one row of the table)."""

    hook: str
    groups: int
    """The groups it ran in, not as their baseline (runs of any status)."""
    finished: int
    runs: int
    """Its finished runs and all its runs, over those groups."""
    changes: tuple[GroupChange, ...]
    """Its change in each group where it and the baseline have a final figure, in the groups' order."""
    mean_change: float | None
    """The mean of :attr:`changes` (None: no group compares)."""
    worst_group: GroupChange | None
    worst_seed: SeedChange | None
    fewest_fewer_bytes: float | None
    """The least of its "fewer bytes" over the groups: the least compression it achieved anywhere."""
    most_fewer_bytes: float | None
    within_tolerance: int
    """How many of :attr:`changes` are within the tolerance (not worse than it)."""

    @property
    def name(self) -> str:
        return short_name(self.hook)


@dataclasses.dataclass(frozen=True)
class Spread:
    """The methods of the groups that share one metric, each across those groups."""

    metric: Metric
    tolerance: float
    groups: tuple[str, ...]
    """The names of the groups compared, in the report's order."""
    baselines: tuple[str, ...]
    """Their baselines (one, unless the parallel modes or the runs differ)."""
    methods: tuple[MethodSpread, ...]

    @property
    def unit(self) -> str:
        """A change's unit: percentage points (accuracy) or percent of the baseline's value."""
        return " pp" if self.metric.percent else "%"

    def format(self, change: float | None) -> str:
        """``change`` with its sign and unit (``+2.10%``, ``-0.40 pp``; a change that rounds to nothing, ``+0.00``)."""
        return "-" if change is None else f"{round(change, 2) or 0.0:+.2f}{self.unit}"

    @property
    def worse(self) -> str:
        """Which sign of a change is worse, in words."""
        return "negative" if self.metric.higher_is_better else "positive"


def across_groups(groups: Sequence[Group], tolerance: float) -> list[Spread]:
    """A table per metric shared by two groups or more that have a baseline, each with a row per
    method found in two of them or more (not as their baseline); tables without a row are left out."""
    compared = [g for g in groups if g.metric is not None and g.baseline is not None]
    by_metric: dict[str, list[Group]] = {}
    for group in compared:
        assert group.metric is not None
        by_metric.setdefault(group.metric.key, []).append(group)
    tables = []
    for same in by_metric.values():
        if len(same) < 2:
            continue
        names = group_names(same)
        hooks = list(dict.fromkeys(m.hook for g in same for m in g.methods if m.hook != g.baseline))
        rows = []
        for hook in hooks:
            found = [(name, g, m) for name, g in zip(names, same, strict=True)
                     if (m := g.method(hook)) is not None and hook != g.baseline]  # fmt: skip
            if len(found) >= 2:
                rows.append(_method_spread(hook, found, tolerance))
        if rows:
            metric = same[0].metric
            assert metric is not None
            baselines = tuple(dict.fromkeys(g.baseline for g in same if g.baseline is not None))
            tables.append(Spread(metric, tolerance, tuple(names), baselines, tuple(rows)))
    return tables


def group_names(groups: Sequence[Group]) -> list[str]:
    """Each group's name in a table: the parts of its title that differ between ``groups`` (the task
    label alone, in a grid of tasks on one network)."""
    parts = [(g.label, g.network, f"{g.world} rank{'s' if g.world != 1 else ''}", g.parallel) for g in groups]
    varying = [i for i in range(4) if len({p[i] for p in parts}) > 1] or [0]
    return [", ".join(p[i] for i in varying) for p in parts]


def change(metric: Metric, value: float, baseline: float) -> float | None:
    """``value`` against ``baseline``: percentage points for a metric shown in percent (accuracy),
    else percent of the baseline's value (None where that is 0)."""
    if metric.percent:
        return 100 * (value - baseline)
    if baseline == 0:
        return None
    return 100 * (value - baseline) / abs(baseline)


def group_change(name: str, method: MethodRuns, baseline: MethodRuns, metric: Metric) -> GroupChange | None:
    """``method``'s change against ``baseline`` in the group ``name``, seed-paired where seeds pair
    up (see the module's docstring); None where either has no final figure."""
    ours, theirs = finals_by_seed(method, metric), finals_by_seed(baseline, metric)
    if not ours or not theirs:
        return None
    paired = [seed for seed in ours if seed in theirs]
    if paired:
        against = {seed: theirs[seed] for seed in paired}
    else:
        mean = statistics.fmean(theirs.values())
        against = {seed: mean for seed in ours}
    seeds = tuple(SeedChange(name, seed, found, bool(paired)) for seed, base in against.items()
                  if (found := change(metric, ours[seed], base)) is not None)  # fmt: skip
    if not seeds:
        return None
    return GroupChange(name, statistics.fmean(s.change for s in seeds), seeds)


def finals_by_seed(method: MethodRuns, metric: Metric) -> dict[int, float]:
    """The final metric of each seed of ``method``'s finished runs (the mean where a seed ran twice)."""
    values: dict[int, list[float]] = {}
    for run in method.finished:
        if run.metrics.get(metric.key) is not None:
            values.setdefault(run.seed, []).append(float(run.metrics[metric.key]))
    return {seed: statistics.fmean(finals) for seed, finals in values.items()}


def _method_spread(hook: str, found: list[tuple[str, Group, MethodRuns]], tolerance: float) -> MethodSpread:
    metric = found[0][1].metric
    assert metric is not None
    changes = []
    for name, group, method in found:
        baseline = group.method(group.baseline)
        assert baseline is not None
        if (found_change := group_change(name, method, baseline, metric)) is not None:
            changes.append(found_change)
    worst = min if metric.higher_is_better else max
    seeds = [seed for c in changes for seed in c.seeds]
    fewer = [m.fewer_bytes for _, _, m in found if m.fewer_bytes is not None]
    return MethodSpread(
        hook=hook,
        groups=len(found),
        finished=sum(len(m.finished) for _, _, m in found),
        runs=sum(len(m.runs) for _, _, m in found),
        changes=tuple(changes),
        mean_change=statistics.fmean(c.change for c in changes) if changes else None,
        worst_group=worst(changes, key=lambda c: c.change, default=None),
        worst_seed=worst(seeds, key=lambda s: s.change, default=None),
        fewest_fewer_bytes=min(fewer, default=None),
        most_fewer_bytes=max(fewer, default=None),
        within_tolerance=sum(_within(metric, c.change, tolerance) for c in changes),
    )


def _within(metric: Metric, found: float, tolerance: float) -> bool:
    """Whether a change is no worse than ``tolerance`` (points or percent, as :meth:`Metric.target`)."""
    if metric.higher_is_better:
        return found >= -tolerance - ROUNDING
    return found <= tolerance + ROUNDING
