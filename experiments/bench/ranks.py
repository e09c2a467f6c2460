"""What every rank of ``gradcomp bench ddp`` (or ``fsdp``) runs (:func:`measure`): one copy of the model
per variant, trained in rounds, each step timed; a step's time is its slowest rank's."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradcomp import host, netem
from gradcomp.experiments.bench import records
from gradcomp.experiments.bench.settings import BenchSettings
from gradcomp.experiments.bench.workloads import UserModel
from gradcomp.experiments.tasks import build_task
from gradcomp.state import TrainingHookState

Batch = tuple[Tensor, Tensor | None]
"""Inputs and targets (None for a user's model: it trains against the mean square of its output)."""
Setups = dict[str, tuple[nn.Module, TrainingHookState]]
"""Per variant, its model (spread over the ranks) and what its hook records."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """One variant's figures, as every rank returns them."""

    step_s: list[float]
    """Each timed step's time in seconds, the slowest rank's."""
    wire_bytes: float
    """Bytes one rank sent per step (:func:`records.wire`)."""
    phases_ms: dict[str, float] | None
    """gradcomp's hooks: the engine's phases, medians per step in ms (:func:`records.phases`)."""
    host_reads: float | None = None
    """gradcomp's hooks: host reads per step, the median (:func:`records.host_reads`)."""
    kernels_ms: float | None = None
    """gradcomp's fixed hooks: the compressor's kernels alone on a step's gradients (:func:`records.kernels_alone`)."""
    inter_node_bytes: float | None = None
    """On an emulated cluster: bytes a node sent across nodes per step (its uplink's counter, the
    mean over nodes: :class:`Uplinks`); None elsewhere."""


def measure(rank: int, world: int, settings: BenchSettings, variants: Sequence[str]) -> dict[str, Measured]:
    """Inside every rank: per variant of ``variants`` (some of ``settings.variants``), every timed step's
    time (slowest rank), wire bytes, and for gradcomp's hooks the engine's phases per step."""
    device = torch.device("cpu")
    if settings.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    paths = host.as_accelerator() if settings.accelerator_paths else contextlib.nullcontext()
    with paths:
        return _measure(rank, world, settings, variants, device)


def _measure(
    rank: int, world: int, settings: BenchSettings, variants: Sequence[str], device: torch.device
) -> dict[str, Measured]:
    setups, batch = _setups(rank, settings, variants, device)
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, (m, _) in setups.items()}
    times: dict[str, list[float]] = {v: [] for v in variants}
    uplinks = Uplinks(variants)
    per_round = max(1, settings.steps // settings.rounds)
    for round_ in range(settings.rounds + 1):  # round 0 is the warm-up
        order = [*variants[round_ % len(variants) :], *variants[: round_ % len(variants)]]
        for variant in order:
            model, _ = setups[variant]
            count = settings.warmup if round_ == 0 else per_round
            dist.barrier()
            with uplinks.counting(variant, timed=round_ > 0):
                for _ in range(count):
                    start = time.perf_counter()
                    _step(model, optimizers[variant], batch)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)  # a step ends when its kernels have run
                    if round_:
                        times[variant].append(time.perf_counter() - start)
                dist.barrier()  # every rank's traffic of these steps has left
    slowest = _slowest(times, world)
    across = uplinks.per_step({v: len(times[v]) for v in variants}, world)
    alone: dict[str, float | None] = dict.fromkeys(setups)
    for variant, (model, _) in setups.items() if settings.mode.name == "ddp" else ():
        dist.barrier()  # every rank at once, as they compress in the step
        alone[variant] = records.kernels_alone(variant, model, rank, world, settings.seed)
    return {
        v: Measured(slowest[v], records.wire(state, len(times[v])), records.phases(state, len(times[v])),
                    records.host_reads(state, len(times[v])), alone[v], across[v])
        for v, (_, state) in setups.items()
    }


def _setups(
    rank: int, settings: BenchSettings, variants: Sequence[str], device: torch.device
) -> tuple[Setups, Batch]:
    """Every variant's model, spread and hooked, and this rank's batch, on ``device``."""
    workload, mode, seed = settings.workload, settings.mode, settings.seed
    if isinstance(workload, UserModel):
        setups = {v: mode.make(workload.build, v, seed, device) for v in variants}
        return setups, (workload.batch(rank, seed).to(device), None)
    task = build_task("synthetic")
    # the models first: building one generates the task's inputs for it (images, tokens)
    setups = {v: mode.make(functools.partial(task.build_model, workload.model), v, seed, device) for v in variants}
    inputs, targets = task.batch(rank, workload.batch_size, seed)  # each rank its own samples of the pool
    return setups, (inputs.to(device), targets.to(device))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> None:
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


class Uplinks:
    """Bytes each variant's timed steps sent across nodes on an emulated cluster, read by the first
    rank of each node from its node's uplink (``gradcomp.netem.uplink_bytes``): what crossed
    between nodes whatever the hook, torch's included. Elsewhere it counts nothing."""

    def __init__(self, variants: Sequence[str]) -> None:
        self.switch = os.environ.get(netem.NODE_SWITCH) or None
        self.reads = self.switch is not None and os.environ.get("LOCAL_RANK") == "0"
        self.sent = dict.fromkeys(variants, 0)

    @contextlib.contextmanager
    def counting(self, variant: str, timed: bool) -> Iterator[None]:
        if not (self.reads and timed and self.switch):
            yield
            return
        before = netem.uplink_bytes(self.switch)
        yield
        self.sent[variant] += netem.uplink_bytes(self.switch) - before

    def per_step(self, steps: dict[str, int], world: int) -> dict[str, float | None]:
        """Per variant, the bytes a node sent across nodes per timed step, the mean over nodes (a
        collective: every rank calls it); None off a cluster."""
        if self.switch is None:
            return dict.fromkeys(steps)
        sent = torch.tensor([float(self.sent[v]) for v in steps], dtype=torch.float64)
        dist.all_reduce(sent)  # the nodes' first ranks' counts; the others add nothing
        nodes = world // int(os.environ["LOCAL_WORLD_SIZE"])
        return {v: float(total) / nodes / max(1, steps[v]) for v, total in zip(steps, sent.tolist(), strict=True)}
