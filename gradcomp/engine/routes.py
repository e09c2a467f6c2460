"""A bucket's ways to the wire. Every route takes the same two steps:

- ``prepare(work)``, in the caller's thread (DDP's backward): divide by the world size and compress
  round one, so that the next bucket's compression overlaps this bucket's communication;
- ``send(work)``, on the ordered executor: every further round, the collective, the decompression
  into the bucket. It returns None once the bucket holds its average, or a future that completes
  when it does: a final all-reduce on the backend is left in flight, and the executor moves on to the
  next bucket's collectives (rule "one ordered path" is about *issuing* collectives in order;
  finishing one issues nothing).

=====================  ===========================================================================
:class:`SumRoute`      ``sum`` payloads (casts, random-k, PowerSGD, ``allreduce``): all-reduced per
                       dtype with the spec's algorithm, every round, then decompressed from the sum
:class:`GatherRoute`   the other payloads: packed and all-gathered, summed in rank order (on
                       ``algo=native``, payloads of the same shapes on every rank in flight)
:class:`TwoPhaseRoute` a compressed reduce-scatter, then an all-gather (``two_phase.py``)
:class:`DenseRoute`    a warm-up step: each tensor's share of an uncompressed all-reduce
=====================  ===========================================================================

The engine (:mod:`gradcomp.engine.pipeline`) builds the spec's route once (``HookSpec.route``) and
takes :class:`DenseRoute` for the warm-up's uncompressed steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives, host
from gradcomp.collectives.cost_model import ring_traffic
from gradcomp.collectives.executor import match_torch_threads
from gradcomp.compressors import Aggregation, Compressor, Key, Measured, Payload
from gradcomp.compressors.capabilities import ratio_option
from gradcomp.engine import transport, two_phase
from gradcomp.engine.stats import BucketRecord
from gradcomp.errors import backend_failure
from gradcomp.flat import views


@dataclasses.dataclass
class BucketWork:
    """One bucket on its way: the buffer, its tensors, what compression made of them, its record."""

    buffer: Tensor
    """Flat and contiguous; it receives the average."""
    keys: list[Key]
    """Each tensor's stable identity (empty when the bucket travels whole)."""
    shapes: list[torch.Size]
    record: BucketRecord
    ratio: float | None = None
    """The warm-up's keep-ratio for a ratio-based sparsifier (None: the compressor's own)."""
    settled: bool = True
    """Past the warm-up: payloads have the size they keep (the padded all-gather may learn from them)."""
    parts: list[Tensor] = dataclasses.field(default_factory=list)
    """The views of :attr:`buffer` that compression read and decompression writes (given beforehand
    when the per-tensor policy leaves some of the buffer's tensors to another route)."""
    states: list[tuple[Payload, Any]] = dataclasses.field(default_factory=list)
    """Per part, the payload of the current round and the local context."""
    measured: list[Measured] = dataclasses.field(default_factory=list)
    """Per part, what measuring it on the device found (``Capabilities.measures``, on an accelerator):
    its payload's size and what compression takes then. Compression waits for :meth:`GatherRoute.send`,
    which reads every rank's counts at once and hands each part's record back to the compressor."""
    landing: list[Tensor] = dataclasses.field(default_factory=list)
    """Where the averaged tensors go once they land, when :attr:`buffer` is a copy of them (the
    per-tensor policy's uncompressed tensors); empty when the buffer is their home."""


class RouteSteps(Protocol):
    """A way for a bucket's payloads to travel (the module's docstring)."""

    issues_only: bool
    """Whether :meth:`send` only issues the backend's asynchronous all-reduce: it may then run in the
    caller's thread when the executor is idle, as torch's own hooks issue theirs."""

    def prepare(self, work: BucketWork) -> None:
        """In the caller's thread: divide, compress round one (into ``work.parts``, ``work.states``)."""

    def send(self, work: BucketWork) -> Future[None] | None:
        """On the executor: communicate and decompress; a future when the bucket lands later."""


