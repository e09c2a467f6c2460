"""The plan of a bucket: what the engine does with it, as a pure function of its inputs.

:func:`plan_bucket` takes the hook spec, the :class:`Context` (ranks, node layout, device), the step
(the engine's clock) and the bucket's tensors, and returns a :class:`BucketPlan`: immutable, printable,
and all the engine executes (:mod:`gradcomp.engine.routes`) and the cost model prices
(:mod:`gradcomp.cost.step`), so that the two never disagree on a route. In the order it decides:

1. **Segments.** The bucket's tensors as segments of its flat buffer (offset, shape, state key),
   large tensors cut into pieces of rows with ``HookSpec.pieces`` (:mod:`gradcomp.engine.pieces`).
   A compressor that is element-wise and stateless (the casts) takes runs of consecutive elements,
   keyless, instead of tensors: it compresses a concatenation as the tensors one by one.
2. **The warm-up** (``HookSpec.warmup``): its first steps go uncompressed (:attr:`Route.DENSE`), or
   for ratio-based sparsifiers at a keep-ratio falling to theirs (:func:`warmup_ratio`), uncompressed
   where that ratio would cost the dense gradient's bytes.
3. **Sends.** The step's last bucket travels in up to ``HookSpec.pieces`` sends, each compressed while
   the one before it is on the wire; any other bucket in one.
4. **Parts.** In a send, the per-tensor policy (``min_numel``, ``vectors``) sends the tensors it picks
   uncompressed (:attr:`Route.DENSE`), the others through the spec's route: ``sum`` payloads
   all-reduced, ``gather`` payloads all-gathered (:class:`Transfer` says how) or two-phase from
   :data:`TWO_PHASE_FROM` ranks on, and with ``local_size`` across nodes (:attr:`Part.inner`: the
   node's reduce-scatter, the route on this rank's shard, the node's all-gather).

``str(plan)`` is what each tensor of the bucket does and why (``gradcomp explain``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
from collections.abc import Hashable, Sequence

import torch

from gradcomp.collectives.ring import chunk_bounds
from gradcomp.compressors import Aggregation, Capabilities, Segments, Spec
from gradcomp.compressors.keys import StateKey
from gradcomp.engine import pieces
from gradcomp.engine.hierarchical import NodeShards
from gradcomp.engine.spec import ALLREDUCE, TWO_PHASE_FROM, HookSpec, warmup_ratio


class Route(str, enum.Enum):
    """How a part of a bucket travels: the engine runs it, the cost model prices it."""

    NONE = "none"
    """Nothing travels (``noop``)."""
    DENSE = "dense"
    """Each tensor's share of an uncompressed all-reduce (a warm-up step, the per-tensor policy)."""
    SUM = "sum"
    """Payloads all-reduced (``sum`` compressors, ``allreduce``), with the spec's ``algo``."""
    GATHER = "gather"
    """Every rank's payloads all-gathered, each rank summing them in rank order."""
    TWO_PHASE = "two_phase"
    """A compressed reduce-scatter, then an all-gather of the compressed shards."""
    NODES = "nodes"
    """Across nodes: the node's reduce-scatter, :attr:`Part.inner` on this rank's shard, the node's all-gather."""


class Transfer(str, enum.Enum):
    """How a :attr:`Route.GATHER` part's payloads travel (every rank's, to every rank)."""

    IN_FLIGHT = "in_flight"
    """Payloads of the same shapes on every rank, in the backend's all-gather, left in flight."""
    ALIKE = "alike"
    """Payloads of the same shapes on every rank, in gradcomp's all-gather (``algo`` not native)."""
    PADDED = "padded"
    """Sizes that vary, in the backend's all-gather padded to a capacity learned per bucket."""
    SIZED = "sized"
    """Sizes first, then the payloads (a warm-up's payloads, gradcomp's algorithms)."""
    MEASURED = "measured"
    """Sizes counted on the device and read once for the bucket, then the payloads (an accelerator)."""


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a plan runs: the ranks it averages over, their nodes, and the device."""

    world: int
    """Ranks of the group."""
    local_rank: int = 0
    """This rank's index in its node (``HookSpec.local_size``: the shard it compresses across nodes)."""
    accelerator: bool = False
    """Whether the gradients are on an accelerator, where reading a tensor on the host is a
    synchronization (payloads sized by their values are then measured first: :attr:`Transfer.MEASURED`)."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """One tensor (or piece, or run of elements) of a buffer: where it lies and whose state it has."""

    key: Hashable
    """Its state's key (a hook's own key, or a :class:`~gradcomp.compressors.keys.StateKey` for a
    part of one); None for a run of an element-wise, stateless compressor."""
    shape: torch.Size
    offset: int
    """Its first element in the buffer."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclasses.dataclass(frozen=True)
