"""Run every training a sweep describes, one after another, resumably; summarize how they ended.

Each run starts its ranks on this machine (behind its network profile, through ``gradcomp.netem``)
and writes ``OUT/<run name>/``: TensorBoard events, run.json, curves.jsonl, and checkpoint.pt while
it is unfinished (:func:`drop_checkpoint`: a finished run's is removed unless asked to keep it). Then
``tensorboard --logdir OUT`` compares them (scalars against step, training time and wire bytes; the
HParams dashboard for a table).

The sweep resumes: a run whose run.json says ``finished`` is skipped; any other (failed, stopped,
interrupted, never started) runs again, continuing from its checkpoint if it has one. A failed run
is recorded (status and error in its run.json) and the sweep goes on. Runs whose recorded settings
differ from the config are refused before anything runs (remove them, or use another ``--out``).
The config format: :mod:`gradcomp.experiments.sweep.plan`; a guide: ``docs/experiments.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

try:
    from tqdm import tqdm
except ImportError as error:  # the core installs without it
    raise ImportError("gradcomp sweep shows its progress with tqdm: pip install 'gradcomp[experiments]'") from error

from gradcomp.bench.report import markdown_table
from gradcomp.experiments.sweep.plan import Run
from gradcomp.experiments.training import runinfo
from gradcomp.experiments.training.config import PATH_FIELDS, check_batch
from gradcomp.experiments.training.metrics import require_tensorboard
from gradcomp.experiments.training.run import launch
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


@contextlib.contextmanager
def lock(out: str) -> Iterator[None]:
    """Hold ``OUT/.sweep.lock`` while a sweep runs there: a second sweep on the same ``--out`` is
    refused (it would train every run a second time, in the same directories) instead of racing."""
    os.makedirs(out, exist_ok=True)
    refusal = f"another sweep is running in {out} ({{holder}}): wait for it, or use another --out"
    with runinfo.exclusive(os.path.join(out, LOCK), refusal):
        yield


LOCK = ".sweep.lock"


def drop_checkpoint(run: Run) -> int:
    """Remove finished ``run``'s checkpoint; the bytes freed (0: it had none). A sweep never resumes a
    finished run (it skips it), and nothing else reads the file: the report and the summary read
    run.json, the curves and the events. Most of a sweep's disk is these files (the model, the
    optimizer's and every rank's hook state: 260 of the 261 MB of ``quick``'s 36 runs)."""
    path = run.config.checkpoint_path
    try:
        size = os.path.getsize(path)
        os.remove(path)
    except FileNotFoundError:
        return 0
    return size


def _run(run: Run) -> str:
    """Run ``run``; its status. A failure is recorded in its run.json and logged in one line."""
    try:
        check_batch(run.config)  # its task's data cannot serve it (a file the task refuses): this run fails
    except ValueError as error:
        line = " ".join(str(error).split())
        runinfo.record_failure(run.config.out, run.name, run.config.to_dict(), line)
        logger.warning("run %s failed (recorded in its run.json): %s", run.name, line)
        return "failed"
    try:
        return str(launch(run.config)["status"])
    except (RankError, NetemError) as error:
        line = error.summary if isinstance(error, RankError) else " ".join(str(error).split())
        logger.warning("run %s failed (recorded in its run.json): %s", run.name, line)  # one line: a user's error
        return "failed"
    except KeyboardInterrupt:
        runinfo.record_failure(run.config.out, run.name, run.config.to_dict(), "interrupted", "interrupted")
        raise


def run_sweep(runs: Sequence[Run], progress: Progress | None = None, keep_checkpoints: bool = False) -> list[Row]:
    """Run every run not finished yet, in order; a failure is recorded and the sweep continues.
    Returns the summary of all runs. The checkpoints of finished runs (those finished before, and
    each run as it finishes) are removed, unless ``keep_checkpoints``: an unfinished run keeps its
    own, to continue from."""
    statuses = existing(runs)
    todo = [run for run in runs if statuses[run.name] != "finished"]
    if todo:
        require_tensorboard()  # here, not in each run's ranks
    logger.info("%d runs, %d finished before, %d to run", len(runs), len(runs) - len(todo), len(todo))
    freed = [] if keep_checkpoints else [drop_checkpoint(run) for run in runs if run not in todo]
    if progress:
        progress.begin(len(runs), len(todo))
    for run in todo:
        if progress:
            progress.start(run)
        status = _run(run)
        if status == "finished" and not keep_checkpoints:
            freed.append(drop_checkpoint(run))
        if progress:
            progress.done(run, status)
    if progress:
        progress.close()
        progress.removed([size for size in freed if size])
    return [Row.of(run) for run in runs]


class Progress:
    """Where a sweep stands, on ``stream``: on a terminal, a tqdm bar (runs done / to do, elapsed,
    estimated rest) under a line per finished run; elsewhere (a log file, CI) no bar, and each run's
    line starts with the same figures, so that the log reads line by line."""

    COUNTS = "{n_fmt}/{total_fmt}  elapsed {elapsed}  ETA {remaining}"

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.bar: tqdm[Any] | None = None
        self.began = self.run_began = 0.0
        self.done_count = self.total = 0

    def begin(self, runs: int, todo: int) -> None:
        self.began, self.total = time.monotonic(), todo
        self.stream.write(f"sweep: {runs} runs, {runs - todo} finished before, {todo} to run\n")
        self.bar = tqdm(
            total=todo, file=self.stream, unit="run", dynamic_ncols=True, disable=not self.stream.isatty(),
            bar_format="{bar:24} " + self.COUNTS + "  {desc}",
        )  # fmt: skip

    def start(self, run: Run) -> None:
        self.run_began = time.monotonic()
        if self.bar is not None:
            self.bar.set_description_str(f"running {run.name}")

    def done(self, run: Run, status: str) -> None:
        if self.bar is None:
            return
        self.done_count += 1
        line = f"{status} {run.name} ({time.monotonic() - self.run_began:.1f} s)"
        if self.bar.disable:
            elapsed = time.monotonic() - self.began
            counts = tqdm.format_meter(self.done_count, self.total, elapsed, bar_format=self.COUNTS)
            line = f"{counts}  {line}"
        self.bar.write(line, file=self.stream)
        self.bar.set_description_str("")
        self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def removed(self, sizes: Sequence[int]) -> None:
        """Say how many finished runs' checkpoints were removed, and how to keep them."""
        if sizes:
            self.stream.write(
                f"sweep: removed the checkpoints of {len(sizes)} finished runs ({sum(sizes) / 1e6:.1f} MB; "
                "--keep-checkpoints keeps them)\n"
            )


def format_summary(rows: Sequence[Row]) -> str:
    """The summary, a Markdown table: run, status, final headline metric, MB sent per rank, training seconds."""

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    header = ("run", "status", "metric", "final", "wire MB", "train s")
    lines = [
        (r.name, r.status, r.metric or "-", number(r.value, 4), number(r.wire_mb, 2), number(r.train_s, 1))
        for r in rows
    ]
    return markdown_table(header, lines, right=[False, False, False, True, True, True]) + "\n"
