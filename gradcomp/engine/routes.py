"""The routes: each executes a :class:`~gradcomp.engine.plan.Part` of a bucket's plan in two steps.

- ``prepare(part, buffer, record)``, in the caller's thread (DDP's backward): divide by the world size
  and compress round one, so that the next bucket's compression overlaps this bucket's communication;
  it returns a :class:`Prepared` (the part's tensors and payloads), which only ``send`` reads.
- ``send(prepared)``, on the ordered executor: every further round, the collective, the decompression
  into the bucket. It returns None once the part holds its average, or a future that completes when
  it does: a final collective on the backend is left in flight, and the executor moves on to the
  next bucket's (rule "one ordered path" is about *issuing* collectives in order; finishing one
  issues nothing).

Each route measures into the send's record (:class:`~gradcomp.engine.stats.BucketRecord`): its
phases' times, the payload bytes it produced, its collectives' traffic. A route never changes its
compressor's settings: a warm-up's keep-ratio comes with the part.

=====================  ===========================================================================
:class:`SumRoute`      ``sum`` payloads (casts, random-k, PowerSGD, ``allreduce``): all-reduced per
                       dtype with the spec's algorithm, every round, then decompressed from the sum
:class:`GatherRoute`   the other payloads: packed and all-gathered (as the part's ``Transfer``
                       says), summed in rank order
:class:`TwoPhaseRoute` a compressed reduce-scatter, then an all-gather (``two_phase.py``)
:class:`DenseRoute`    each tensor's share of an uncompressed all-reduce (a warm-up, the policy)
``NodesRoute``         across nodes (:mod:`gradcomp.engine.hierarchical`)
=====================  ===========================================================================
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives, host
from gradcomp.collectives import ring
from gradcomp.collectives.cost_model import ring_traffic
from gradcomp.collectives.executor import match_torch_threads
from gradcomp.collectives.groups import rank_of, size_of
from gradcomp.collectives.link import Link
from gradcomp.collectives.ops import ReduceOp
from gradcomp.collectives.ring import chunk_bounds
from gradcomp.compressors import Aggregation, Compressor, Key, Measured, Payload
from gradcomp.engine import transport, two_phase
from gradcomp.engine.hierarchical import NodeShards, Pairs, gather, scatter
from gradcomp.engine.plan import Part, Route, Segment, Transfer
from gradcomp.engine.stats import BucketRecord
from gradcomp.errors import backend_failure
from gradcomp.flat import views


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A part ready to travel: what ``prepare`` made of it in the caller's thread."""

    part: Part
    record: BucketRecord
    buffer: Tensor
    """The flat buffer the part's segments lie in: compression reads it, decompression writes it."""
    states: list[tuple[Payload, Any]] = dataclasses.field(default_factory=list)
    """Per segment, round one's payload and the local context (empty where ``send`` compresses)."""
    measured: list[Measured] = dataclasses.field(default_factory=list)
    """Per segment, what measuring it on the device found (:attr:`Transfer.MEASURED`): its payload's
    size, and what to compress once every size is known, handed back to the compressor then."""
    homes: list[Tensor] = dataclasses.field(default_factory=list)
    """Where the segments land when :attr:`buffer` holds a copy of them (empty: it is their home)."""


class RouteSteps(Protocol):
    """A way for a part's payloads to travel (the module's docstring)."""

    issues_only: bool
    """Whether :meth:`send` only issues the backend's asynchronous all-reduce: it may then run in the
    caller's thread when the executor is idle, as torch's own hooks issue theirs."""

    def prepare(self, part: Part, buffer: Tensor, record: BucketRecord) -> Prepared:
        """In the caller's thread: divide, compress round one."""

    def send(self, prepared: Prepared) -> Future[None] | None:
        """On the executor: communicate and decompress; a future when the part lands later."""


