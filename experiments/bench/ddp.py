"""``gradcomp bench ddp``: DDP step time with gradcomp's hooks beside PyTorch's own, on a chosen network.

    gradcomp bench ddp --model mlp --ranks 2 --net loopback,1gbit --hooks "powersgd:rank=4;sign:ef=true"

Every rank builds one DDP copy of the model per variant (same initial weights), then runs them in
rounds: each round gives every variant ``steps / rounds`` training steps (forward, backward with
the hook's communication, SGD step) in an order rotated from round to round, so that the machine's
drift hits every variant alike. A step's time is the slowest rank's; each figure is the median over
the timed steps, after ``warmup`` untimed ones (DDP's bucket rebuild, PowerSGD's start, caches).

Variants: always ``noop`` (no communication: the compute floor) and ``torch:allreduce`` (DDP's
built-in C++ path); by default also torch's Python ``allreduce_hook`` (the same all-reduce through
the hook interface, which a gradcomp hook also goes through), ``fp16_compress_hook``, and
``powerSGD_hook`` (rank 4, error feedback, from step 2), spelt as everywhere else
(:mod:`gradcomp.hooks.torch_hooks`: ``torch:allreduce_hook``, ``torch:fp16``, ``torch:powersgd:rank=4``).
PowerSGD runs in ranks of its own: on gloo it would hang whenever the model has more than one bucket
(it issues its second all-reduce from the first one's callback: the rule "one ordered path" of
``docs/architecture.md``); gradcomp's wrapper refuses that case, and the table reports it instead of
taking the other figures with it.

Models and data come from the ``synthetic`` task (random data: the loss means nothing, the step
time does): each preset is one of its models at a batch size. ``--model pkg.module:factory`` times a
user's own model instead: ``factory()`` builds it, and it trains on random inputs of
``--input-shape`` (integers below ``--input-high`` when given, for token models) against the mean
square of its output.

Beside the step times, a second table shows where each gradcomp hook's time goes (the engine's own
records, medians per step): compression and decompression, the wall time of its collectives, and
the tail that backward could not hide.

Wire bytes are what one rank sends per step: measured by gradcomp where it moves the bytes itself
(a padded all-gather on the backend counts its ring's p - 1 frames), else the ring all-reduce's
2 (p - 1) / p x payload (gloo's and NCCL's all-reduce are rings); for torch's hooks the payload is
what they hand to the backend (``TorchHookState.steps``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks
from gradcomp.bench.report import markdown_table
from gradcomp.experiments.tasks import build_task
from gradcomp.experiments.training import parallel
from gradcomp.hooks import torch_hooks
from gradcomp.hooks.torch_hooks import PREFIX, TorchHookSpec, is_torch_spec
from gradcomp.launch import RankError, spawn
from gradcomp.state import TrainingHookState

NOOP, TORCH_ALLREDUCE = "noop", "torch:allreduce"
DEFAULT_HOOKS = (
    "allreduce;fp16;bf16;randomk:ratio=0.01,scale=false,ef=true;powersgd:rank=1;powersgd:rank=4,ef=true;sign:ef=true;"
    "topk:ratio=0.01,ef=true;quantize:bits=4"
)
"""What ``gradcomp bench ddp`` measures when ``--hooks`` is not given."""
DEFAULT_TORCH_HOOKS = ("torch:allreduce_hook", "torch:fp16", "torch:powersgd:rank=4")
"""torch's own hooks measured beside the two anchors (noop and torch's all-reduce) by default."""


@dataclasses.dataclass(frozen=True)
class Mode:
    """How the benchmark spreads the model over the ranks: DDP's replicas (this module's command) or
    FSDP2's shards (``gradcomp bench fsdp``, :mod:`gradcomp.experiments.bench.fsdp`)."""

    name: str
    anchor: str
    """torch's own way of averaging, against which every speedup is taken."""
    torch_hooks: tuple[str, ...]
    """torch's other ways measured by default."""
    hooks: str
    """gradcomp's specs measured by default."""

    def canonical(self, spec: str) -> str:
        """A variant's canonical text: ``noop``, a ``torch:`` spec, or a gradcomp spec (a bad one fails)."""
        if self.name == "fsdp":
            return str(hooks.parse_sharded(spec))
        return str(hooks.parse(spec))

    def torch_canonical(self, spec: str) -> str:
        """One of torch's own (it must start with ``torch:``), in its canonical text."""
        if self.name == "fsdp":
            return str(hooks.TorchFSDPSpec.parse(spec))
        return str(TorchHookSpec.parse(spec))

    def make(self, build: Callable[[], nn.Module], variant: str, seed: int) -> tuple[nn.Module, TrainingHookState]:
        """A fresh model for ``variant``, spread and hooked (the same initial weights for every variant)."""
        torch.manual_seed(seed)
        if self.name == "fsdp":
            spec = hooks.parse_sharded(variant, seed=seed)
            sharded = parallel.make("fsdp", build(), torch.device("cpu"), spec)
            return sharded.forward, hooks.register(sharded.forward, spec)
        model = DistributedDataParallel(build())  # DDP broadcasts rank 0's weights anyway
        if is_torch_spec(variant):
            return model, torch_hooks.register(model, variant, seed=seed)
        return model, hooks.register(model, variant, seed=seed)


