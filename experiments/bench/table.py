"""What ``gradcomp bench ddp`` (or ``fsdp``) prints per network (:func:`format_run`): a line that says
what was measured where, the step times (:func:`format_table`) and where gradcomp's time goes
(:func:`format_phases`), as Markdown tables."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from gradcomp.bench.report import Footnotes, markdown_table
from gradcomp.experiments.bench.modes import NOOP, TORCH_ALLREDUCE
from gradcomp.experiments.bench.records import PHASES
from gradcomp.experiments.bench.results import Row
from gradcomp.experiments.bench.settings import BenchSettings


def format_run(settings: BenchSettings, rows: Sequence[Row], host: dict[str, Any]) -> str:
    """One network's output: what ran on what (``host``: :func:`gradcomp.bench.report.machine`), then
    both tables."""
    from gradcomp.compressors import fusion
    from gradcomp.netem import describe, parse

    fused = fusion.enabled(torch.device(settings.device))
    workload = settings.workload
    runs = f" (medians over {settings.runs} runs; ratios with their range)" if settings.runs > 1 else ""
    return (
        f"gradcomp bench {settings.mode.name}: {workload.about}, batch {workload.batch_size} per rank, "
        f"{settings.ranks} ranks, network {settings.network} ({describe(parse(settings.network))}), gloo, "
        f"{host['cpu']}, torch {host['torch']}, {settings.threads} thread(s) per rank, "
        f"kernels {'fused by torch.compile' if fused else 'eager'} ({fusion.ENVIRONMENT}={fusion.setting()}), "
        f"median of {settings.steps} steps{runs}\n\n"
        f"{format_table(rows, settings.mode.anchor)}\n\n"
        f"Where gradcomp's time goes (ms per step, medians):\n\n{format_phases(rows)}\n\n"
    )


def format_table(rows: Sequence[Row], anchor_name: str = TORCH_ALLREDUCE) -> str:
    """Markdown: ms/step, speedup over the anchor (torch's all-reduce, or FSDP2's reduce-scatter),
    ratio to the noop floor, wire MB per step. Rows of several runs give both ratios as the median
    of each run's ratio (against the same run's anchor), with their range. A status with a reason
    (``aborted: ...``) is a short cell and a note below the table (:class:`Footnotes`)."""
    by_name = {r.variant: r for r in rows}
    anchor, floor = by_name[anchor_name], by_name[NOOP]
    nodes = any(r.inter_node_mb_per_step is not None for r in rows)  # an emulated cluster: its uplinks counted
    header = ("hook", "ms/step", f"speedup vs {anchor_name}", "x noop floor", "wire MB/step",
              *(["across nodes MB/step"] if nodes else []), "status")  # fmt: skip
    lines, notes = [], Footnotes()
    for row in rows:
        status = notes.cell(row.status, row.variant)
        crossed = row.inter_node_mb_per_step
        across = [] if not nodes else ["-" if crossed is None else f"{crossed:.2f}"]
        if row.ms_per_step is None:
            lines.append((row.variant, "-", "-", "-", "-", *across, status))
            continue
        speedup = _ratio(anchor, row, "x")
        ratio = _ratio(row, floor, "")
        wire = f"{row.wire_mb_per_step:.2f}"
        lines.append((row.variant, f"{row.ms_per_step:.1f}", speedup, ratio, wire, *across, status))
    right = [False, True, True, True, True, *([True] if nodes else []), False]
    return notes.below(markdown_table(header, lines, right=right))


def _ratio(numerator: Row, denominator: Row, unit: str) -> str:
    """``numerator / denominator``: the median of each run's ratio (against the same run's anchor,
    over the runs where both completed), with their range when there are several."""
    if not numerator.ms_per_step or not denominator.ms_per_step:
        return "-"
    pairs = [(a, b) for a, b in zip(numerator.run_ms, denominator.run_ms, strict=False) if a and b]
    if not pairs or numerator is denominator:  # an anchor against itself is 1 in every run
        return f"{numerator.ms_per_step / denominator.ms_per_step:.2f}{unit}"
    ratios = [a / b for a, b in pairs]
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}{unit}{spread}"


def format_phases(rows: Sequence[Row]) -> str:
    """Markdown: per gradcomp hook, its step's excess over the noop floor beside the engine's phases
    (medians per step, ms). Compression runs in backward's thread, so it adds to the step; the
    communication overlaps backward but for the tail; decompression runs once a collective lands. The
    host reads per step are what a GPU would wait for (`gradcomp.host`). ``kernels alone`` is the
    compressor's kernels timed outside the step on the same gradients, and ``x alone`` the step's
    compress and decompress phases against them: what running inside the step adds."""
    floor = next(r.ms_per_step for r in rows if r.variant == NOOP)
    header = ("hook", "ms/step", "over noop", *(f"{name} ms" for name in PHASES), "host reads",
              "kernels alone ms", "x alone")  # fmt: skip
    lines = [
        (row.variant, f"{row.ms_per_step:.1f}", f"{row.ms_per_step - floor:.1f}" if floor is not None else "-",
         *(f"{row.phases_ms[name]:.1f}" for name in PHASES), "-" if row.host_reads is None else f"{row.host_reads:g}",
         *_alone(row))
        for row in rows
        if row.phases_ms is not None and row.ms_per_step is not None
    ]  # fmt: skip
    return markdown_table(header, lines, right=[False] + [True] * (5 + len(PHASES)))


def _alone(row: Row) -> tuple[str, str]:
    if not row.kernels_ms or row.phases_ms is None:
        return "-", "-"
    inside = row.phases_ms["compress"] + row.phases_ms["decompress"]
    return f"{row.kernels_ms:.1f}", f"{inside / row.kernels_ms:.2f}"