class _Compressed:
    """What the routes of a compressor share: the group, the algorithm, and the rounds' all-reduces."""

    def __init__(self, compressor: Compressor, group: dist.ProcessGroup, algo: str) -> None:
        self.compressor, self.group, self.algo = compressor, group, algo
        self.world, self.rank = size_of(group), rank_of(group)
        declared = compressor.capabilities
        self.issues_only = algo == "native" and declared.rounds == 1 and declared.aggregation is Aggregation.SUM

    def prepare(self, part: Part, buffer: Tensor, record: BucketRecord) -> Prepared:
        """Each segment compressed divided by the world size (round one; compressors that can fold
        the division into their first pass do)."""
        with record.phase("compress"):  # a warm-up's keep-ratio comes with the part
            states = self.compressor.compress_part(buffer, part.layout, self.world, ratio=part.ratio)
        return Prepared(part, record, buffer, states)

    def _later_rounds(self, prepared: Prepared) -> tuple[list[Payload], list[Any]]:
        """All-reduce and advance every round but the last; the final payloads (counted) and contexts."""
        compressor, record = self.compressor, prepared.record
        payloads, contexts = [p for p, _ in prepared.states], [c for _, c in prepared.states]
        for _ in range(1, compressor.capabilities.rounds):
            record.payload_bytes += sum(compressor.wire_bytes(p) for p in payloads)
            with record.phase("communicate"):
                summed = self._all_reduce(payloads, record)
            with record.phase("compress"):
                advanced = [compressor.next_round(p, c) for p, c in zip(summed, contexts, strict=True)]
            payloads, contexts = [p for p, _ in advanced], [c for _, c in advanced]
        record.payload_bytes += sum(compressor.wire_bytes(p) for p in payloads)
        return payloads, contexts

    def _all_reduce(self, payloads: list[Payload], record: BucketRecord) -> list[Payload]:
        """Sum every tensor of every payload over the group, one all-reduce per dtype, and wait."""
        joined, regroup = join_by_dtype(payloads)
        for tensor in joined:
            traffic = collectives.all_reduce(tensor, "sum", algo=self.algo, group=self.group).traffic
            record.add_traffic(traffic, native=ring_traffic(self.world) * tensor.numel() * tensor.element_size())
        return regroup(joined)

    def _landing(
        self, futures: list[torch.futures.Future[Any]], issued: float, what: str, record: BucketRecord,
        finish: Callable[[], None],
    ) -> Future[None]:  # fmt: skip
        """The part's future while the backend's collectives ``futures`` (``what``, issued at
        ``issued``) are in flight: once they complete, ``finish`` decompresses on the backend's
        completion thread, which issues nothing. It fails with gradcomp's error for the backend's
        (torch's futures would turn it into a RuntimeError)."""
        landed: Future[None] = Future()

        def land(collected: torch.futures.Future[list[torch.futures.Future[Any]]]) -> None:
            try:
                match_torch_threads()  # the backend's thread: decompress with the process's thread count
                try:
                    for future in collected.value():
                        future.value()  # raises the backend's error (``work.wait()`` here would deadlock)
                except RuntimeError as error:
                    raise backend_failure(what, self.rank, self.world, error) from error
                finally:
                    record.add_span("communicate", issued, time.perf_counter())
                finish()
                landed.set_result(None)
            except BaseException as error:  # reaches whoever waits on the bucket
                landed.set_exception(error)

        torch.futures.collect_all(futures).then(land)
        return landed


class SumRoute(_Compressed):
    """``sum`` payloads: all-reduced, every round, and decompressed from the sum. On ``algo=native``
    the final all-reduce is the backend's, left in flight: the part is decompressed on the backend's
    completion thread when the sum lands."""

    def send(self, prepared: Prepared) -> Future[None] | None:
        finals, contexts = self._later_rounds(prepared)
        if self.algo == "native":
            return self._in_flight(finals, contexts, prepared)
        with prepared.record.phase("communicate"):
            summed = self._all_reduce(finals, prepared.record)
        self._decompress(summed, contexts, prepared)
        return None

    def _decompress(self, summed: list[Payload], contexts: list[Any], prepared: Prepared) -> None:
        with prepared.record.phase("decompress"):
            self.compressor.decompress_part(summed, contexts, prepared.buffer, prepared.part.layout)

    def _in_flight(self, finals: list[Payload], contexts: list[Any], prepared: Prepared) -> Future[None]:
        """Issue the backend's all-reduces of ``finals``; the future completes once the part is
        decompressed, or fails with the backend's error."""
        joined, regroup = join_by_dtype(finals)
        for tensor in joined:  # the backend's traffic is not observable: its ring's count
            prepared.record.add_traffic(None, native=ring_traffic(self.world) * tensor.numel() * tensor.element_size())
        issued = time.perf_counter()
        try:
            works = [dist.all_reduce(tensor, group=self.group, async_op=True) for tensor in joined]
        except RuntimeError as error:
            raise backend_failure(_ALL_REDUCE, self.rank, self.world, error) from error
        futures = [w.get_future() for w in works]
        return self._landing(futures, issued, _ALL_REDUCE, prepared.record,
                             lambda: self._decompress(regroup(joined), contexts, prepared))  # fmt: skip