DDP = Mode("ddp", TORCH_ALLREDUCE, DEFAULT_TORCH_HOOKS, DEFAULT_HOOKS)


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model of the ``synthetic`` task, and the batch each rank trains it on."""

    name: str
    model: str
    """The synthetic task's model name."""
    batch_size: int
    """Samples per rank and step."""
    about: str


@dataclasses.dataclass(frozen=True)
class UserModel:
    """A user's model: ``factory`` (``pkg.module:function``) builds it; it trains on random inputs."""

    factory: str
    input_shape: tuple[int, ...]
    """One sample's shape (without the batch dimension)."""
    batch_size: int = 8
    input_high: int | None = None
    """Integer inputs in [0, input_high) (token ids) instead of standard normal floats."""

    @property
    def about(self) -> str:
        kind = f"integers below {self.input_high}" if self.input_high else "normal floats"
        return f"{self.factory}, random inputs of shape {list(self.input_shape)} ({kind})"

    def build(self) -> nn.Module:
        module_name, function = self.factory.split(":")  # checked by user_model
        model = getattr(importlib.import_module(module_name), function)()
        if not isinstance(model, nn.Module):
            raise TypeError(f"{self.factory} returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    def batch(self, rank: int, seed: int) -> Tensor:
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        shape = (self.batch_size, *self.input_shape)
        if self.input_high:
            return torch.randint(0, self.input_high, shape, generator=generator)
        return torch.randn(shape, generator=generator)


def user_model(factory: str, input_shape: str | None, batch_size: int = 8, input_high: int | None = None) -> UserModel:
    """Check a ``pkg.module:factory`` model's arguments (and that it imports) before any rank starts."""
    module_name, colon, function = factory.partition(":")
    if not colon or not module_name or not function.isidentifier():
        raise ValueError(f"--model takes a preset ({', '.join(PRESETS)}) or pkg.module:factory, got {factory!r}")
    if input_shape is None:
        raise ValueError(f"--model {factory} needs --input-shape (one sample's shape, e.g. 3,32,32)")
    try:
        shape = tuple(int(size) for size in input_shape.split(",") if size.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ValueError(f"--input-shape must be positive sizes separated by commas (3,32,32), got {input_shape!r}")
    if batch_size < 1 or (input_high is not None and input_high < 1):
        raise ValueError(f"--batch-size and --input-high must be >= 1, got {batch_size} and {input_high}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} for --model {factory}: {error}") from error
    if not callable(getattr(module, function, None)):
        raise ValueError(f"{module_name} has no function {function!r} (--model {factory})")
    return UserModel(factory, shape, batch_size, input_high)


PRESETS = {
    "mlp": Preset("mlp", "mlp", 32, "MLP 1024-2048-2048-10, 6.32M parameters"),
    "cnn": Preset("cnn", "resnet18", 8, "ResNet-18 (32x32 inputs), 11.2M parameters"),
    "transformer": Preset(
        "transformer", "chartransformer", 8, "character transformer, 4 layers of width 256, 3.2M parameters"
    ),
}

Workload = Preset | UserModel
"""What the ranks train: a preset of the synthetic task, or a user's model."""


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
    ``communicate`` and ``tail`` (:meth:`gradcomp.engine.stats.StepStats.phases`), in ms."""
    run_ms: list[float | None] = dataclasses.field(default_factory=list)
    """Each independent run's median (None where the variant failed in that run)."""


def split_hooks(text: str) -> list[str]:
    """``"fp16,topk:ratio=0.01,ef=true;powersgd"`` -> three specs. Semicolons always separate; a comma
    separates too, unless what follows is an option (``key=value`` without a ``name:`` before it)."""
    specs: list[str] = []
    for group in text.split(";"):
        starts = True  # the first piece of a ';' group always starts a spec
        for piece in (p.strip() for p in group.split(",")):
            if not piece:
                continue
            if not starts and "=" in piece and ":" not in piece:
                specs[-1] += f",{piece}"
            else:
                specs.append(piece)
            starts = False
    return specs


def measure(
    rank: int,
    world: int,
    workload: Workload,
    variants: Sequence[str],
    steps: int,
    warmup: int,
    rounds: int,
    seed: int,
    mode: Mode = DDP,
) -> dict[str, dict[str, Any]]:
    """Inside every rank: per variant, every timed step's time (slowest rank), wire bytes, and for
    gradcomp's hooks the engine's phases per step."""
    if isinstance(workload, UserModel):
        setups = {v: mode.make(workload.build, v, seed) for v in variants}
        batch: tuple[Tensor, Tensor | None] = (workload.batch(rank, seed), None)
    else:
        task = build_task("synthetic")
        # the models first: building one generates the task's inputs for it (images, tokens)
        setups = {v: mode.make(functools.partial(task.build_model, workload.model), v, seed) for v in variants}
        batch = task.batch(rank, workload.batch_size, seed)  # each rank its own samples of the pool
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, (m, _) in setups.items()}
    times: dict[str, list[float]] = {v: [] for v in variants}
    per_round = max(1, steps // rounds)
    for round_ in range(rounds + 1):  # round 0 is the warm-up
        order = [*variants[round_ % len(variants) :], *variants[: round_ % len(variants)]]
        for variant in order:
            model, _ = setups[variant]
            count = warmup if round_ == 0 else per_round
            dist.barrier()
            for _ in range(count):
                start = time.perf_counter()
                _step(model, optimizers[variant], batch)
                if round_:
                    times[variant].append(time.perf_counter() - start)
    slowest = _slowest(times, world)
    report: dict[str, dict[str, Any]] = {}
    for variant in variants:
        timed, state = len(times[variant]), setups[variant][1]
        report[variant] = {
            "step_s": slowest[variant],
            "wire_bytes": _wire(state, timed),
            "phases_ms": _phases(state, timed) if isinstance(state, (hooks.HookState, hooks.AutoState)) else None,
        }
    return report


PHASES = ("compress", "decompress", "communicate", "tail")
"""The engine's phases that ``gradcomp bench ddp`` reports per step, in its second table."""


def _phases(state: TrainingHookState, timed: int) -> dict[str, float] | None:
    """Medians over the last ``timed`` steps of each phase's ms per step (None for noop)."""
    recorded = [s.phases() for s in state.steps()[-timed:]] if timed else []
    if not recorded:
        return None
    return {name: statistics.median(_timed(p[name]) for p in recorded) * 1e3 for name in PHASES}


def _timed(seconds: float | None) -> float:
    assert seconds is not None, "gradcomp's hooks time every phase"
    return seconds


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor | None]) -> None:
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=False)
    output = model(inputs)
    if targets is None:  # a user's model: any scalar of the output will do for timing
        first = output if isinstance(output, Tensor) else next(iter(output))
        loss = first.float().square().mean()
    else:
        loss = nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()


