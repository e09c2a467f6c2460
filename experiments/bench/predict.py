"""``gradcomp bench predict``: the cost model's step times against measured ones, hook by hook.

    gradcomp bench predict --model mlp,cnn,transformer --ranks 2,4 --net loopback,100mbit,1gbit

For every network and world size, the link is calibrated first (:mod:`gradcomp.cost.calibrate`,
or a profile from ``--profiles DIR`` when one is there: ``DIR/<net>-<p>ranks.json``, written there
otherwise); for every model, its compute is timed in this process (:mod:`gradcomp.cost.compute`:
forward, when each gradient is ready, the optimizer), then ``gradcomp bench ddp`` measures every hook
beside torch's, and the cost model (:mod:`gradcomp.cost.step`) predicts each one's step.

What is an input and what is predicted: the model's compute is an input (as ``--compute-ms`` is to
``gradcomp plan``): the noop variant's measured step sets it, the in-process timing only says how it
splits into forward, backward and optimizer and when each gradient is ready. Everything a hook adds
to it (compression, communication, what backward hides of it) is predicted from the profile. The
table gives each hook's error, and the summary how many are within 25% and the median absolute error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from collections.abc import Sequence

import torch
from torch import nn

from gradcomp.bench.report import Footnotes, markdown_table
from gradcomp.cost import calibrate as calibration
from gradcomp.cost.compute import measure as measure_compute
from gradcomp.cost.kernels import KernelTable
from gradcomp.cost.profile import Profile
from gradcomp.cost.step import Method, Workload, method_of, predict
from gradcomp.experiments.bench import runner
from gradcomp.experiments.bench.command import split_hooks
from gradcomp.experiments.bench.modes import DDP, NOOP
from gradcomp.experiments.bench.settings import BenchSettings
from gradcomp.experiments.bench.workloads import PRESETS, Preset
from gradcomp.experiments.tasks import build_task
from gradcomp.hooks.auto import is_auto_spec
from gradcomp.hooks.torch_hooks import TorchHookSpec, is_torch_spec

TOLERANCE = 0.25
"""The largest error a prediction may have (the validation's target); the median must stay <= 15%."""
MEDIAN_TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class Row:
    """One hook's measured and predicted step."""

    model: str
    network: str
    ranks: int
    variant: str
    measured_ms: float | None
    predicted_ms: float
    compute_ms: float
    status: str = "ok"

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured."""
        if not self.measured_ms:
            return None
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def method_for(variant: str) -> Method:
    """The cost model's method of a benchmark variant (gradcomp's, torch's or noop)."""
    if is_auto_spec(variant):
        raise ValueError("auto chooses while it runs: predict its candidates instead (it uses this model itself)")
    return TorchHookSpec.parse(variant).cost_method() if is_torch_spec(variant) else method_of(variant)


def workload_of(preset: Preset, seed: int = 0) -> Workload:
    """The preset's compute, timed in this process on one thread (as a benchmark rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task = build_task("synthetic")
        torch.manual_seed(seed)
        model = task.build_model(preset.model)
        inputs, targets = task.batch(0, preset.batch_size, seed)

        def loss(module: nn.Module) -> torch.Tensor:
            return task.loss(module(inputs), targets)

        return measure_compute(model, loss, torch.optim.SGD(model.parameters(), lr=1e-3))
    finally:
        torch.set_num_threads(threads)


def scaled(workload: Workload, compute_s: float) -> Workload:
    """``workload`` with its forward, backward and optimizer scaled to add up to ``compute_s``."""
    factor = compute_s / workload.compute_s
    return dataclasses.replace(
        workload,
        forward_s=workload.forward_s * factor,
        backward_s=workload.backward_s * factor,
        optimizer_s=workload.optimizer_s * factor,
    )


def profile_for(network: str, ranks: int, directory: str | None) -> Profile:
    """``DIR/<net>-<p>ranks.json`` if it exists, else a fresh calibration (saved there when given)."""
    path = os.path.join(directory, f"{network}-{ranks}ranks.json") if directory else None
    if path and os.path.exists(path):
        return Profile.load(path)
    profile = calibration.calibrate(network, ranks)
    if path:
        os.makedirs(directory or ".", exist_ok=True)
        profile.save(path)
    return profile


def run(
    models: Sequence[str],
    ranks: Sequence[int],
    networks: Sequence[str],
    specs: Sequence[str],
    torch_hooks: Sequence[str],
    *,
    profiles: str | None = None,
    steps: int = 30,
    warmup: int = 5,
    rounds: int = 5,
    seed: int = 0,
) -> list[Row]:
    """Measure and predict every hook on every (model, network, world size)."""
    unknown = sorted(set(models) - set(PRESETS))
    if unknown:
        raise ValueError(f"unknown model preset(s) {unknown}; valid: {', '.join(PRESETS)}")
    for variant in [*specs, *torch_hooks]:
        method_for(variant)  # a bad spec fails before anything runs
    workloads = {name: workload_of(PRESETS[name], seed) for name in models}
    rows = []
    for network in networks:
        for p in ranks:
            profile = profile_for(network, p, profiles)
            kernels = KernelTable(profile.kernels)
            cluster = profile.cluster(p)
            for name in models:
                settings = BenchSettings(name, p, network, tuple(specs), tuple(torch_hooks), steps=steps,
                                         warmup=warmup, rounds=rounds, seed=seed)  # fmt: skip
                measured = runner.run(settings)
                floor = next(r.ms_per_step for r in measured if r.variant == NOOP)
                workload = scaled(workloads[name], (floor or 0.0) / 1e3)
                for row in measured:
                    step = predict(workload, method_for(row.variant), cluster, kernels)
                    rows.append(Row(name, network, p, row.variant, row.ms_per_step, step.step_s * 1e3,
                                    workload.compute_s * 1e3, row.status))  # fmt: skip
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: a table per network and world size, a line per hook, per model its measured and
    predicted ms per step and the error; the noop rows (the compute input) are left out."""
    tables = []
    for network, ranks in dict.fromkeys((r.network, r.ranks) for r in rows):
        notes = Footnotes()  # a failed variant's reason (its status) below the table, not in the error's cell
        mine = [r for r in rows if (r.network, r.ranks) == (network, ranks) and r.variant != NOOP]
        models = list(dict.fromkeys(r.model for r in mine))
        header = ("hook", *(f"{m} {what}" for m in models for what in ("measured", "predicted", "error")))
        lines = []
        for variant in dict.fromkeys(r.variant for r in mine):
            cells: list[str] = [variant]
            for model in models:
                found = [r for r in mine if r.model == model and r.variant == variant]
                cells += _cells(found[0], notes) if found else ["-", "-", "-"]
            lines.append(cells)
        title = f"{network}, {ranks} ranks (ms per step)"
        tables.append(f"{title}\n\n" + notes.below(markdown_table(header, lines)))
    return "\n\n".join(tables)


def _cells(row: Row, notes: Footnotes) -> list[str]:
    measured = f"{row.measured_ms:.1f}" if row.measured_ms else "-"
    error = f"{row.error:+.0%}" if row.error is not None else notes.cell(row.status, f"{row.variant} ({row.model})")
    return [measured, f"{row.predicted_ms:.1f}", error]


def summary(rows: Sequence[Row]) -> str:
    """How many predictions are within :data:`TOLERANCE`, and the median absolute error."""
    errors = [abs(r.error) for r in rows if r.variant != NOOP and r.error is not None]
    if not errors:
        return "no hook was measured"
    within = sum(e <= TOLERANCE for e in errors)
    median = statistics.median(errors)
    verdict = "met" if within == len(errors) and median <= MEDIAN_TOLERANCE else "not met"
    return (
        f"{within} of {len(errors)} predictions within {TOLERANCE:.0%}; median absolute error {median:.1%}, "
        f"largest {max(errors):.0%} (target: all within {TOLERANCE:.0%}, median <= {MEDIAN_TOLERANCE:.0%}: {verdict})"
    )


def add_command(commands: argparse._SubParsersAction) -> None:
    """``gradcomp bench predict`` (an entry point of the ``gradcomp.bench`` group)."""
    from gradcomp.cli import NET_HELP

    parser = commands.add_parser("predict", help="the cost model's step times against measured ones")
    parser.add_argument("--model", default="mlp,cnn,transformer", help="comma-separated presets (default all)")
    parser.add_argument("--ranks", default="2", help="comma-separated world sizes (default 2)")
    parser.add_argument("--net", default="loopback", help=NET_HELP)
    parser.add_argument("--hooks", default=DDP.hooks, help="gradcomp hook specs, as for bench ddp")
    parser.add_argument("--torch-hooks", default="torch:fp16", help="torch's hooks besides torch:allreduce")
    parser.add_argument("--profiles", metavar="DIR", help="reuse (or save) calibration profiles in DIR")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds the timed steps are spread over (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write every row and the machine to FILE")
    parser.set_defaults(run=_command)


def _command(args: argparse.Namespace) -> int:
    from gradcomp.bench.report import machine, write_report
    from gradcomp.netem import check, parse_profiles

    networks = parse_profiles(args.net)
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ranks takes comma-separated integers, got {args.ranks!r}") from None
    for network in networks:
        check(network, ranks)
    if not ranks or min(ranks) < 2:
        raise ValueError(f"--ranks must be >= 2, got {args.ranks!r}")
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    torch_hooks = [] if args.torch_hooks.strip() == "none" else split_hooks(args.torch_hooks)
    rows = run(models, ranks, networks, split_hooks(args.hooks), torch_hooks, profiles=args.profiles,
               steps=args.steps, warmup=args.warmup, rounds=args.rounds, seed=args.seed)  # fmt: skip
    host = machine()
    sys.stdout.write(
        f"gradcomp bench predict: {host['cpu']}, torch {host['torch']}, gloo, 1 thread per rank; measured: median "
        f"of {args.steps} steps of gradcomp bench ddp; predicted: gradcomp.cost from a calibrated profile, with the "
        f"noop step as the compute\n\n{format_table(rows)}\n\n{summary(rows)}\n"
    )
    if args.json:
        write_report(args.json, host, rows=[{**dataclasses.asdict(r), "error": r.error} for r in rows])
    return 0