class GatherRoute(_Compressed):
    """``gather`` payloads: every rank's packed and all-gathered, then summed in rank order
    (``decompress_sum``), by the part's :class:`~gradcomp.engine.plan.Transfer`. Padded all-gathers
    learn a capacity per bucket (its keys) from the same gathered frames on every rank, kept in
    :attr:`capacities` (part of the engine's state)."""

    def __init__(self, compressor: Compressor, group: dist.ProcessGroup, algo: str) -> None:
        super().__init__(compressor, group, algo)
        self.capacities: dict[tuple[Key, ...], int] = {}
        """Padded all-gather bytes per bucket (its keys)."""

    def prepare(self, part: Part, buffer: Tensor, record: BucketRecord) -> Prepared:
        """As every route, or for a measured transfer each segment divided, compensated and counted on
        the device, nothing read yet (:meth:`_send_measured` reads every rank's counts at once)."""
        if part.transfer is not Transfer.MEASURED:
            return super().prepare(part, buffer, record)
        with record.phase("compress"):
            measured = self.compressor.measure_part(buffer, part.layout, self.world, ratio=part.ratio)
        return Prepared(part, record, buffer, measured=measured)

    def send(self, prepared: Prepared) -> Future[None] | None:
        transfer = prepared.part.transfer
        if transfer is Transfer.MEASURED:
            self._send_measured(prepared)
            return None
        finals, contexts = self._later_rounds(prepared)
        if transfer is Transfer.IN_FLIGHT:
            return self._in_flight(finals, contexts, prepared)
        with prepared.record.phase("communicate"):
            gathered = self._gather(finals, prepared)
        self._decompress_sum(gathered, contexts, prepared)
        return None

    def _gather(self, payloads: list[Payload], prepared: Prepared) -> list[list[Payload]]:
        """Every rank's payloads, per segment then rank, as the part's transfer says."""
        device, part = _device(payloads), prepared.part
        exchange = transport.GroupTransport(self.group, prepared.record.add_traffic)
        if part.transfer is Transfer.ALIKE:
            per_rank = transport.all_gather_alike(payloads, device, exchange, native=self.algo == "native")
        elif part.transfer is Transfer.PADDED:
            capacity = self.capacities.get(part.keys, 0)
            per_rank, self.capacities[part.keys] = transport.all_gather_padded(payloads, device, exchange, capacity)
        else:
            per_rank = transport.all_gather_payloads(payloads, device, exchange)
        return [list(parts) for parts in zip(*per_rank, strict=True)]

    def _in_flight(self, finals: list[Payload], contexts: list[Any], prepared: Prepared) -> Future[None] | None:
        """Payloads of the same shapes on every rank in the backend's all-gather, left in flight: the
        executor moves on to the next bucket's collectives while this one lands and is summed on the
        backend's completion thread."""
        exchange = transport.GroupTransport(self.group, prepared.record.add_traffic)
        issued = time.perf_counter()  # the landing's "communicate" span counts the packing too
        futures, gathered = transport.all_gather_alike_in_flight(finals, _device(finals), exchange)

        def finish() -> None:
            self._decompress_sum([list(parts) for parts in zip(*gathered(), strict=True)], contexts, prepared)

        if not futures:  # nothing travels
            finish()
            return None
        return self._landing(futures, issued, transport.ALL_GATHER, prepared.record, finish)

    def _send_measured(self, prepared: Prepared) -> None:
        """Every rank's counts in one small all-gather and one host read for the part; then each
        record compressed at its count (``compress_measured_part``), and the payloads gathered at shapes
        every rank knows."""
        compressor, record = self.compressor, prepared.record
        exchange = transport.GroupTransport(self.group, record.add_traffic)
        with record.phase("communicate"):
            counts = torch.stack([measured.count for measured in prepared.measured])
            if self.algo == "native":
                gathered = exchange.all_gather(counts)
            else:
                gathered = exchange.all_gatherv(counts, [counts.numel()] * self.world)
            everyone = host.values(torch.stack(gathered))  # the part's one read
        with record.phase("compress"):
            states = compressor.compress_measured_part(prepared.measured, everyone[self.rank], prepared.part.layout)
        finals, contexts = [p for p, _ in states], [c for _, c in states]
        record.payload_bytes += sum(compressor.wire_bytes(p) for p in finals)
        measured = prepared.measured
        shapes = [[m.shape(compressor.payload_length(c, m)) for c, m in zip(row, measured, strict=True)]
                  for row in everyone]  # fmt: skip
        with record.phase("communicate"):
            per_rank = transport.all_gather_sized(finals, shapes, prepared.buffer.device, exchange)
        self._decompress_sum([list(parts) for parts in zip(*per_rank, strict=True)], contexts, prepared)

    def _decompress_sum(self, gathered: list[list[Payload]], contexts: list[Any], prepared: Prepared) -> None:
        with prepared.record.phase("decompress"):
            self.compressor.decompress_sum_part(gathered, contexts, prepared.buffer, prepared.part.layout)