class _Compressed:
    """What the routes of a compressor share: the group, the algorithm, and the rounds' all-reduces."""

    def __init__(self, compressor: Compressor, group: dist.ProcessGroup, algo: str) -> None:
        self.compressor, self.group, self.algo = compressor, group, algo
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        declared = compressor.capabilities
        self.issues_only = algo == "native" and declared.rounds == 1 and declared.aggregation is Aggregation.SUM

    def prepare(self, work: BucketWork) -> None:
        """Split into the bucket's tensors and compress each divided by the world size (round one;
        compressors that can fold the division into their first pass do)."""
        options = ratio_option(work.ratio)  # a warm-up's keep-ratio, for a ratio-based compressor
        with work.record.phase("compress"):
            split = self._split(work)
            work.states = [self.compressor.compress_divided(part, self.world, key, **options) for part, key in split]

    def _split(self, work: BucketWork) -> list[tuple[Tensor, Key]]:
        """The parts compression reads, with their keys (setting ``work.parts`` the first time):
        element-wise, stateless compressors (the casts) take the bucket whole, into one payload (or
        the parts the per-tensor policy left them), keyless; the others each tensor, keyed."""
        if self.compressor.capabilities.elementwise:
            work.parts = work.parts or [work.buffer]
            return [(part, None) for part in work.parts]
        work.parts = work.parts or views(work.buffer, work.shapes)
        return list(zip(work.parts, work.keys, strict=True))

    def _later_rounds(self, work: BucketWork) -> list[Payload]:
        """All-reduce and advance every round but the last; the final payloads, counted."""
        compressor, record = self.compressor, work.record
        for _ in range(1, compressor.capabilities.rounds):
            record.payload_bytes += sum(compressor.wire_bytes(p) for p, _ in work.states)
            with record.phase("communicate"):
                summed = self._all_reduce([payload for payload, _ in work.states], record)
            with record.phase("compress"):
                work.states = [compressor.next_round(p, ctx) for p, (_, ctx) in zip(summed, work.states, strict=True)]
        finals = [payload for payload, _ in work.states]
        record.payload_bytes += sum(compressor.wire_bytes(p) for p in finals)
        return finals

    def _all_reduce(self, payloads: list[Payload], record: BucketRecord) -> list[Payload]:
        """Sum every tensor of every payload over the group, one all-reduce per dtype, and wait."""
        joined, regroup = join_by_dtype(payloads)
        for tensor in joined:
            traffic = collectives.all_reduce(tensor, "sum", algo=self.algo, group=self.group).traffic
            record.add_traffic(traffic, native=ring_traffic(self.world) * tensor.numel() * tensor.element_size())
        return regroup(joined)


    def _landing(
        self,
        futures: list[torch.futures.Future[Any]],
        issued: float,
        what: str,
        work: BucketWork,
        finish: Callable[[], None],
    ) -> Future[None]:
        """The bucket's future while the backend's collectives ``futures`` (``what``, issued at
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
                    work.record.add_span("communicate", issued, time.perf_counter())
                finish()
                landed.set_result(None)
            except BaseException as error:  # reaches whoever waits on the bucket
                landed.set_exception(error)

        torch.futures.collect_all(futures).then(land)
        return landed


class SumRoute(_Compressed):
    """``sum`` payloads: all-reduced, every round, and decompressed from the sum. On ``algo=native``
    the final all-reduce is the backend's, left in flight: the bucket is decompressed on the
    backend's completion thread when the sum lands."""

    def send(self, work: BucketWork) -> Future[None] | None:
        finals = self._later_rounds(work)
        if self.algo == "native":
            return self._in_flight(finals, work)
        with work.record.phase("communicate"):
            summed = self._all_reduce(finals, work.record)
        self._decompress(summed, work)
        return None

    def _decompress(self, summed: list[Payload], work: BucketWork) -> None:
        with work.record.phase("decompress"):
            for payload, (_, ctx), part in zip(summed, work.states, work.parts, strict=True):
                self.compressor.decompress(payload, ctx, out=part)

    def _in_flight(self, finals: list[Payload], work: BucketWork) -> Future[None]:
        """Issue the backend's all-reduces of ``finals``; the future completes once the bucket is
        decompressed, or fails with the backend's error (gradcomp's own: torch's futures would
        turn it into a RuntimeError)."""
        joined, regroup = join_by_dtype(finals)
        for tensor in joined:  # the backend's traffic is not observable: its ring's count
            work.record.add_traffic(None, native=ring_traffic(self.world) * tensor.numel() * tensor.element_size())
        issued = time.perf_counter()
        try:
            works = [dist.all_reduce(tensor, group=self.group, async_op=True) for tensor in joined]
        except RuntimeError as error:
            raise backend_failure(_ALL_REDUCE, self.rank, self.world, error) from error
        return self._landing(
            [w.get_future() for w in works], issued, _ALL_REDUCE, work, lambda: self._decompress(regroup(joined), work)
        )


