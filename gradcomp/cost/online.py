"""Measuring on the job: the link of a process group, the engine and the kernels on real gradients.

What the ``auto`` hook measures before it decides (:mod:`gradcomp.hooks.auto`), as plain functions
of a group and tensors (no DDP here):

- :func:`probe_link`: all-reduces and all-gathers of a few sizes on the group, every rank taking part
  (through the ordered executor), each size's median after a barrier; :func:`fit` turns them into
  a :class:`~gradcomp.cost.cluster.Cluster`.
- :func:`time_engines`: every candidate once through a fresh engine on a copy of a bucket: the
  whole path (compression, the link, decompression, the engine's own hand-overs).
- :func:`kernel_costs`: every candidate's kernels on each of a step's real gradients, with the
  engine's overhead (the engine's measured time beyond what kernels and link predict).
- :func:`workload_from`: the model's compute from :class:`Timeline` s of whole steps (when forward
  started and ended, when each bucket was handed over, when the next step started).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import statistics
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp.collectives.executor import executor
from gradcomp.collectives.groups import rank_of, registered, size_of
from gradcomp.compressors import make_compressor
from gradcomp.cost import kernels
from gradcomp.cost.calibrate import time_bucket, time_collectives
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.kernels import KernelCost
from gradcomp.cost.profile import Timings, fit_links
from gradcomp.cost.step import Method, Workload, ascending, predict
from gradcomp.engine import Engine
from gradcomp.engine.spec import HookSpec
from gradcomp.flat import views

KERNEL_REPEATS = 3
"""Timings of each kernel on a real gradient (their median): one descheduling of a busy machine
(milliseconds, beside kernels of microseconds) must not price a whole method."""

PROBE_BYTES = (4 << 10, 64 << 10, 1 << 20)
"""All-reduce and all-gather sizes that fit the link, beside the largest bucket's (2 to 16 MiB)."""
PROBE_REPEATS = 3

Bucket = tuple[int, ...]
"""A bucket's identity: the keys of its tensors."""


@dataclasses.dataclass
class Timeline:
    """One step as this rank saw it: forward's start and end, each bucket's hand-over, the next start."""

    start: float
    forward_end: float | None = None
    handed: dict[Bucket, float] = dataclasses.field(default_factory=dict)
    next_start: float | None = None

    @property
    def whole(self) -> bool:
        return self.forward_end is not None and self.next_start is not None and bool(self.handed)


def workload_from(
    seen: Sequence[Timeline],
    shapes: Mapping[Bucket, Sequence[torch.Size]],
    step_end: Callable[[Timeline], float],
) -> tuple[Workload, list[Bucket]]:
    """The model's compute from whole steps ``seen`` (medians): forward, each bucket's hand-over as
    a fraction of backward, and what follows the step's communication (optimizer, data)."""
    forward = statistics.median(t.forward_end - t.start for t in seen)  # type: ignore[operator]
    backward = statistics.median(max(t.handed.values()) - t.forward_end for t in seen)  # type: ignore[operator]
    buckets = list(seen[-1].handed)
    offset = {
        identity: statistics.median(t.handed[identity] - t.forward_end for t in seen if identity in t.handed)  # type: ignore[operator]
        for identity in buckets
    }
    after = statistics.median(t.next_start - step_end(t) for t in seen)  # type: ignore[operator]
    order = sorted(buckets, key=lambda identity: offset[identity])
    flat: list[tuple[int, ...]] = []
    fractions: list[float] = []
    groups = []
    for identity in order:
        members = [tuple(s) for s in shapes[identity]]
        groups.append(tuple(range(len(flat), len(flat) + len(members))))
        flat += members
        fractions += [offset[identity] / max(backward, 1e-9)] * len(members)
    workload = Workload(tuple(flat), ascending(fractions), forward, max(backward, 0.0), max(after, 0.0),
                        groups=tuple(groups))  # fmt: skip
    return workload, order


def probe_link(group: dist.ProcessGroup, largest_bytes: int) -> Timings:
    """Time the group's collectives at :data:`PROBE_BYTES` and near ``largest_bytes``, through the
    ordered executor (every rank calls this): :func:`gradcomp.cost.calibrate.time_collectives`."""
    top = min(max(largest_bytes, 2 << 20), 16 << 20)
    sizes = (*PROBE_BYTES, top - top % 4)
    rank, world = rank_of(group), size_of(group)

    def probe() -> tuple[Timings, None]:
        return time_collectives(rank, world, sizes, PROBE_REPEATS, warmup=1, group=group), None

    return executor().submit(probe, wait=True).wait()