class TwoPhaseRoute(_Compressed):
    """``gather`` payloads through a compressed reduce-scatter and an all-gather of the compressed
    shards (:mod:`gradcomp.engine.two_phase`): compression and communication interleave there, so
    everything runs on the executor."""

    def prepare(self, part: Part, buffer: Tensor, record: BucketRecord) -> Prepared:
        return Prepared(part, record, buffer)  # compressed on the executor

    def send(self, prepared: Prepared) -> None:
        record, part = prepared.record, prepared.part
        tensors = part.layout.views(prepared.buffer)
        for tensor in tensors:
            tensor.div_(self.world)
        with record.phase("communicate"):
            exchange = transport.GroupTransport(self.group, record.add_traffic)
            record.payload_bytes += two_phase.reduce(self.compressor, tensors, part.keys, exchange, part.ratio)


class DenseRoute(SumRoute):
    """Each tensor's share of an uncompressed sum (``Compressor.dense_share``: error feedback's
    momentum correction and clipping still apply), then the part as the all-reduce hook sends it,
    bitwise. A part of segments that are not consecutive (the per-tensor policy's) travels in a
    buffer kept per part, copied home when it lands."""

    def __init__(self, shares: Compressor, group: dist.ProcessGroup, algo: str, uncompressed: Compressor) -> None:
        super().__init__(uncompressed, group, algo)
        self.shares = shares
        self._scratches: dict[tuple[Key, ...], Tensor] = {}

    def prepare(self, part: Part, buffer: Tensor, record: BucketRecord) -> Prepared:
        homes = part.layout.views(buffer)
        flat = self._flat(part, buffer, homes)
        with record.phase("compress"):
            for tensor, key in zip(views(flat, [s.shape for s in part.segments]), part.keys, strict=True):
                self.shares.dense_share(tensor, self.world, key)
            state = self.compressor.compress(flat)
        return Prepared(part, record, flat, [state], homes=[] if part.contiguous else homes)

    def _flat(self, part: Part, buffer: Tensor, home: list[Tensor]) -> Tensor:
        """The part's elements as one flat tensor: its span of the buffer, or a copy kept per part."""
        if part.contiguous:
            return buffer[part.segments[0].offset : part.segments[-1].stop]
        held = self._scratches.get(part.keys)
        if held is None or held.numel() != part.numel or held.dtype != buffer.dtype or held.device != buffer.device:
            held = self._scratches[part.keys] = torch.empty(part.numel, dtype=buffer.dtype, device=buffer.device)
        torch.cat([t.reshape(-1) for t in home], out=held)
        return held

    def _decompress(self, summed: list[Payload], contexts: list[Any], prepared: Prepared) -> None:
        """The sum of the part's one flat payload into its buffer, and a copy's tensors home."""
        ((payload,), (ctx,)) = (summed, contexts)
        with prepared.record.phase("decompress"):
            self.compressor.decompress(payload, ctx, out=prepared.buffer)
        averaged = views(prepared.buffer, [home.shape for home in prepared.homes])
        for home, tensor in zip(prepared.homes, averaged, strict=True):  # a copy's tensors go home
            home.copy_(tensor)


@dataclasses.dataclass
class _Layout:
    """A part's shard layout: its buffer, the shards' bounds in it, and the pairs of views between
    the part's segments and the layout (made for the bucket buffer they were made from)."""

    buffer: Tensor
    bounds: list[tuple[int, int]]
    pairs: Pairs
    bucket: int
    """The data pointer of the bucket buffer the pairs view."""