class GatherRoute(_Compressed):
    """``gather`` payloads: every rank's packed and all-gathered, then summed in rank order
    (``decompress_sum``). On ``algo=native`` in one of the backend's own all-gathers, padded to a
    capacity per bucket that every rank learns from the same gathered frames (kept in
    :attr:`capacities`, part of the engine's state); otherwise, and during a warm-up, gradcomp's
    point-to-point all-gather, sizes first. Where every rank's payloads have the same shapes
    (``Capabilities.same_shapes``), unpadded and with no sizes, on either; on the backend's, left in
    flight and summed on its completion thread, as :class:`SumRoute`'s final all-reduce."""

    def __init__(self, compressor: Compressor, group: dist.ProcessGroup, algo: str) -> None:
        super().__init__(compressor, group, algo)
        self.capacities: dict[tuple[Key, ...], int] = {}
        """Padded all-gather bytes per bucket (its keys)."""

    def prepare(self, work: BucketWork) -> None:
        """As every route, or for payloads whose size depends on the values, on an accelerator, past
        the warm-up: each tensor divided, compensated and counted on the device, nothing read yet."""
        if not (self.compressor.capabilities.measures and work.settled) or host.reads_are_free(work.buffer.device):
            super().prepare(work)
            return
        options = ratio_option(work.ratio)
        with work.record.phase("compress"):
            split = self._split(work)
            work.measured = [self.compressor.measure_divided(part, self.world, key, **options) for part, key in split]

    def send(self, work: BucketWork) -> Future[None] | None:
        if work.measured:
            self._send_measured(work)
            return None
        finals = self._later_rounds(work)
        if self.algo == "native" and work.settled and self.compressor.capabilities.same_shapes:
            return self._in_flight(finals, work)
        with work.record.phase("communicate"):
            gathered = self._gather(finals, work)
        self._decompress_sum(gathered, work)
        return None

    def _in_flight(self, finals: list[Payload], work: BucketWork) -> Future[None] | None:
        """Payloads of the same shapes on every rank in the backend's all-gather, left in flight: the
        executor moves on to the next bucket's collectives while this one lands and is summed on the
        backend's completion thread (the gathered path, minus the wait)."""
        exchange = transport.GroupTransport(self.group, work.record.add_traffic)
        issued = time.perf_counter()  # the landing's "communicate" span counts the packing too
        futures, gathered = transport.all_gather_alike_in_flight(finals, _device(finals), exchange)

        def finish() -> None:
            self._decompress_sum([list(parts) for parts in zip(*gathered(), strict=True)], work)

        if not futures:  # nothing travels
            finish()
            return None
        return self._landing(futures, issued, transport.ALL_GATHER, work, finish)

    def _send_measured(self, work: BucketWork) -> None:
        """Every rank's counts in one small all-gather and one host read for the bucket; then each
        tensor compressed at its size, and the payloads gathered at sizes every rank knows."""
        compressor, record = self.compressor, work.record
        device = work.buffer.device
        exchange = transport.GroupTransport(self.group, record.add_traffic)
        with record.phase("communicate"):
            counts = torch.stack([measured.count for measured in work.measured])
            if self.algo == "native":
                gathered = exchange.all_gather(counts)
            else:
                gathered = exchange.all_gatherv(counts, [counts.numel()] * self.world)
            everyone = host.values(torch.stack(gathered))  # the bucket's one read
        keys = [key for _, key in self._split(work)]
        with record.phase("compress"):
            counted = zip(work.measured, keys, everyone[self.rank], strict=True)
            work.states = [compressor.compress_measured(measured, count, key) for measured, key, count in counted]
        finals = [payload for payload, _ in work.states]
        record.payload_bytes += sum(compressor.wire_bytes(p) for p in finals)
        measured = work.measured
        lengths = [[compressor.payload_length(c, m) for c, m in zip(row, measured, strict=True)] for row in everyone]
        with record.phase("communicate"):
            per_rank = transport.all_gather_sized(finals, lengths, device, exchange)
        self._decompress_sum([list(parts) for parts in zip(*per_rank, strict=True)], work)

    def _decompress_sum(self, gathered: list[list[Payload]], work: BucketWork) -> None:
        with work.record.phase("decompress"):
            for everyone, (_, ctx), part in zip(gathered, work.states, work.parts, strict=True):
                self.compressor.decompress_sum(everyone, ctx, out=part)

    def _gather(self, payloads: list[Payload], work: BucketWork) -> list[list[Payload]]:
        """Every rank's payloads, per tensor then rank."""
        device = _device(payloads)
        exchange = transport.GroupTransport(self.group, work.record.add_traffic)
        if work.settled and self.compressor.capabilities.same_shapes:
            per_rank = transport.all_gather_alike(payloads, device, exchange, native=self.algo == "native")
        elif self.algo == "native" and work.settled:
            bucket = tuple(work.keys)
            capacity = self.capacities.get(bucket, 0)
            per_rank, self.capacities[bucket] = transport.all_gather_padded(payloads, device, exchange, capacity)
        else:
            per_rank = transport.all_gather_payloads(payloads, device, exchange)
        return [list(parts) for parts in zip(*per_rank, strict=True)]


