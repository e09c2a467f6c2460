"""``gradcomp calibrate``: measure this machine's link and kernels, fit them, save a profile.

::

    gradcomp calibrate --net 1gbit --ranks 2 -o 1gbit.json

Ranks are started on this machine (:mod:`gradcomp.launch`), on loopback or in an emulated network.
They time the backend's own all-reduce and all-gather at sizes from 4 KiB to 16 MiB (every repeat
after a barrier, the slowest rank's time, the median of repeats), and :func:`gradcomp.cost.profile.fit_link`
fits latency and bandwidth to each. On an emulated cluster (``--net nodes=2x2,...``) they also time
them inside every node at once (each node's ranks among themselves), fitted as the link inside a
node (``inside_all_reduce``, ``inside_all_gather``: what ``gradcomp plan`` prices the node's steps
of the hook across nodes with). The compressors' kernels are timed in this process
(:mod:`gradcomp.cost.kernels`) in every rank at once, as the ranks compress at once in training
(on a shared machine they slow each other down), one thread each. Last, the engine itself averages
one bucket of each size with every spec, and what it takes beyond the kernels and the link is kept
as the engine's overhead per bucket (:class:`~gradcomp.cost.kernels.KernelCost`). All of it goes
into one :class:`~gradcomp.cost.profile.Profile`, with the raw timings. The ranks start once for the
links, then once per spec (a tenth of a second each on loopback), so that the command can say on a
terminal which spec it times, how many are done and how long the rest will take (:mod:`gradcomp.progress`).

Costs: a few seconds on loopback; on a slow link the largest sizes dominate (about 30 s at 100 Mbit/s);
timing the default kernels takes 10-20 s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradcomp import netem
from gradcomp.bench.compressors import DEFAULT_SPECS
from gradcomp.bench.report import machine
from gradcomp.collectives.hierarchical import subgroups
from gradcomp.compressors import parse_spec
from gradcomp.cost import kernels
from gradcomp.cost.kernels import KernelCost
from gradcomp.cost.profile import COLLECTIVES, INSIDE, Profile, Timings, fit_links
from gradcomp.cost.step import Workload, method_of, predict
from gradcomp.engine import Engine
from gradcomp.engine.transport import all_gather_into
from gradcomp.launch import spawn
from gradcomp.progress import Progress, step

WARMUP = 3
"""Untimed runs of each collective at each size first (connections, buffers, caches)."""
ENGINE_SIDES = (256, 1024, 2048)
"""Buckets the engine is timed on: square matrices of 64K, 1M and 4.2M elements."""
SIZES = (4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
"""Bytes per rank timed by default: 4 KiB to 16 MiB."""
KERNEL_SPECS = tuple(
    dict.fromkeys(
        str(parse_spec(s))
        for s in (
            *DEFAULT_SPECS,
            "randomk:ratio=0.01,scale=false,ef=true",
            "powersgd:rank=1",
            "powersgd:rank=4,ef=true",
            "sign:ef=true",
            "topk:ratio=0.01,ef=true",
            "quantize:bits=4,ef=true",
            "quantize:bits=2,ef=true",
        )
    )
)
"""Compressors whose kernels a profile holds by default: ``gradcomp bench compressors``' list and the
error-feedback variants of the benchmarks and of the ``auto`` hook (canonical specs)."""


def time_collectives(
    rank: int,
    world: int,
    sizes: Sequence[int],
    repeats: int,
    warmup: int = WARMUP,
    group: dist.ProcessGroup | None = None,
) -> Timings:
    """Inside every rank of ``group``: per collective, [bytes, median seconds of the slowest rank] per
    size (the ``auto`` hook probes its group with it too)."""
    timings: Timings = {name: [] for name in COLLECTIVES}
    # A group's first collectives are slow (connections, buffers): warm both up at the largest size first.
    largest = torch.zeros(max(sizes) // 4)
    for _ in range(warmup):
        dist.all_reduce(largest, group=group)
        all_gather_into(torch.empty(world * largest.numel()), largest, group)
    for size in sizes:
        tensor = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
        gathered = torch.empty(world * tensor.numel())
        runs: dict[str, Callable[[], Any]] = {
            "all_reduce": functools.partial(dist.all_reduce, tensor, group=group),
            "all_gather": functools.partial(all_gather_into, gathered, tensor, group),
        }
        for name, run in runs.items():
            seconds = _slowest_median(run, repeats, warmup, functools.partial(tensor.div_, world), group)
            timings[name].append([float(size), seconds])
    return timings


def _slowest_median(
    run: Callable[[], Any],
    repeats: int,
    warmup: int,
    after: Callable[[], Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> float:
    """The median over ``repeats`` (after ``warmup``) of ``run``'s time on the slowest rank, each run
    after a barrier; ``after()`` follows every run, untimed (to keep the values bounded, or restore them)."""
    times = []
    for repeat in range(-warmup, repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if after is not None:
            after()
        if repeat >= 0:
            times.append(float(elapsed))
    return statistics.median(times)


def time_kernels(
    rank: int,
    world: int,
    specs: Sequence[str],
    repeats: int,
    sides: Sequence[int] = kernels.SIDES,
    device: str = "cpu",
) -> dict[str, list[list[Any]]]:
    """Inside every rank: every spec's kernel timings (:func:`gradcomp.cost.kernels.measure`), all
    ranks timing the same kernel at once, as they compress at once in training (sharing the
    machine's caches, memory bandwidth and cores); with ``device`` ``cuda``, rank r on GPU r modulo
    the GPUs there are."""
    where = rank_device(rank, device)
    timings = {}
    for spec in specs:
        dist.barrier()
        samples = kernels.measure(spec, sides, repeats=repeats, device=where)
        timings[spec] = [list(dataclasses.astuple(s)) for s in samples]
    return timings


def rank_device(rank: int, device: str) -> torch.device:
    """Where rank ``rank`` computes for ``device`` (``cpu``, or ``cuda``: GPU rank modulo the GPUs)."""
    if device == "cpu":
        return torch.device("cpu")
    where = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(where)
    return where


def time_engine(
    rank: int, world: int, specs: Sequence[str], repeats: int, sides: Sequence[int] = ENGINE_SIDES
) -> dict[str, list[list[float]]]:
    """Inside every rank: per spec, [elements, median seconds of the slowest rank] of the engine
    averaging one bucket (a square matrix of each of ``sides``), end to end."""
    timings: dict[str, list[list[float]]] = {}
    for spec in specs:
        engine = Engine(spec)
        timings[spec] = []
        for side in sides:
            bucket = torch.randn(side * side, generator=torch.Generator().manual_seed(rank))
            seconds = time_bucket(engine, bucket, [side], [torch.Size([side, side])], repeats)
            timings[spec].append([float(side * side), seconds])
    return timings


def time_bucket(
    engine: Engine,
    bucket: torch.Tensor,
    keys: list[int],
    shapes: list[torch.Size],
    repeats: int,
    group: dist.ProcessGroup | None = None,
) -> float:
    """The engine averaging a copy of ``bucket`` (tensors of ``shapes``, keyed ``keys``), end to end:
    the median of the slowest rank's seconds, after two warm-ups (the first step's checks,
    workspaces, the padded all-gather's capacity). ``bucket`` is left as it is."""

    copy = bucket.clone()

    def run() -> None:
        engine.reduce(copy, keys, shapes, last=True).wait()
        engine.end_step()

    return _slowest_median(run, repeats, 2, functools.partial(copy.copy_, bucket), group)


def time_everything(
    rank: int,
    world: int,
    sizes: Sequence[int],
    repeats: int,
    specs: Sequence[str],
    kernel_repeats: int,
    sides: tuple[Sequence[int], Sequence[int]],
    device: str = "cpu",
    local: int = 1,
) -> tuple[dict[str, list[list[float]]], dict[str, list[list[Any]]], dict[str, list[list[float]]], Timings]:
    """Inside every rank: :func:`time_collectives`, :func:`time_kernels`, then :func:`time_engine`
    (``sides``: the kernels' and the engine's matrix sides), and with ``local`` > 1 (ranks per node)
    the collectives inside every node at once. With ``device`` ``cuda`` the kernels run on the GPUs
    and the engine's overhead is not timed (it runs the CPU's tensors here)."""
    inside: Timings = {}
    if local > 1:
        node, _ = subgroups(None, local)
        inside = time_collectives(rank, local, sizes, repeats, group=node)
    return (
        time_collectives(rank, world, sizes, repeats),
        time_kernels(rank, world, specs, kernel_repeats, sides[0], device),
        time_engine(rank, world, specs, kernel_repeats, sides[1]) if device == "cpu" else {},
        inside,
    )


def time_links(rank: int, world: int, sizes: Sequence[int], repeats: int, local: int = 1) -> tuple[Timings, Timings]:
    """Inside every rank: :func:`time_collectives`, and with ``local`` > 1 (ranks per node) the
    collectives inside every node at once (first, as :func:`time_everything`)."""
    inside: Timings = {}
    if local > 1:
        node, _ = subgroups(None, local)
        inside = time_collectives(rank, local, sizes, repeats, group=node)
    return time_collectives(rank, world, sizes, repeats), inside


def time_spec(
    rank: int, world: int, spec: str, repeats: int, sides: tuple[Sequence[int], Sequence[int]], device: str = "cpu"
) -> tuple[list[list[Any]], list[list[float]]]:
    """Inside every rank: one spec's :func:`time_kernels` and (on the CPU) :func:`time_engine`."""
    kernel = time_kernels(rank, world, [spec], repeats, sides[0], device)[spec]
    engine = time_engine(rank, world, [spec], repeats, sides[1])[spec] if device == "cpu" else None
    return kernel, engine or []


def overheads(profile: Profile, engine: dict[str, list[list[float]]]) -> Profile:
    """``profile`` with each kernel's engine overhead: the engine's measured bucket time minus what
    the kernels and the link predict for the same bucket (:func:`gradcomp.cost.step.predict`)."""
    cluster = profile.cluster()
    fitted = dict(profile.kernels)
    for spec, rows in engine.items():
        kernel = fitted[spec]
        extra = []
        for numel, seconds in rows:
            side = math.isqrt(int(numel))
            bucket = Workload(((side, side),), (1.0,), 0.0, 0.0)
            extra.append(seconds - predict(bucket, method_of(spec), cluster, functools.partial(_same, kernel)).step_s)
        sizes = tuple(int(numel) for numel, _ in rows)
        fitted[spec] = dataclasses.replace(kernel, bucket_numel=sizes, overhead_s=tuple(extra))
    return dataclasses.replace(profile, kernels=fitted)


def calibrate(
    network: str = "loopback",
    ranks: int = 2,
    *,
    name: str | None = None,
    sizes: Sequence[int] = SIZES,
    repeats: int = 10,
    specs: Sequence[str] = KERNEL_SPECS,
    kernel_repeats: int = 5,
    kernel_sides: Sequence[int] = kernels.SIDES,
    engine_sides: Sequence[int] = ENGINE_SIDES,
    timeout: float = 1800.0,
    device: str = "cpu",
    progress: Progress | None = None,
) -> Profile:
    """Measure and fit: the backend's collectives among ``ranks`` ranks on ``network`` (a netem
    profile), and the kernels of ``specs`` on ``device`` (``cpu``, or ``cuda``: each rank on a GPU,
    the engine's overhead then not timed). Bad arguments fail before anything runs. The ranks start
    once for the collectives, then once per spec (a tenth of a second each on loopback), so that
    ``progress`` (:func:`units` steps) can say what runs; ``timeout`` bounds each start."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no CUDA device")
    if ranks < 2:
        raise ValueError(f"--ranks must be >= 2 (a link needs two ends), got {ranks}")
    if repeats < 1 or kernel_repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats} and {kernel_repeats}")
    if len(set(sizes)) < 2 or min(sizes) < 4 or any(s % 4 for s in sizes):
        raise ValueError(f"need two or more distinct sizes, multiples of 4 bytes, got {list(sizes)}")
    canonical = list(dict.fromkeys(str(parse_spec(s)) for s in specs))  # a bad spec fails here
    cluster = netem.parse(network)
    local = cluster.per_node if isinstance(cluster, netem.Cluster) else 1
    sides = (list(kernel_sides), list(engine_sides))
    with step(progress, f"{network}: all-reduce and all-gather at {len(sizes)} sizes", 1):
        measured, inside = spawn(ranks, time_links, (list(sizes), repeats, local), timeout=timeout, network=network)[0]
    links = fit_links(measured, ranks)
    if inside:  # rank 0's node; every node timed at once
        links.update({f"{INSIDE}{name}": fit for name, fit in fit_links(inside, local).items()})
    timed, engine = {}, {}
    for i, spec in enumerate(canonical):
        with step(progress, f"kernels and engine of {spec} ({i + 1} of {len(canonical)})", 1):
            results = spawn(ranks, time_spec, (spec, kernel_repeats, sides, device), timeout=timeout, network=network)
        # each kernel timing: the median over ranks (they timed it at the same moment)
        rows = results[0][0]
        timed[spec] = [[*rows[j][:-1], statistics.median(r[0][j][-1] for r in results)] for j in range(len(rows))]
        if results[0][1]:
            engine[spec] = results[0][1]
    fitted = Profile(
        name or f"{network}-{ranks}ranks",
        network,
        ranks,
        links,
        {spec: kernels.fit([kernels.Sample(*row) for row in rows]) for spec, rows in timed.items()},
        {**machine(), "kernel_device": kernel_device(device)},
        {**measured, **{f"{INSIDE}{name}": rows for name, rows in inside.items()}, "kernels": timed, "engine": engine},
    )
    return overheads(fitted, engine)


def units(specs: Sequence[str]) -> int:
    """The steps :func:`calibrate` reports progress in: the links, then each spec."""
    return 1 + len(dict.fromkeys(str(parse_spec(s)) for s in specs))


def kernel_device(device: str) -> str:
    """What timed a profile's kernels, as its ``machine["kernel_device"]`` says: ``cpu`` or the GPU's name."""
    return "cpu" if device == "cpu" else f"cuda: {torch.cuda.get_device_name()}"


def _same(kernel: KernelCost, _: str) -> KernelCost:
    return kernel


def describe(profile: Profile) -> str:
    """A few lines: each link's fit, and how many kernels were timed."""
    lines = [f"profile {profile.name}: network {profile.network}, {profile.ranks} ranks"]
    for collective, fit in profile.links.items():
        lines.append(
            f"  {collective:10s} latency {fit.costs.alpha * 1e6:8.1f} us (+-{fit.alpha_stderr * 1e6:.1f}), "
            f"bandwidth {fit.bandwidth / 1e9:7.3f} GB/s, median error of the fit {fit.rel_error:.1%}"
        )
    lines.append(f"  kernels of {len(profile.kernels)} compressors timed")
    return "\n".join(lines)