class NodesRoute:
    """A part through the node's uncompressed reduce-scatter, its inner part (the spec's route, among
    the local rank j of every node: ``routes``, on that group) on this rank's shard, and the node's
    all-gather (the part's plan: :attr:`gradcomp.engine.plan.Route.NODES`)."""

    issues_only = False

    def __init__(self, routes: Mapping[Route, RouteSteps], intra: dist.ProcessGroup, local: int) -> None:
        self.routes, self.intra, self.local = routes, intra, local
        self.rank = dist.get_rank(intra)
        self._layouts: dict[tuple[Segment, ...], _Layout] = {}

    def prepare(self, part: Part, buffer: Tensor, record: BucketRecord) -> Prepared:
        """In the caller's thread: the part's segments, divided by L, into its shard layout."""
        held = self._layout(part, buffer)
        with record.phase("compress"):
            scatter(held.pairs, self.local)
        return Prepared(part, record, held.buffer)

    def send(self, prepared: Prepared) -> Future[None] | None:
        part, record, layout = prepared.part, prepared.record, prepared.buffer
        assert part.inner is not None, "a part across nodes names the part of its shard"
        held = self._layouts[part.segments]
        link = Link(self.intra)
        with record.phase("communicate"):
            ring.reduce_scatter(link, layout, ReduceOp.SUM, held.bounds)
        start, stop = held.bounds[self.rank]
        route = self.routes[part.inner.route]
        landed = route.send(route.prepare(part.inner, layout[start:stop], record))
        if landed is not None:
            landed.result()  # the all-gather below is issued here, on the executor, in order
        with record.phase("communicate"):
            ring.all_gather(link, layout, held.bounds)
        record.add_traffic(link.traffic)
        record.intra_node_bytes = (record.intra_node_bytes or 0.0) + link.traffic.sent
        with record.phase("decompress"):
            gather(held.pairs)
        return None

    def _layout(self, part: Part, buffer: Tensor) -> _Layout:
        """The part's layout, made at its first step and kept per part (DDP waits for every bucket
        before the next backward, so the layout is free when the next step needs it); its views of
        the bucket made again when DDP hands over a new bucket buffer."""
        held = self._layouts.get(part.segments)
        if held is None or held.buffer.dtype != buffer.dtype or held.buffer.device != buffer.device:
            layout = torch.empty(part.numel, dtype=buffer.dtype, device=buffer.device)
            bounds = chunk_bounds(part.numel, self.local) if part.keys[0] is None else NodeShards(
                tuple(s.shape for s in part.segments), self.local).bounds  # fmt: skip
            held = self._layouts[part.segments] = _Layout(layout, bounds, [], -1)
        if held.bucket != buffer.data_ptr():
            held.pairs, held.bucket = self._pairs(part, buffer, held.buffer), buffer.data_ptr()
        return held

    def _pairs(self, part: Part, buffer: Tensor, layout: Tensor) -> Pairs:
        tensors = part.layout.views(buffer)
        if part.keys[0] is not None:
            return NodeShards(tuple(s.shape for s in part.segments), self.local).pairs(tensors, layout)
        return list(zip(tensors, views(layout, [(s.numel,) for s in part.segments]), strict=True))


def join_by_dtype(payloads: list[Payload]) -> tuple[list[Tensor], Callable[[list[Tensor]], list[Payload]]]:
    """The payloads' tensors concatenated into one flat tensor per dtype (one all-reduce each; a
    lone contiguous tensor is used as it is), and the function that cuts the summed tensors back
    into payloads shaped like ``payloads``."""
    tensors = [t for payload in payloads for t in payload]
    dtypes = dict.fromkeys(t.dtype for t in tensors)
    groups = [[i for i, t in enumerate(tensors) if t.dtype == dtype] for dtype in dtypes]
    joined = [
        tensors[members[0]].view(-1)
        if len(members) == 1 and tensors[members[0]].is_contiguous()
        else torch.cat([tensors[i].reshape(-1) for i in members])
        for members in groups
    ]

    def regroup(summed: list[Tensor]) -> list[Payload]:
        pieces: dict[int, Tensor] = {}
        for members, flat in zip(groups, summed, strict=True):
            pieces.update(zip(members, views(flat, [tensors[i].shape for i in members]), strict=True))
        return transport.regroup(payloads, [pieces[i] for i in range(len(tensors))])

    return joined, regroup


def _device(payloads: list[Payload]) -> torch.device:
    return payloads[0][0].device if payloads and payloads[0] else torch.device("cpu")


_ALL_REDUCE = "the backend's all-reduce of a bucket"