def _slowest(times: dict[str, list[float]], world: int) -> dict[str, list[float]]:
    """Per variant and step, the largest time over ranks (a step ends when its slowest rank ends)."""
    everyone: list[dict[str, list[float]]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, times)
    return {v: [max(rank[v][i] for rank in everyone) for i in range(len(times[v]))] for v in times}


def _wire(state: TrainingHookState, timed: int) -> float:
    """Bytes one rank sends per step, over the last ``timed`` steps (see the module's docstring)."""
    recorded = state.steps()[-timed:] if timed else []
    return statistics.fmean(s.wire_bytes for s in recorded) if recorded else 0.0


def run(
    preset: str | UserModel,
    ranks: int,
    network: str,
    specs: Sequence[str],
    *,
    torch_hooks: Sequence[str] = DEFAULT_TORCH_HOOKS,
    steps: int = 30,
    warmup: int = 5,
    rounds: int = 5,
    seed: int = 0,
    threads: int = 1,
    timeout: float = 1800.0,
    runs: int = 1,
    mode: Mode = DDP,
) -> list[Row]:
    """The anchors (noop, ``mode.anchor``: torch's all-reduce for DDP), ``torch_hooks`` (``torch:``
    specs), then ``specs`` (gradcomp's, or more of torch's): a :class:`Row` each. ``preset`` names a
    preset, or is a user's model (:func:`user_model`). With ``runs`` > 1 the whole measurement is
    repeated on fresh ranks, and each figure is the median over the runs (:attr:`Row.run_ms` keeps
    every run's). ``mode``: DDP's replicas, or FSDP2's shards (``gradcomp bench fsdp``)."""
    if not isinstance(preset, UserModel) and preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid: {', '.join(PRESETS)}")
    workload: Workload = preset if isinstance(preset, UserModel) else PRESETS[preset]
    if ranks < 2:
        raise ValueError(f"--ranks must be >= 2 (a data-parallel benchmark needs peers), got {ranks}")
    if steps < rounds or rounds < 1 or warmup < 2:
        raise ValueError(f"need rounds >= 1, steps >= rounds and warmup >= 2; got {rounds}, {steps}, {warmup}")
    if runs < 1:
        raise ValueError(f"--runs must be >= 1, got {runs}")
    # every spec checked here (a bad one fails before any rank starts); each variant once, as given
    baselines = list(dict.fromkeys([NOOP, mode.anchor, *(mode.torch_canonical(h) for h in torch_hooks)]))
    seen, given = set(baselines), []
    for spec in specs:
        if mode.canonical(spec) not in seen:
            seen.add(mode.canonical(spec))
            given.append(spec.strip())
    specs = given
    variants = [*baselines, *specs]
    measured = [
        _run_once(workload, ranks, network, baselines, specs, (steps, warmup, rounds, seed), threads, timeout, mode)
        for _ in range(runs)
    ]
    return [_combine([rows[v] for rows in measured]) for v in variants]


