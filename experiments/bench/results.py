"""What ``gradcomp bench ddp`` (or ``fsdp``) gives per variant and network, a :class:`Row`, and how
the rows of independent runs merge into one (:func:`combine`: medians over the runs that completed)."""

from __future__ import annotations

import dataclasses
import statistics

from gradcomp.experiments.bench.records import PHASES


@dataclasses.dataclass(frozen=True)
class Row:
    """One variant on one network."""

    variant: str
    network: str
    ms_per_step: float | None
    wire_mb_per_step: float | None
    status: str = "ok"
    step_ms: list[float] = dataclasses.field(default_factory=list)
    phases_ms: dict[str, float] | None = None
    """gradcomp hooks: medians per step of the engine's ``compress``, ``decompress``,
    ``communicate`` and ``tail`` (:func:`gradcomp.engine.stats.per_step`), in ms."""
    run_ms: list[float | None] = dataclasses.field(default_factory=list)
    """Each independent run's median (None where the variant failed in that run)."""
    host_reads: float | None = None
    """gradcomp hooks: host reads per step, the median (each a synchronization on a GPU)."""
    kernels_ms: float | None = None
    """gradcomp's fixed hooks: the compressor's kernels alone on a step's gradients, ms (the step's
    ``compress`` and ``decompress`` phases against them show what the step adds to the kernels)."""
    inter_node_mb_per_step: float | None = None
    """On an emulated cluster: MB a node sent across nodes per step (its uplink's counter, the mean
    over nodes), beside :attr:`wire_mb_per_step`, what one rank sent wherever it went."""


def combine(runs: list[Row]) -> Row:
    """One variant's rows from independent runs as one: medians over the runs that completed."""
    if len(runs) == 1:
        return runs[0]
    done = [r for r in runs if r.ms_per_step is not None]
    run_ms = [r.ms_per_step for r in runs]
    if not done:
        return dataclasses.replace(runs[0], run_ms=run_ms)
    phases = None
    if all(r.phases_ms is not None for r in done):
        phases = {name: statistics.median(r.phases_ms[name] for r in done if r.phases_ms) for name in PHASES}
    return Row(
        done[0].variant,
        done[0].network,
        statistics.median(r.ms_per_step for r in done if r.ms_per_step is not None),
        statistics.median(r.wire_mb_per_step for r in done if r.wire_mb_per_step is not None),
        "ok" if len(done) == len(runs) else f"ok in {len(done)} of {len(runs)} runs; {_failed(runs)}",
        [t for r in done for t in r.step_ms],
        phases,
        run_ms,
        _median_or_none([r.host_reads for r in done]),
        _median_or_none([r.kernels_ms for r in done]),
        _median_or_none([r.inter_node_mb_per_step for r in done]),
    )


def _failed(runs: list[Row]) -> str:
    """The status of the first run where the variant failed."""
    return next(r.status for r in runs if r.ms_per_step is None)


def _median_or_none(values: list[float | None]) -> float | None:
    """The median, or None where any run lacks the figure."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known and len(known) == len(values) else None
