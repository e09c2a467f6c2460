"""``gradcomp sweep CONFIG.toml``: run every training a sweep config describes, one after another.

Each run starts its ranks on this machine (behind its network profile, through ``gradcomp.netem``)
and writes ``OUT/<run name>/``: TensorBoard events, run.json, checkpoint.pt. Then
``tensorboard --logdir OUT`` compares them (scalars against step, training time and wire bytes; the
HParams dashboard for a table).

The sweep resumes: a run whose run.json says ``finished`` is skipped; any other (failed, stopped,
interrupted, never started) runs again, continuing from its checkpoint if it has one. A failed run
is recorded (status and error in its run.json) and the sweep goes on. Runs whose recorded settings
differ from the config are refused before anything runs (remove them, or use another ``--out``).
The config format: :mod:`experiments.plan`; a guide: ``docs/experiments.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from gradcomp.experiments import plan, runinfo
from gradcomp.experiments.config import PATH_FIELDS
from gradcomp.experiments.plan import Run
from gradcomp.experiments.train import launch
from gradcomp.launch import RankError
from gradcomp.netem import NetemError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the summary: a run and how it ended."""

    name: str
    status: str
    metric: str | None = None
    value: float | None = None
    wire_mb: float | None = None
    train_s: float | None = None

    @classmethod
    def of(cls, run: Run) -> Row:
        record = runinfo.read(run.config.out)
        if record is None:
            return cls(run.name, "missing")
        metrics = record.get("metrics") or {}
        metric = (record.get("task") or {}).get("headline")
        wire = metrics.get("wire_bytes")
        return cls(
            run.name,
            str(record.get("status")),
            metric,
            metrics.get(metric) if metric else None,
            wire / 1e6 if wire is not None else None,
            metrics.get("train_time_s"),
        )


def existing(runs: Sequence[Run]) -> dict[str, str | None]:
    """Each run's recorded status (None: never started). Refuses runs recorded with other settings."""
    statuses: dict[str, str | None] = {}
    stale = []
    for run in runs:
        record = runinfo.read(run.config.out)
        statuses[run.name] = None if record is None else str(record.get("status"))
        if record is not None:
            changed = _changes(record.get("config") or {}, run.config.to_dict())
            if changed:
                stale.append(f"{run.config.out} ({', '.join(changed)})")
    if stale:
        raise ValueError(
            "these runs were made with other settings than the config now gives; remove them or use another "
            "--out: " + "; ".join(stale)
        )
    return statuses


def _changes(recorded: dict[str, Any], planned: dict[str, Any]) -> list[str]:
    return [
        f"{k}: {recorded.get(k)!r} -> {v!r}"
        for k, v in planned.items()
        if k not in PATH_FIELDS and recorded.get(k) != v
    ]


def run_sweep(runs: Sequence[Run], progress: Progress | None = None) -> list[Row]:
    """Run every run not finished yet, in order; a failure is recorded and the sweep continues.
    Returns the summary of all runs."""
    statuses = existing(runs)
    todo = [run for run in runs if statuses[run.name] != "finished"]
    logger.info("%d runs, %d finished before, %d to run", len(runs), len(runs) - len(todo), len(todo))
    if progress:
        progress.begin(len(runs), len(todo))
    for run in todo:
        if progress:
            progress.start(run)
        _prepare(run)
        try:
            status = str(launch(run.config)["status"])
        except (RankError, NetemError) as error:
            logger.warning("run %s failed (recorded in its run.json): %s", run.name, str(error).splitlines()[-1:])
            status = "failed"
        except KeyboardInterrupt:
            runinfo.record_failure(run.config.out, run.name, run.config.to_dict(), "interrupted")
            raise
        if progress:
            progress.done(run, status)
    return [Row.of(run) for run in runs]