def _run_once(
    workload: Workload,
    ranks: int,
    network: str,
    baselines: list[str],
    specs: Sequence[str],
    settings: tuple[int, int, int, int],
    threads: int,
    timeout: float,
    mode: Mode,
) -> dict[str, Row]:
    variants = [*baselines, *specs]
    isolated = [v for v in variants if mode is DDP and _isolated(v)]
    shared = [v for v in variants if v not in isolated]
    started = time.monotonic()
    arguments = (workload, shared, *settings, mode)
    measured = spawn(ranks, measure, arguments, timeout=timeout, threads=threads, network=network)[0]
    rows = {v: _row(v, network, measured[v]) for v in shared}
    # In ranks of their own, with a deadline of a few times the average variant's time: on gloo
    # with several buckets torch's PowerSGD is refused (it would hang: its callbacks issue collectives).
    deadline = 20 + 3 * (time.monotonic() - started) / len(shared)
    for variant in isolated:
        try:
            alone = spawn(ranks, measure, (workload, [variant], *settings, mode), timeout=deadline, threads=threads,
                          network=network, group_timeout=deadline)[0]  # fmt: skip
            rows[variant] = _row(variant, network, alone[variant])
        except RankError as error:
            rows[variant] = Row(variant, network, None, None, _failure(error, deadline), run_ms=[None])
    return rows