class Part:
    """Segments that travel one way."""

    route: Route
    segments: tuple[Segment, ...]
    ratio: float | None = None
    """The warm-up's keep-ratio for a ratio-based sparsifier (None: the compressor's own)."""
    transfer: Transfer | None = None
    """How a :attr:`Route.GATHER` part's payloads travel."""
    inner: Part | None = None
    """:attr:`Route.NODES`: the part of this rank's shard that travels across nodes, its segments in
    the shard's buffer (the node's layout: :class:`~gradcomp.engine.hierarchical.NodeShards`)."""
    why: str = ""

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @property
    def contiguous(self) -> bool:
        """Whether the segments are consecutive (the part is one span of its buffer)."""
        return all(a.stop == b.offset for a, b in itertools.pairwise(self.segments))

    @property
    def keys(self) -> tuple[Hashable, ...]:
        return tuple(s.key for s in self.segments)

    @functools.cached_property
    def layout(self) -> Segments:
        """The segments as a compressor takes them (``Compressor.compress_part``), made once."""
        segments = self.segments
        return Segments(tuple(s.offset for s in segments), tuple(s.shape for s in segments), self.keys)

    @property
    def label(self) -> str:
        """The route and, for a gather part, its transfer: ``gather (in_flight)``."""
        return self.route.value + (f" ({self.transfer.value})" if self.transfer else "")


@dataclasses.dataclass(frozen=True)
class Send:
    """What travels together (one record): every part of a span of the bucket."""

    parts: tuple[Part, ...]
    start: int
    stop: int
    piece: int = 0
    """Its number when the step's last bucket travels in pieces (``HookSpec.pieces``); else 0."""
    uncompressed: int = 0
    """Elements the per-tensor policy sends uncompressed (its :attr:`Route.DENSE` part's)."""


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """What the engine does with one bucket at one step (:func:`plan_bucket`)."""

    bucket: int
    numel: int
    sends: tuple[Send, ...]
    settled: bool
    """Past the warm-up: payloads have the size they keep."""
    warmup: str = ""
    """The warm-up's state at this step (empty past it)."""

    @property
    def parts(self) -> list[Part]:
        return [part for send in self.sends for part in send.parts]

    def __str__(self) -> str:
        head = f"bucket {self.bucket}: {self.numel} elements" + (f", {self.warmup}" if self.warmup else "")
        lines = [head]
        indent = "    " if len(self.sends) > 1 else "  "
        for send in self.sends:
            if len(self.sends) > 1:
                lines.append(f"  piece {send.piece}: elements {send.start}-{send.stop}")
            lines += [indent + line for part in send.parts for line in _lines(part)]
        return "\n".join(lines)


def _lines(part: Part) -> list[str]:
    how = part.label
    how += f" at ratio {part.ratio:.3g}" if part.ratio is not None else ""
    count = len(part.segments)
    how += f" [{count} segment{'' if count == 1 else 's'}, {part.numel:,} elements]"
    lines = [f"{how}: {part.why}" if part.why else how]
    lines += [f"  {_segment(s)}" for s in part.segments]
    if part.inner is not None:
        lines += [f"  across nodes, this rank's shard: {line}" for line in _lines(part.inner)[:1]]
    return lines


def _segment(segment: Segment) -> str:
    what = "elements" if segment.key is None else str(StateKey.of(segment.key))
    return f"{what} {tuple(segment.shape)} at {segment.offset}"


@functools.lru_cache(maxsize=256)
def declared(spec: Spec) -> Capabilities:
    """What a compressor spec declares, error feedback's changes included (``Spec.capabilities``):
    all the planner knows of a compressor. Cached per spec: the planner asks at every decision."""
    return spec.capabilities


def segments_of(
    spec: HookSpec, numel: int, keys: Sequence[Hashable] | None, shapes: Sequence[torch.Size] | None
) -> tuple[Segment, ...]:
    """The bucket's tensors as segments (pieces cut with ``spec.pieces``), or one run of its elements
    where the spec needs no tensors (:func:`needs_tensors`)."""
    if not needs_tensors(spec):
        return (Segment(None, torch.Size((numel,)), 0),)
    if keys is None or shapes is None:
        raise ValueError(f"{spec} needs the keys and shapes of the bucket's tensors")
    if len(keys) != len(shapes) or sum(math.prod(s) for s in shapes) != numel:
        raise ValueError(
            f"{len(keys)} keys and shapes holding {sum(math.prod(s) for s in shapes)} elements "
            f"do not describe a buffer of {numel}"
        )
    if spec.pieces > 1 and spec.compressor is not None:  # in every bucket: rule "state per tensor"
        keys, shapes = pieces.cut(keys, shapes, spec.pieces, declared(spec.compressor).piece_multiple, spec.min_numel)
    offsets = itertools.accumulate((math.prod(s) for s in shapes), initial=0)
    return tuple(Segment(k, torch.Size(s), o) for k, s, o in zip(keys, shapes, offsets, strict=False))