def _prepare(run: Run) -> None:
    """A run that starts over (no checkpoint to continue from) drops the events of its earlier attempt."""
    if not os.path.isfile(run.config.checkpoint_path):
        for path in glob.glob(os.path.join(run.config.out, "events.out.tfevents.*")):
            os.remove(path)


class Progress:
    """A one-line-per-run progress bar with the elapsed time and an estimate of the rest, on ``stream``."""

    def __init__(self, stream: TextIO, width: int = 24) -> None:
        self.stream, self.width = stream, width
        self.total = self.done_count = 0
        self.began = self.run_began = 0.0

    def begin(self, runs: int, todo: int) -> None:
        self.total, self.began = todo, time.monotonic()
        self.stream.write(f"sweep: {runs} runs, {runs - todo} finished before, {todo} to run\n")
        self.stream.flush()

    def start(self, run: Run) -> None:
        self.run_began = time.monotonic()
        self._line(f"running {run.name}")

    def done(self, run: Run, status: str) -> None:
        self.done_count += 1
        self._line(f"{status} {run.name} ({time.monotonic() - self.run_began:.1f} s)")

    def _line(self, text: str) -> None:
        elapsed = time.monotonic() - self.began
        filled = self.width * self.done_count // max(1, self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        eta = elapsed / self.done_count * (self.total - self.done_count) if self.done_count else math.nan
        self.stream.write(
            f"[{bar}] {self.done_count}/{self.total}  elapsed {_clock(elapsed)}  ETA {_clock(eta)}  {text}\n"
        )
        self.stream.flush()


def _clock(seconds: float) -> str:
    if math.isnan(seconds):
        return "-:--"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes}:{seconds:02d}"


def format_summary(rows: Sequence[Row]) -> str:
    """The summary table: run, status, final headline metric, MB sent per rank, training seconds."""

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    header = ("run", "status", "metric", "final", "wire MB", "train s")
    lines = [
        (r.name, r.status, r.metric or "-", number(r.value, 4), number(r.wire_mb, 2), number(r.train_s, 1))
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    out = []
    for row in [header, *lines]:
        cells = [
            str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out) + "\n"


# -- the command --------------------------------------------------------------------------------


def add_command(commands: argparse._SubParsersAction) -> None:
    """Add ``gradcomp sweep`` (an entry point of the group ``gradcomp.commands``)."""
    parser = commands.add_parser(
        "sweep",
        help="run a grid of trainings from a TOML config",
        description="Run every training of a sweep config, skipping finished runs (see docs/experiments.md).",
    )
    _add_arguments(parser)
    parser.set_defaults(run=_command)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a sweep config (TOML), e.g. experiments/configs/quick.toml")
    parser.add_argument("--out", help="directory of the runs (default: runs/<config name>)")
    parser.add_argument("--dry-run", action="store_true", help="check the config and list the runs; run nothing")


def _command(args: argparse.Namespace) -> int:
    out = args.out or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
    runs = plan.load(args.config, out)
    if args.dry_run:
        statuses = existing(runs)
        for run in runs:
            sys.stdout.write(f"{run.name}  {statuses[run.name] or 'not started'}\n")
        sys.stdout.write(f"{len(runs)} runs in {out}\n")
        return 0
    try:
        rows = run_sweep(runs, Progress(sys.stderr))
    except KeyboardInterrupt:
        sys.stderr.write("\nsweep interrupted: run the same command again to continue where it stopped\n")
        return 130
    summary = format_summary(rows)
    sys.stdout.write("\n" + summary)
    with open(os.path.join(out, "summary.json"), "w") as file:
        json.dump(
            {"config": os.path.abspath(args.config), "runs": [dataclasses.asdict(r) for r in rows]}, file, indent=2
        )
    sys.stdout.write(f"\nTensorBoard: tensorboard --logdir {out}\n")
    return 0 if all(r.status == "finished" for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.sweep CONFIG.toml``: the same as ``gradcomp sweep``."""
    parser = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return _command(args)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