def _isolated(variant: str) -> bool:
    """Whether ``variant`` runs in ranks of its own (torch's PowerSGD: see the module's docstring)."""
    return is_torch_spec(variant) and TorchHookSpec.parse(variant).name == "powersgd"


def _combine(runs: list[Row]) -> Row:
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
        "ok" if len(done) == len(runs) else f"ok in {len(done)} of {len(runs)} runs; {runs[0].status}",
        [t for r in done for t in r.step_ms],
        phases,
        run_ms,
    )


def _row(variant: str, network: str, figures: dict[str, Any]) -> Row:
    step_ms = [t * 1e3 for t in figures["step_s"]]
    median = statistics.median(step_ms)
    return Row(variant, network, median, figures["wire_bytes"] / 1e6, "ok", step_ms, figures["phases_ms"], [median])


def _failure(error: RankError, deadline: float) -> str:
    """``hung`` or ``aborted``, with the exception line of the first failing rank's traceback."""
    if "did not finish" in str(error):
        return f"hung (killed after {deadline:.0f} s)"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0]]
    return f"aborted: {(errors or lines or ['unknown'])[-1][:160]}"


def format_table(rows: Sequence[Row], anchor_name: str = TORCH_ALLREDUCE) -> str:
    """Markdown: ms/step, speedup over the anchor (torch's all-reduce, or FSDP2's reduce-scatter),
    ratio to the noop floor, wire MB per step. Rows of several runs give both ratios as the median
    of each run's ratio (against the same run's anchor), with their range."""
    by_name = {r.variant: r for r in rows}
    anchor, floor = by_name[anchor_name], by_name[NOOP]
    header = ("hook", "ms/step", f"speedup vs {anchor_name}", "x noop floor", "wire MB/step", "status")
    lines = []
    for row in rows:
        if row.ms_per_step is None:
            lines.append((row.variant, "-", "-", "-", "-", row.status))
            continue
        speedup = _ratio(anchor, row, "x")
        ratio = _ratio(row, floor, "")
        lines.append((row.variant, f"{row.ms_per_step:.1f}", speedup, ratio, f"{row.wire_mb_per_step:.2f}", row.status))
    return markdown_table(header, lines, right=[False, True, True, True, True, False])


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
    communication overlaps backward but for the tail; decompression runs once a collective lands."""
    floor = next(r.ms_per_step for r in rows if r.variant == NOOP)
    header = ("hook", "ms/step", "over noop", *(f"{name} ms" for name in PHASES))
    lines = [
        (row.variant, f"{row.ms_per_step:.1f}", f"{row.ms_per_step - floor:.1f}" if floor is not None else "-",
         *(f"{row.phases_ms[name]:.1f}" for name in PHASES))
        for row in rows
        if row.phases_ms is not None and row.ms_per_step is not None
    ]  # fmt: skip
    return markdown_table(header, lines, right=[False] + [True] * (2 + len(PHASES)))


def add_command(commands: argparse._SubParsersAction) -> None:
    """``gradcomp bench ddp`` (an entry point of the ``gradcomp.bench`` group)."""
    add_parser(commands, DDP, "DDP step time: gradcomp hooks beside torch's, per network")


def add_parser(commands: argparse._SubParsersAction, mode: Mode, help: str) -> None:
    """The command of ``mode`` (``gradcomp bench ddp`` or ``gradcomp bench fsdp``): the same options."""
    from gradcomp.cli import NET_HELP

    parser = commands.add_parser(mode.name, help=help)
    parser.add_argument(
        "--model",
        default="mlp",
        help=f"model preset ({', '.join(sorted(PRESETS))}; default mlp) or your own as pkg.module:factory "
        "(a function returning the nn.Module, importable from the current directory or PYTHONPATH)",
    )
    parser.add_argument(
        "--input-shape", help="with pkg.module:factory: one sample's input shape, e.g. 3,32,32 (random inputs)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="with pkg.module:factory: samples per rank (default 8)"
    )
    parser.add_argument(
        "--input-high", type=int, help="with pkg.module:factory: integer inputs below this (token ids), not floats"
    )
    parser.add_argument("--ranks", type=int, default=2, help="processes to start on this machine (default 2)")
    parser.add_argument("--net", default="loopback", help=NET_HELP)
    parser.add_argument(
        "--hooks",
        default=mode.hooks,
        help="hook specs, gradcomp's or torch's (torch:bf16), separated by ';' (or ',' before a new name)",
    )
    parser.add_argument(
        "--torch-hooks",
        default=";".join(mode.torch_hooks),
        help=f"torch's own to measure besides its default ({mode.anchor}), separated as --hooks, "
        f"or none (default {';'.join(mode.torch_hooks)}; the torch: prefix may be left out)",
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds the timed steps are spread over (default 5)")
    parser.add_argument(
        "--runs", type=int, default=1, help="independent runs (fresh ranks each); figures are medians over them"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write every figure and the machine to FILE")
    parser.set_defaults(run=functools.partial(_command, mode=mode))


def _command(args: argparse.Namespace, mode: Mode = DDP) -> int:
    from gradcomp.bench.report import machine, write_report
    from gradcomp.netem import Profile, check, describe, parse_profiles

    networks = parse_profiles(args.net)
    for network in networks:
        check(network)  # an emulated network this machine cannot build fails before any rank starts
    specs = split_hooks(args.hooks)
    named = [] if args.torch_hooks.strip() == "none" else split_hooks(args.torch_hooks)
    torch_hooks = [h if is_torch_spec(h) else PREFIX + h for h in named]
    workload: str | UserModel = args.model
    if args.model in PRESETS:
        about = f"{PRESETS[args.model].about}, batch {PRESETS[args.model].batch_size} per rank"
    else:
        if os.getcwd() not in sys.path:  # as `python -m` does: the module may be one of the current directory
            sys.path.insert(0, os.getcwd())  # (the ranks inherit sys.path)
        workload = user_model(args.model, args.input_shape, args.batch_size, args.input_high)
        about = f"{workload.about}, batch {workload.batch_size} per rank"
    host, rows = machine(), []
    runs = f" (medians over {args.runs} runs; ratios with their range)" if args.runs > 1 else ""
    for network in networks:
        settings = {
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "seed": args.seed,
            "runs": args.runs,
        }
        measured = run(
            workload, args.ranks, network, specs, torch_hooks=torch_hooks, threads=args.threads, mode=mode, **settings
        )
        sys.stdout.write(
            f"gradcomp bench {mode.name}: {about}, {args.ranks} ranks, "
            f"network {network} ({describe(Profile.parse(network))}), gloo, {host['cpu']}, torch {host['torch']}, "
            f"{args.threads} thread(s) per rank, median of {args.steps} steps{runs}\n\n"
            f"{format_table(measured, mode.anchor)}\n\n"
            f"Where gradcomp's time goes (ms per step, medians):\n\n{format_phases(measured)}\n\n"
        )
        sys.stdout.flush()
        rows += measured
    if args.json:
        figures = {"model": args.model, "ranks": args.ranks, "networks": networks, "parallel": mode.name}
        write_report(args.json, host, **figures, rows=[dataclasses.asdict(r) for r in rows])
    return 0
