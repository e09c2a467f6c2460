"""The runs a report compares: every run directory under RUNS_DIR (or RUNS_DIR itself, for one run).

A run is what its ``run.json`` says (settings, status, final metrics, error) and its ``curves.jsonl``
(evaluation and training points against step, training time and wire bytes). A sweep also writes
``sweep.json`` when it starts (:data:`PLAN`): the runs it will make and the group label of each, so
that a report of a sweep still running lists the runs not made yet.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from gradcomp.experiments.training import curves, runinfo
from gradcomp.experiments.training.config import method

PLAN = "sweep.json"
"""What a sweep writes in its output directory when it starts: ``{"config": path, "runs": [{"name",
"label", "hook", "network", "ranks", "seed", "parallel"}, ...]}``."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One run as recorded: its group (label, network, world size, parallel mode), method (hook) and
    seed, how it ended, its final metrics and its curves."""

    name: str
    label: str
    hook: str
    """The method: the hook spec, or local SGD's or DiLoCo's ``SYNC over HOOK``
    (:func:`gradcomp.experiments.training.config.method`)."""
    network: str
    world: int
    seed: int
    status: str
    """finished, stopped, running, failed, missing (planned by the sweep, not started), or
    unreadable (its run.json could not be read: :attr:`error` says why)."""
    metric: str | None = None
    """The headline metric's key in ``metrics`` (``eval_accuracy``), None if the run never started."""
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The machine and versions it ran on (``runinfo.environment``)."""
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    trains: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    parallel: str = "ddp"
    """How the model was parallelized (``ddp``, ``fsdp``, ``hsdp``): runs of different modes are
    different systems, each compared against its own baseline (DDP's all-reduce, FSDP2's reduce-scatter)."""
    eval_samples: int | None = None
    """How many samples (windows) an evaluation scores, where the task says: an accuracy moves in
    steps of one sample's share of it, so methods of a small evaluation can tie exactly."""

    @property
    def group(self) -> tuple[str, str, int, str]:
        return (self.label, self.network, self.world, self.parallel)

    @property
    def reason(self) -> str:
        """Why a failed run failed, in one line: the last line of its error that names an exception."""
        lines = [line.strip() for line in (self.error or "").splitlines() if line.strip()]
        named = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
        return (named or lines or ["no error recorded"])[-1]


def load(directory: str) -> list[Run]:
    """Every run under ``directory`` (or ``directory`` itself when it holds a run.json), in the sweep's
    order when it planned them (the runs still missing included), else by name."""
    if not os.path.isdir(directory):
        raise ValueError(f"no runs directory {directory!r}")
    if os.path.exists(runinfo.path(directory)):
        run = read_run(directory, None)
        return [run] if run else []
    plan = _plan(directory)
    names = [entry["name"] for entry in plan] if plan else []
    found = [n for n in os.listdir(directory) if os.path.exists(runinfo.path(os.path.join(directory, n)))]
    names += sorted(n for n in found if n not in names)
    labels = {entry["name"]: entry for entry in plan or []}
    runs = []
    for name in names:
        planned = labels.get(name)
        run = read_run(os.path.join(directory, name), planned)
        if run is None and planned is not None:
            where = (planned["label"], planned["hook"], planned["network"], planned["ranks"], planned["seed"])
            run = Run(name, *where, "missing", parallel=planned.get("parallel", "ddp"))
        if run is not None:
            runs.append(run)
    if not runs:
        raise ValueError(f"{directory} holds no runs (no run.json in it or in its directories)")
    return runs


def read_run(out: str, planned: dict[str, Any] | None) -> Run | None:
    """The run in ``out``; None if it has no run.json; a run of status ``unreadable`` (the reason in
    its error) if its run.json cannot be read (cut short, not JSON, not a run's)."""
    name = os.path.basename(os.path.normpath(out))
    try:
        with open(runinfo.path(out)) as file:
            record = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return _unreadable(name, planned, f"{type(error).__name__}: {error}")
    if not isinstance(record, dict):
        return _unreadable(name, planned, f"it holds a JSON {type(record).__name__}, not a run's record")
    config = record.get("config") or {}
    task = record.get("task") or {}
    label = planned["label"] if planned else _label(config, task)
    points = curves.read(out)
    return Run(
        name=str(record.get("name") or os.path.basename(os.path.normpath(out))),
        label=label,
        hook=method(config),
        network=str(config.get("network", "loopback")),
        world=int(record.get("world_size") or config.get("ranks") or 1),
        seed=int(config.get("seed", 0)),
        status=str(record.get("status")),
        metric=task.get("headline"),
        metrics=dict(record.get("metrics") or {}),
        error=record.get("error"),
        environment=dict(record.get("environment") or {}),
        evals=[p for p in points if p["kind"] == "eval"],
        trains=[p for p in points if p["kind"] == "train"],
        parallel=str(config.get("parallel", "ddp")),
        eval_samples=_count(task.get("eval_samples")),
    )


def _count(value: Any) -> int | None:
    """A positive count as recorded, else None (absent, or not a count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _unreadable(name: str, planned: dict[str, Any] | None, why: str) -> Run:
    """A run whose run.json cannot be read: listed with the reason, in no group's comparison."""
    where = planned or {}
    return Run(name, str(where.get("label", "?")), str(where.get("hook", "?")), str(where.get("network", "?")),
               int(where.get("ranks", 0)), int(where.get("seed", 0)), "unreadable",
               error=f"run.json unreadable: {why}", parallel=str(where.get("parallel", "ddp")))  # fmt: skip


def _label(config: dict[str, Any], task: dict[str, Any]) -> str:
    """A run's group label outside a sweep: its task spec and model (``digits-mlp``)."""
    return f"{config.get('task', task.get('name', 'task'))}-{task.get('model') or config.get('model') or 'model'}"


def _plan(directory: str) -> list[dict[str, Any]] | None:
    try:
        with open(os.path.join(directory, PLAN)) as file:
            plan = json.load(file)
    except (OSError, ValueError):
        return None
    runs = plan.get("runs") if isinstance(plan, dict) else None
    return runs if isinstance(runs, list) else None


def write_plan(directory: str, config: str, runs: list[dict[str, Any]]) -> None:
    """Write :data:`PLAN` (the sweep's runs, before any of them starts)."""
    os.makedirs(directory, exist_ok=True)
    with runinfo.atomic(os.path.join(directory, PLAN), "w") as file:
        json.dump({"config": config, "runs": runs}, file, indent=1)
        file.write("\n")