def needs_tensors(spec: HookSpec) -> bool:
    """Whether planning needs the bucket's keys and shapes: not for an element-wise, stateless
    compressor (``allreduce``, the casts), which compresses the bucket whole, so that a hook need not
    list its parameters, unless a per-tensor policy picks tensors out of it."""
    return spec.compressor is not None and (not declared(spec.compressor).elementwise or spec.keeps_some_dense)


def plan_bucket(
    spec: HookSpec,
    context: Context,
    step: int,
    segments: tuple[Segment, ...],
    bucket: int = 0,
    last: bool = False,
) -> BucketPlan:
    """The plan of a bucket of ``segments`` (:func:`segments_of`) at ``step`` (the engine's clock,
    from 0, resumed steps included); ``last``: the step's last bucket (it may travel in pieces)."""
    numel = segments[-1].stop if segments else 0
    if spec.compressor is None:
        return BucketPlan(bucket, numel, (Send((Part(Route.NONE, segments, why="noop"),), 0, numel),), True)
    warm = _Warmup.at(spec, step)
    if warm.dense:
        part = Part(Route.DENSE, _runs(spec, segments), why=warm.why)
        return BucketPlan(bucket, numel, (Send((part,), 0, numel),), False, warm.why)
    spans = _spans(spec, segments, numel) if last and spec.pieces > 1 else [(0, numel, segments)]
    sends = tuple(_send(spec, context, warm, group, start, stop, piece if len(spans) > 1 else 0)
                  for piece, (start, stop, group) in enumerate(spans))  # fmt: skip
    return BucketPlan(bucket, numel, sends, warm.settled, "" if warm.settled else warm.why)


@dataclasses.dataclass(frozen=True)
class _Warmup:
    """One step of the warm-up (``HookSpec.warmup``)."""

    dense: bool
    ratio: float | None
    settled: bool
    why: str = ""

    @classmethod
    def at(cls, spec: HookSpec, step: int) -> _Warmup:
        assert spec.compressor is not None
        settled = step >= spec.warmup
        if settled:
            return cls(False, None, True)
        where = f"warm-up step {step + 1} of {spec.warmup}"
        found = declared(spec.compressor)
        if found.ratio is None:
            return cls(True, None, False, f"{where}: uncompressed")
        ratio = warmup_ratio(found.ratio, spec.warmup, step)
        if ratio >= found.dense_from:
            return cls(True, None, False, f"{where}: ratio {ratio:.3g} would send the dense bytes, uncompressed")
        return cls(False, ratio, False, f"{where}: ratio {ratio:.3g}")


def _spans(spec: HookSpec, segments: tuple[Segment, ...], numel: int) -> list[tuple[int, int, tuple[Segment, ...]]]:
    """The step's last bucket in up to ``spec.pieces`` spans of whole segments, or of its elements
    when it travels whole (:mod:`gradcomp.engine.pieces`)."""
    assert spec.compressor is not None
    if len(segments) == 1 and segments[0].key is None and not spec.keeps_some_dense:
        cuts = pieces.spans(numel, spec.pieces, declared(spec.compressor).piece_multiple)
        return [(start, stop, (Segment(None, torch.Size((stop - start,)), start),)) for start, stop in cuts]
    groups = pieces.parts([s.numel for s in segments], spec.pieces)
    return [(segments[g.start].offset, segments[g.stop - 1].stop, segments[g.start : g.stop]) for g in groups]


def _send(
    spec: HookSpec, context: Context, warm: _Warmup, segments: tuple[Segment, ...], start: int, stop: int, piece: int
) -> Send:
    """A send's segments by the per-tensor policy: those it sends uncompressed, the others by the
    spec's route (across nodes with ``local_size``)."""
    uncompressed = [s.key is not None and spec.uncompressed(s.shape) for s in segments]
    dense = tuple(s for s, u in zip(segments, uncompressed, strict=True) if u)
    kept = tuple(s for s, u in zip(segments, uncompressed, strict=True) if not u)
    parts = []
    if kept:
        parts.append(_compressed(spec, context, warm, kept))
    if dense:
        parts.append(Part(Route.DENSE, _runs(spec, dense), why=_policy(spec)))
    return Send(tuple(parts), start, stop, piece, sum(s.numel for s in dense))