def fit(timings: Timings, world: int, nodes: Nodes | None = None) -> Cluster:
    """``world`` ranks behind the link the timings show, each its own node, or with ``nodes`` in
    nodes of ``nodes.local`` ranks (ValueError if they cannot be fitted: times that do not grow with size)."""
    links = fit_links(timings, world)
    reduce, gather = links["all_reduce"].costs, links["all_gather"].costs
    if nodes is None:
        return Cluster(world, reduce, native_all_reduce=reduce, native_all_gather=gather)
    inside = fit_links(nodes.inside, nodes.local)["all_reduce"].costs
    # every node's local ranks crossing at once: a shared uplink shows as a link that much slower
    at_once = fit_links(nodes.across, world // nodes.local)["all_reduce"].costs
    shared = at_once.beta > SHARED * reduce.beta
    return Cluster(world, reduce, nodes.local, inside, native_all_reduce=reduce, native_all_gather=gather,
                   shared_uplink=shared)  # fmt: skip


SHARED = 1.5
"""How much slower the link must look with every local rank crossing at once than with one, for
:func:`fit` to take the nodes' uplinks as shared (a NIC per node, not per rank)."""


@dataclasses.dataclass(frozen=True)
class Nodes:
    """What :func:`probe_nodes` timed: the collectives inside a node (each node at once) and across
    nodes (every local rank's group at once), with ``local`` ranks per node."""

    local: int
    inside: Timings
    across: Timings


def probe_nodes(inside: dist.ProcessGroup, across: dist.ProcessGroup, largest_bytes: int) -> Nodes:
    """:func:`probe_link` inside this rank's node and across nodes among its local rank's peers
    (every rank calls this: all nodes and all local ranks at once, as the hook across nodes runs)."""
    return Nodes(dist.get_world_size(inside), probe_link(inside, largest_bytes), probe_link(across, largest_bytes))


def time_engines(
    specs: Sequence[HookSpec],
    bucket: Tensor,
    keys: list[int],
    shapes: list[torch.Size],
    group: dist.ProcessGroup | None,
    timeout: datetime.timedelta | None,
) -> list[float]:
    """Each spec through a fresh engine (its own state: nothing of training's is touched) on copies
    of ``bucket`` (:func:`gradcomp.cost.calibrate.time_bucket`, once after its warm-ups: the
    slowest rank's seconds). Every rank calls this, in the same order."""
    seconds = []
    for spec in specs:
        # on a group torch.distributed does not know (torchft's): on that group itself, as its hook runs
        known = registered(group)
        engine = Engine(spec, group=group, timeout=timeout) if known else Engine(spec, group=group, own_group=False)
        seconds.append(time_bucket(engine, bucket, keys, shapes, repeats=1, group=engine.group))
    return seconds


def kernel_costs(
    methods: Sequence[Method],
    gradients: Mapping[Bucket, Tensor],
    shapes: Mapping[Bucket, Sequence[torch.Size]],
    cluster: Cluster,
    engine_seconds: Sequence[float] | None,
    largest: Bucket,
    seed: int = 0,
    rank: int = 0,
) -> dict[str, KernelCost]:
    """Per method's compressor spec: its kernels timed on every tensor of ``gradients`` (flat buckets
    of tensors of ``shapes``; whole buckets for element-wise compressors), with the engine's overhead:
    ``engine_seconds`` (:func:`time_engines` on the ``largest`` bucket) less what the kernels and
    ``cluster`` predict for that bucket (none without ``engine_seconds``)."""
    costs: dict[str, KernelCost] = {}
    world = cluster.ranks
    for index, method in enumerate(methods):
        spec = method.kernel_spec
        if spec is None:
            raise ValueError(f"{method.label} sends nothing: it has no kernels")
        if spec in costs:  # the same compressor flat and across nodes: its kernels and the first's overhead
            continue
        compressor = make_compressor(spec, seed=seed, rank=rank)
        samples = []
        for identity, flat in gradients.items():
            if compressor.capabilities.elementwise:
                if flat.numel() == 0:
                    continue
                samples += kernels.time_tensor(compressor, flat, ("online", identity), repeats=KERNEL_REPEATS)
                continue
            for key, part in zip(identity, views(flat, shapes[identity]), strict=True):
                if part.numel() == 0:  # an empty parameter: no kernels to time (and no size to fit at)
                    continue
                samples += kernels.time_tensor(
                    compressor, part, ("online", key), repeats=KERNEL_REPEATS, peers=(world,)
                )
        kernel = kernels.fit(samples)
        if engine_seconds is None:
            costs[spec] = kernel
            continue
        members = [tuple(s) for s in shapes[largest]]
        alone = Workload(tuple(members), (1.0,) * len(members), 0.0, 0.0, groups=(tuple(range(len(members))),))
        modelled = predict(alone, method, cluster, functools.partial(_same, kernel)).step_s
        size = gradients[largest].numel()
        overhead = engine_seconds[index] - modelled
        costs[spec] = dataclasses.replace(kernel, bucket_numel=(size,), overhead_s=(overhead,))
    return costs


def _same(kernel: KernelCost, _: str) -> KernelCost:
    return kernel
