"""A data-parallel step, predicted: compute, bucketed communication overlapped with backward, the tail.

DDP hands gradients over in buckets, in the order backward produces them; each bucket's hook
compresses it (in backward's thread: on a CPU that delays the rest of backward), the collectives of
successive buckets queue on one link (the engine's ordered executor), and each bucket is decompressed
when its collective lands (on a CPU, on the same core as backward). The step ends when backward and
every bucket's decompression are done, then the optimizer steps. :func:`predict` replays that
schedule with the costs of a :class:`~gradcomp.cost.cluster.Cluster` and of the compressor's kernels
(:mod:`gradcomp.cost.kernels`)::

    forward | backward ... ready(b0) compress(b0) backward ... ready(b1) compress(b1) ... | tail | optimizer
                                     [ collective(b0) ] decompress(b0)  [ collective(b1) ] decompress(b1)

What it leaves out: the backend's own CPU use (on loopback, copying through the kernel competes
with backward), DDP's copies into bucket buffers, and jitter. The validation benchmark measures how
far that takes it (``docs/cost-model.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gradcomp.collectives.cost_model import all_reduce_seconds, ring_traffic
from gradcomp.compressors import Spec, make_compressor, parse_spec
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.kernels import KernelCost
from gradcomp.engine.plan import BucketPlan, Context, Part, Route, plan_bucket, segments_of
from gradcomp.engine.spec import HookSpec, HookSpecLike

FIRST_BUCKET_BYTES, BUCKET_BYTES = 1 << 20, 25 << 20
"""DDP's bucket caps (``dist._DEFAULT_FIRST_BUCKET_BYTES`` and ``bucket_cap_mb=25``)."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model's gradients and the compute of one step.

    ``shapes`` are the parameters' shapes in the order backward produces their gradients (for most
    models the reverse of their registration order); ``ready`` the fraction of backward after which
    each one is ready (ascending, the last 1.0). :meth:`uniform` spreads backward by element count.
    """

    shapes: tuple[tuple[int, ...], ...]
    ready: tuple[float, ...]
    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0
    element_size: int = 4
    bucket_caps: tuple[int, int] = (FIRST_BUCKET_BYTES, BUCKET_BYTES)
    groups: tuple[tuple[int, ...], ...] | None = None
    """The buckets as indices into :attr:`shapes`, when known (the ``auto`` hook sees DDP's own);
    None: as DDP assigns them (:meth:`buckets`)."""

    def __post_init__(self) -> None:
        if not self.shapes or len(self.ready) != len(self.shapes):
            raise ValueError("a workload needs at least one gradient and a ready fraction for each")
        if any(b < a for a, b in zip(self.ready, self.ready[1:], strict=False)) or not self.ready[0] >= 0:
            raise ValueError("ready fractions must be ascending, from 0 to 1")
        if min(self.forward_s, self.backward_s, self.optimizer_s) < 0:
            raise ValueError("compute times must be >= 0")
        if self.groups is not None and sorted(i for g in self.groups for i in g) != list(range(len(self.shapes))):
            raise ValueError("explicit buckets must hold every gradient exactly once")

    @classmethod
    def uniform(
        cls, shapes: Sequence[Sequence[int]], compute_s: float, backward_share: float = 2 / 3, **options: float
    ) -> Workload:
        """``shapes`` in registration order; ``compute_s`` split into forward and backward (backward
        ``backward_share`` of it, gradients ready in reverse order, in proportion to their elements)."""
        if not 0 < backward_share <= 1:
            raise ValueError(f"backward_share must be in (0, 1], got {backward_share}")
        ordered = [tuple(s) for s in reversed(shapes)]
        sizes = [math.prod(s) for s in ordered]
        total, seen, ready = sum(sizes), 0, []
        for size in sizes:
            seen += size
            ready.append(seen / total)
        return cls(tuple(ordered), tuple(ready), compute_s * (1 - backward_share), compute_s * backward_share,
                   **options)  # type: ignore[arg-type]  # fmt: skip

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def state(self) -> dict[str, Any]:
        """Plain values (lists, numbers) for a checkpoint; :meth:`from_state` reads them back."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Workload:
        def tupled(value: Any) -> Any:
            return tuple(tupled(v) for v in value) if isinstance(value, list) else value

        return cls(**{key: tupled(value) for key, value in state.items()})

    def buckets(self) -> list[list[int]]:
        """Indices into :attr:`shapes` per bucket, as DDP assigns them once it has seen the order
        gradients arrive in: a bucket closes when it reaches its cap (the first one 1 MiB, then 25 MiB).
        :attr:`groups` when given."""
        if self.groups is not None:
            return [list(g) for g in self.groups]
        buckets: list[list[int]] = [[]]
        filled = 0
        for index, shape in enumerate(self.shapes):
            buckets[-1].append(index)
            filled += math.prod(shape) * self.element_size
            if filled >= self.bucket_caps[min(len(buckets) - 1, 1)]:
                buckets.append([])
                filled = 0
        return [b for b in buckets if b]


@dataclasses.dataclass(frozen=True)
class Method:
    """A hook as the cost model prices it: its spec (what the engine runs: the cost model prices the
    engine's own plan of it, :func:`plan_of`), a label for tables, and the all-reduce
    algorithm its ``sum`` payloads are priced on: the spec's, or in the planner one that no hook runs
    (hierarchical, in-network reduction). :func:`method_of` makes one from a spec."""

    label: str
    spec: HookSpec
    algo: str = "native"

    @property
    def compressor(self) -> Spec | None:
        """The compressor spec (None: nothing is sent)."""
        return self.spec.compressor

    @property
    def kernel_spec(self) -> str | None:
        """The compressor spec whose kernels this method runs (None: no kernel)."""
        return None if self.compressor is None else str(self.compressor)


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """Seconds of one step and where they go; bytes one rank sends."""

    method: str
    step_s: float
    compute_s: float
    compress_s: float
    decompress_s: float
    communicate_s: float
    """The collectives' time, summed over buckets (overlapped with backward or not)."""
    payload_bytes: float
    sent_bytes: float

    @property
    def exposed_s(self) -> float:
        """What communication adds to the step beyond computing and (de)compressing."""
        return max(0.0, self.step_s - self.compute_s - self.compress_s - self.decompress_s)

    @property
    def communication_share(self) -> float:
        """The part of the step that is not the model's own compute."""
        return 1 - self.compute_s / self.step_s if self.step_s else 0.0


@functools.lru_cache(maxsize=4096)
def payload_bytes(spec: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Bytes per round of ``spec``'s payload for one float32 tensor of ``shape``: the compressor's own
    ``wire_bytes`` of a real compression of a generated tensor (cached per spec and shape)."""
    compressor = make_compressor(parse_spec(spec))
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    payload, ctx = compressor.compress(tensor, key="payload_bytes")
    sizes = [compressor.wire_bytes(payload)]
    for _ in range(1, compressor.capabilities.rounds):
        payload, ctx = compressor.next_round(payload, ctx)
        sizes.append(compressor.wire_bytes(payload))
    return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class BucketCost:
    """One bucket under one method: seconds on backward's core (``compress``, ``decompress``), on
    the link (``link``: collectives, later rounds' compute, the engine's overhead), and bytes."""

    compress: float = 0.0
    decompress: float = 0.0
    communicate: float = 0.0
    link: float = 0.0
    payload: float = 0.0
    sent: float = 0.0


def bucket_cost(
    shapes: Sequence[tuple[int, ...]], method: Method, cluster: Cluster, kernels: Callable[[str], KernelCost]
) -> BucketCost:
    """What averaging one bucket of tensors of ``shapes`` costs with ``method`` on ``cluster``: the
    plan the engine executes (:func:`plan_of`), each of its parts priced by its route."""
    if method.compressor is None or cluster.ranks == 1:
        return BucketCost()
    parts = [part_cost(part, method, cluster, kernels) for part in plan_of(shapes, method, cluster).parts]
    return BucketCost(*(sum(getattr(c, f.name) for c in parts) for f in dataclasses.fields(BucketCost)))


def plan_of(shapes: Sequence[tuple[int, ...]], method: Method, cluster: Cluster) -> BucketPlan:
    """The plan the engine runs for a bucket of tensors of ``shapes`` (keyed by their index), past
    the warm-up, on ``cluster``'s ranks."""
    spec = method.spec
    if spec.local_size > 1 and cluster.ranks % spec.local_size:
        raise ValueError(f"local_size={spec.local_size} does not divide the cluster's {cluster.ranks} ranks")
    sizes = [torch.Size(s) for s in shapes]
    segments = segments_of(spec, sum(math.prod(s) for s in sizes), list(range(len(sizes))), sizes)
    return plan_bucket(spec, Context(cluster.ranks), spec.warmup, segments)


def part_cost(part: Part, method: Method, cluster: Cluster, kernels: Callable[[str], KernelCost]) -> BucketCost:
    """One part of a bucket's plan on ``cluster``, by its route: the per-tensor policy's uncompressed
    tensors as their own all-reduce, the compressed ones by the spec's route, across nodes around
    the route on this rank's shard."""
    if part.route is Route.NONE:
        return BucketCost()
    if part.route is Route.NODES:
        return _across_nodes(part, method, cluster, kernels)
    spec = parse_spec("none") if part.route is Route.DENSE else method.compressor
    assert spec is not None
    kernel, rounds = kernels(str(spec)), _payload_rounds(spec, part)
    # an uncompressed part travels as one flat buffer, and a compressor that takes a whole part at
    # once runs its kernels once for it: priced as one tensor of the part's elements
    whole = part.route is Route.DENSE or spec.capabilities.whole_part
    sizes = [part.numel] if whole else [s.numel for s in part.segments]
    p = cluster.ranks
    gather = part.route in (Route.GATHER, Route.TWO_PHASE)
    compress_s = sum(kernel.compress(n) for n in sizes)
    decompress_s = sum(kernel.decompress(n, p if part.route is Route.GATHER else 1) for n in sizes)
    if part.route is Route.TWO_PHASE:  # a compressed reduce-scatter (each rank sums p shards), then an all-gather
        compress_s += sum(kernel.compress(n / p) for n in sizes)
        decompress_s = sum(kernel.decompress(n / p, p) * 2 for n in sizes)
    if not gather:
        seconds = sum(cluster.all_reduce(method.algo, b) for b in rounds)
        sent = sum(cluster.all_reduce_bytes(method.algo, b) for b in rounds)
    elif part.route is Route.TWO_PHASE:
        seconds = cluster.all_to_all(rounds[0]) + cluster.all_gather(rounds[0] / p)
        sent = rounds[0] * (p - 1) / p * 2
    else:
        seconds = cluster.all_gather(rounds[0])
        sent = rounds[0] * (p - 1)
    # the later rounds' compute runs between the collectives; the engine's overhead (measured in
    # calibration) delays the bucket's landing
    link = seconds + _later_rounds(kernel, sizes, len(rounds)) + kernel.overhead(sum(sizes))
    return BucketCost(compress_s, decompress_s, seconds, link, sum(rounds), sent)


def _payload_rounds(spec: Spec, part: Part) -> list[float]:
    """The part's payload bytes per round: each segment's, by a real compression of one of its shape
    (:func:`payload_bytes`); a run of an element-wise compressor's elements as that many single
    elements (its payload is the concatenation of theirs)."""
    text = str(spec)
    per_segment = [
        tuple(s.numel * b for b in payload_bytes(text, (1,))) if s.key is None else payload_bytes(text, tuple(s.shape))
        for s in part.segments
    ]
    return [float(sum(r[i] for r in per_segment)) for i in range(len(per_segment[0]))] if per_segment else [0.0]


def _across_nodes(part: Part, method: Method, cluster: Cluster, kernels: Callable[[str], KernelCost]) -> BucketCost:
    """A part across nodes (``local_size`` = L, :mod:`gradcomp.engine.hierarchical`): the node's ring
    reduce-scatter and all-gather of the part on the link inside a node, around the spec's route
    among the local rank j of every node on each tensor's j-th piece of rows (its plan's inner part:
    every local rank at once, each on its own path across, as :class:`Cluster` has it). The engine's
    executor runs it after the bucket is handed over; the shard's compression and decompression take
    the rank's compute as the flat hook's do (on a CPU the executor shares backward's core, on a GPU
    its SMs), so they are priced on backward's clock, the collectives on the link's."""
    assert part.inner is not None
    local = method.spec.local_size
    n_bytes = part.numel * 4
    inside = all_reduce_seconds("ring", n_bytes, local, cluster.inside)  # a reduce-scatter and an all-gather
    # every local rank crosses at once: on a shared uplink each has 1 / L of it, the backend's
    # collectives' fits too
    reduce_fit, gather_fit = (None if fit is None else cluster.crossing(local, fit)
                              for fit in (cluster.native_all_reduce, cluster.native_all_gather))  # fmt: skip
    across = Cluster(cluster.ranks // local, cluster.crossing(local), native_all_reduce=reduce_fit,
                     native_all_gather=gather_fit)  # fmt: skip
    shard = part_cost(part.inner, method, across, kernels)
    sent = shard.sent + ring_traffic(local) * n_bytes
    return BucketCost(shard.compress, shard.decompress, inside + shard.communicate, inside + shard.link,
                      shard.payload, sent)  # fmt: skip


def predict(
    workload: Workload,
    method: Method | Sequence[Method],
    cluster: Cluster,
    kernels: Callable[[str], KernelCost],
) -> StepPrediction:
    """The step time of ``workload`` on ``cluster`` with ``method`` (one for every bucket, or one per
    bucket: the ``auto`` hook's mixes); ``kernels(spec)`` gives a compressor's kernel costs. See the
    module's docstring for the schedule."""
    buckets = workload.buckets()
    methods = [method] * len(buckets) if isinstance(method, Method) else list(method)
    if len(methods) != len(buckets):
        raise ValueError(f"{len(methods)} methods for {len(buckets)} buckets")
    core = workload.forward_s  # the clock of backward's core
    link = 0.0  # when the link is free
    done_at: list[tuple[float, float]] = []  # per bucket: when its collectives end, its decompression's cost
    decompressed = 0  # buckets whose decompression has run
    costs = []
    previous = 0.0
    for bucket, chosen in zip(buckets, methods, strict=True):
        ready = workload.ready[bucket[-1]]
        # decompressions whose collective landed take the core between backward's chunks
        while decompressed < len(done_at) and done_at[decompressed][0] <= core:
            core += done_at[decompressed][1]
            decompressed += 1
        core += (ready - previous) * workload.backward_s
        previous = ready
        cost = bucket_cost([workload.shapes[i] for i in bucket], chosen, cluster, kernels)
        costs.append(cost)
        core += cost.compress
        if chosen.compressor is None:
            continue  # nothing travels
        link = max(core, link) + cost.link
        done_at.append((link, cost.decompress))
    core += (1 - previous) * workload.backward_s
    for landed, spent in done_at[decompressed:]:
        core = max(core, landed) + spent
    labels = list(dict.fromkeys(m.label for m in methods))
    return StepPrediction(
        labels[0] if len(labels) == 1 else " + ".join(labels),
        core + workload.optimizer_s,
        workload.compute_s,
        *(
            sum(getattr(c, name) for c in costs)
            for name in ("compress", "decompress", "communicate", "payload", "sent")
        ),
    )


def ascending(fractions: Sequence[float]) -> tuple[float, ...]:
    """Ready fractions as a :class:`Workload` takes them: in [0, 1], the last 1, none above a later
    one (medians over different steps may cross)."""
    clipped = [min(1.0, max(0.0, f)) for f in fractions]
    clipped[-1] = 1.0
    for k in range(len(clipped) - 2, -1, -1):
        clipped[k] = min(clipped[k], clipped[k + 1])
    return tuple(clipped)


def _plain(value: Any) -> Any:
    """Tuples (of tuples) as lists."""
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _later_rounds(kernel: KernelCost, sizes: list[int], rounds: int) -> float:
    """The later rounds' compute of a multi-round compressor: between its collectives, on the link's clock."""
    return sum(kernel.next_round(n) for n in sizes) if rounds > 1 else 0.0


def method_of(spec: HookSpecLike, label: str | None = None) -> Method:
    """The :class:`Method` of a gradcomp hook spec (``allreduce``, ``noop``, any compressor's),
    labelled with its canonical text unless ``label`` names it."""
    parsed = HookSpec.parse(spec)
    return Method(str(parsed) if label is None else label, parsed, parsed.algo)