class TwoPhaseRoute(_Compressed):
    """``gather`` payloads through a compressed reduce-scatter and an all-gather of the compressed
    shards (:mod:`gradcomp.engine.two_phase`): compression and communication interleave there, so
    everything runs on the executor (at the warm-up's ratio there too)."""

    def prepare(self, work: BucketWork) -> None:
        pass  # compressed on the executor, where the shards are known

    def send(self, work: BucketWork) -> None:
        parts = work.parts or views(work.buffer, work.shapes)
        for part in parts:
            part.div_(self.world)
        with work.record.phase("communicate"):
            exchange = transport.GroupTransport(self.group, work.record.add_traffic)
            work.record.payload_bytes += two_phase.reduce(self.compressor, parts, work.keys, exchange, work.ratio)


class DenseRoute(SumRoute):
    """A warm-up step: each tensor's share of an uncompressed sum (``Compressor.dense_share``: error
    feedback's momentum correction and clipping still apply), then the bucket as the all-reduce
    hook sends it, bitwise."""

    def __init__(self, compressor: Compressor, group: dist.ProcessGroup, algo: str, uncompressed: Compressor) -> None:
        super().__init__(uncompressed, group, algo)
        self.shares = compressor

    def prepare(self, work: BucketWork) -> None:
        with work.record.phase("compress"):
            if self.shares.capabilities.elementwise:
                work.buffer.div_(self.world)
            else:
                for part, key in zip(views(work.buffer, work.shapes), work.keys, strict=True):
                    self.shares.dense_share(part, self.world, key)
            work.parts = [work.buffer]
            work.states = [self.compressor.compress(work.buffer)]


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