def _compressed(spec: HookSpec, context: Context, warm: _Warmup, segments: tuple[Segment, ...]) -> Part:
    """The spec's route for ``segments``, across nodes with ``local_size``."""
    local = spec.local_size
    if local <= 1:
        return _route(spec, context.world, context, warm, _runs(spec, segments))
    shard = _shard(spec, segments, local, context.local_rank)
    inner = _route(spec, context.world // local, context, warm, shard)
    why = f"reduce-scattered inside the node of {local}, this rank's shard {inner.route.value} across nodes"
    return Part(Route.NODES, _runs(spec, segments), warm.ratio, inner=inner, why=why)


def _route(spec: HookSpec, world: int, context: Context, warm: _Warmup, segments: tuple[Segment, ...]) -> Part:
    """The spec's route among ``world`` ranks: ``gather`` compressors go two-phase when asked, or
    with ``aggregation=auto`` from :data:`TWO_PHASE_FROM` ranks on, except under EF21 (its estimates
    take each aggregate once)."""
    assert spec.compressor is not None
    found = declared(spec.compressor)
    ef21 = spec.compressor.feedback.variant == "ef21"
    if found.aggregation is Aggregation.SUM:
        name = ALLREDUCE if spec.compressor.name == "none" else spec.compressor.name
        return Part(Route.SUM, segments, warm.ratio, why=f"{name} sums its payloads: all-reduced ({spec.algo})")
    if spec.aggregation == "two_phase" or (spec.aggregation == "auto" and world >= TWO_PHASE_FROM and not ef21):
        why = "asked for" if spec.aggregation == "two_phase" else f"{world} ranks >= {TWO_PHASE_FROM}"
        return Part(Route.TWO_PHASE, segments, warm.ratio, why=f"reduce-scattered compressed, then gathered: {why}")
    transfer, why = _transfer(spec, found, warm.settled, context.accelerator)
    return Part(Route.GATHER, segments, warm.ratio, transfer, why=why)


def _transfer(spec: HookSpec, found: Capabilities, settled: bool, accelerator: bool) -> tuple[Transfer, str]:
    """How a gather part's payloads travel, and why."""
    native = spec.algo == "native"
    if not settled:
        return Transfer.SIZED, "all-gathered, sizes first: a warm-up's payloads are larger than they will be"
    if found.measures and accelerator:
        return Transfer.MEASURED, "all-gathered: sizes counted on the device, one host read for the bucket"
    if found.same_shapes:
        if native:
            return Transfer.IN_FLIGHT, "all-gathered (same shapes on every rank): the backend's, in flight"
        return Transfer.ALIKE, f"all-gathered (same shapes on every rank) with {spec.algo}"
    if native:
        return Transfer.PADDED, "all-gathered, sizes vary: padded to the capacity the bucket needed"
    return Transfer.SIZED, f"all-gathered, sizes vary: sizes first, with {spec.algo}"


def _shard(spec: HookSpec, segments: tuple[Segment, ...], local: int, local_rank: int) -> tuple[Segment, ...]:
    """This rank's shard of ``segments`` across nodes, as segments of the shard's own buffer: piece
    ``local_rank`` of every tensor's rows (:class:`~gradcomp.engine.hierarchical.NodeShards`), or a
    run of the elements for an element-wise compressor."""
    if segments[0].key is None:  # runs: the elements in ``local`` chunks
        numel = sum(s.numel for s in segments)
        start, stop = chunk_bounds(numel, local)[local_rank]
        return (Segment(None, torch.Size((stop - start,)), 0),)
    shards = NodeShards(tuple(s.shape for s in segments), local)
    shapes = shards.shard_shapes(local_rank)
    offsets = itertools.accumulate((math.prod(s) for s in shapes), initial=0)
    keys = [StateKey.of(s.key).of_node(local_rank) for s in segments]
    return tuple(Segment(k, s, o) for k, s, o in zip(keys, shapes, offsets, strict=False))


def _runs(spec: HookSpec, segments: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """``segments``, or for an element-wise, stateless compressor its maximal runs of consecutive
    elements, keyless: it compresses a run as the tensors in it one by one."""
    assert spec.compressor is not None
    if not declared(spec.compressor).elementwise or all(s.key is None for s in segments):
        return segments
    runs: list[Segment] = []
    for s in segments:
        if runs and runs[-1].stop == s.offset:
            runs[-1] = Segment(None, torch.Size((runs[-1].numel + s.numel,)), runs[-1].offset)
        else:
            runs.append(Segment(None, torch.Size((s.numel,)), s.offset))
    return tuple(runs)


def _policy(spec: HookSpec) -> str:
    rules = [f"fewer than {spec.min_numel} elements"] if spec.min_numel else []
    rules += ["1-D (vectors=dense)"] if spec.vectors == "dense" else []
    return "uncompressed by the per-tensor policy: " + " or ".join(rules)
