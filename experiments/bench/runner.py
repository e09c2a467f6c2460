"""Runs one measurement of ``gradcomp bench ddp`` (or ``fsdp``) on ranks started here (:func:`run`):
every run on fresh ranks, the variants that may hang or abort in ranks of their own with a deadline
(a failure becomes their row's status), then the runs merged into one row per variant."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager

from gradcomp.experiments.bench.ranks import Measured, measure
from gradcomp.experiments.bench.results import Row, combine
from gradcomp.experiments.bench.settings import BenchSettings
from gradcomp.launch import RankError, spawn
from gradcomp.progress import Progress, step


def units(settings: BenchSettings) -> int:
    """What :func:`run` reports progress in: one unit per variant and run."""
    return len(settings.variants) * settings.runs


def run(settings: BenchSettings, progress: Progress | None = None) -> list[Row]:
    """A :class:`Row` per variant of ``settings`` (:attr:`BenchSettings.variants`, in that order). With
    ``settings.runs`` > 1 the whole measurement is repeated on fresh ranks, and each figure is the
    median over the runs (:attr:`Row.run_ms` keeps every run's). ``progress`` hears of every launch
    of ranks (:func:`units` of them in all): the variants measured together, then each one alone."""
    variants = settings.variants
    measured = [_run_once(settings, variants, progress, r) for r in range(settings.runs)]
    return [combine([rows[v] for rows in measured]) for v in variants]


def _step(
    progress: Progress | None, settings: BenchSettings, run: int, what: str, units: int
) -> AbstractContextManager[None]:
    """``progress``' step for one launch: the network, the run (of several) and what it measures."""
    of_runs = f", run {run + 1} of {settings.runs}" if settings.runs > 1 else ""
    return step(progress, f"{settings.network}{of_runs}: {what}", units)


def _together(variants: Sequence[str]) -> str:
    """``8 variants in rounds (noop, torch:allreduce and 6 more)``: what one launch measures together."""
    if len(variants) == 1:
        return variants[0]
    named = ", ".join(variants[:2])
    rest = f" and {len(variants) - 2} more" if len(variants) > 2 else ""
    return f"{len(variants)} variants in rounds ({named}{rest})"


def _run_once(
    settings: BenchSettings, variants: Sequence[str], progress: Progress | None = None, run: int = 0
) -> dict[str, Row]:
    isolated = [v for v in variants if settings.mode.isolated(v)]
    shared = [v for v in variants if v not in isolated]
    started = time.monotonic()
    with _step(progress, settings, run, _together(shared), len(shared)):
        measured = spawn(settings.ranks, measure, (settings, shared), timeout=settings.timeout,
                         threads=settings.threads, network=settings.network, backend=settings.backend)[0]  # fmt: skip
    rows = {v: _row(v, settings.network, measured[v]) for v in shared}
    # In ranks of their own, with a deadline of a few times the average variant's time: on gloo
    # with several buckets torch's PowerSGD is refused (it would hang: its callbacks issue collectives).
    deadline = 20 + 3 * (time.monotonic() - started) / len(shared)
    for variant in isolated:
        try:
            with _step(progress, settings, run, f"{variant} (alone)", 1):
                alone = spawn(settings.ranks, measure, (settings, [variant]), timeout=deadline,
                              threads=settings.threads, network=settings.network, group_timeout=deadline,
                              backend=settings.backend)[0]  # fmt: skip
            rows[variant] = _row(variant, settings.network, alone[variant])
        except RankError as error:
            rows[variant] = Row(variant, settings.network, None, None, failure(error, deadline), run_ms=[None])
    return rows


def _row(variant: str, network: str, figures: Measured) -> Row:
    step_ms = [t * 1e3 for t in figures.step_s]
    median = statistics.median(step_ms)
    across = None if figures.inter_node_bytes is None else figures.inter_node_bytes / 1e6
    return Row(
        variant,
        network,
        median,
        figures.wire_bytes / 1e6,
        "ok",
        step_ms,
        figures.phases_ms,
        [median],
        figures.host_reads,
        figures.kernels_ms,
        across,
    )


def failure(error: RankError, deadline: float) -> str:
    """``hung`` or ``aborted``, with the exception line of the first failing rank's traceback."""
    if "did not finish" in str(error):
        return f"hung (killed after {deadline:.0f} s)"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0]]
    return f"aborted: {(errors or lines or ['unknown'])[-1][:500]}"  # a note below the table holds it
