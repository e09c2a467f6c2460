"""The per-bucket pipeline: (error feedback) -> compress -> communicate -> decompress -> average.

One :class:`Engine` per process group and compressor spec. ``reduce(buffer, keys, shapes)``
averages a bucket (the concatenation of several tensors) over the group in place, asynchronously,
on the collectives' ordered executor, so every round of every bucket runs in the same order on
every rank and nothing communicates from a backend's callback thread (rule "one ordered path",
``docs/architecture.md``).

- **Each tensor is compressed on its own**, with its own key: its state (error-feedback residual,
  PowerSGD memory, random streams) follows the tensor, not the bucket, so results do not depend on
  how DDP groups tensors into buckets, which changes after DDP's first iteration and again when a
  run resumes (rule "state per tensor"), and top-k or quantization act per layer. Stateless
  element-by-element compressors (the casts) compress the whole bucket into one payload.
- **Communication is per bucket**: ``sum`` payloads of all the bucket's tensors are concatenated by
  dtype and all-reduced at once (``algo``: native or any gradcomp algorithm; every round of a
  multi-round compressor); ``gather`` payloads are packed into one byte buffer, with a header of
  their shapes, and all-gathered (on ``algo=native`` in one of the backend's all-gathers, padded to
  a capacity learned per bucket: :func:`gradcomp.engine.transport.all_gather_padded`), then
  ``decompress_sum`` adds every rank's contribution in rank order.
- The bucket is divided by the world size *before* compression, so that low-precision sums cannot
  overflow (rule "divide before sum") and the average is taken exactly once
  (``Compressor.compress_divided``, which error feedback fuses with its add).
- Compression runs in the caller's thread (DDP's backward), communication on the executor, so one
  bucket's compression overlaps the previous one's communication. A final round on the backend's
  all-reduce is issued and left in flight: the executor moves on to the next bucket's collectives,
  and the decompression runs on the backend's completion thread when the sum lands (it issues
  nothing, so the order of collectives stays the same on every rank). A single-round one is issued
  in the caller's thread when nothing is queued, as torch's own hooks issue theirs; an uncompressed
  bucket then goes straight to the backend's asynchronous all-reduce.
- The first call checks that every rank uses the same spec, and fails with every rank's spec named.
- A warm-up (``HookSpec.warmup``) sends the first steps uncompressed, as the all-reduce hook does
  (error feedback's momentum correction and clipping still apply: :meth:`Compressor.dense_share`),
  or, for ratio-based sparsifiers, compressed at a ratio that falls exponentially to theirs (and
  uncompressed while that ratio would cost as many bytes: ``Compressor.dense_from``). Steps
  are counted where buckets are compressed, and the count is part of :meth:`Engine.state_dict`.
- The engine communicates on gradcomp's own process group, with the same ranks (one per parent group
  and timeout, shared by every engine), so that DDP's own collectives never interleave with it.
"""

from __future__ import annotations

import collections
import datetime
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives
from gradcomp.collectives.cost_model import ring_traffic
from gradcomp.collectives.executor import Handle, executor, match_torch_threads
from gradcomp.collectives.groups import private
from gradcomp.collectives.link import Traffic
from gradcomp.compressors import Aggregation, Compressor, Key, Payload, make_compressor
from gradcomp.engine import transport, two_phase
from gradcomp.engine.spec import HookSpec, HookSpecLike, warmup_ratio
from gradcomp.engine.stats import BucketRecord
from gradcomp.errors import PeerError, SpecMismatchError, backend_failure


class Engine:
    """Averages buckets of tensors over a process group through one compressor.

    Create engines on every rank in the same order: the first one of a process creates gradcomp's
    process group for ``group`` (:func:`gradcomp.collectives.groups.private`).

    Args:
        spec: a hook spec (:class:`~gradcomp.engine.spec.HookSpec` or its text, e.g.
            ``"topk:ratio=0.01,ef=true,algo=ring"``): the compressor, the all-reduce algorithm for
            ``sum`` payloads, how ``gather`` payloads travel (``aggregation``: all-gathered, or
            two-phase, :mod:`gradcomp.engine.two_phase`; ``auto``: two-phase from
            ``TWO_PHASE_FROM`` ranks on) and the seed of the compressor's generators.
        group: the ranks to average over (default: the world).
        timeout: what any of the engine's collectives may take before it fails (a frozen or failed
            peer); default: ``group``'s own timeout (what ``init_process_group`` was given).
        history: how many bucket records (:mod:`gradcomp.engine.stats`) to keep, the latest.
    """

    def __init__(
        self,
        spec: HookSpecLike,
        *,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
        history: int = 10_000,
    ) -> None:
        self.spec = HookSpec.parse(spec)  # before touching any process group: a bad spec fails first
        if self.spec.compressor is None:
            raise ValueError("noop sends nothing: it needs no engine (gradcomp.hooks.make handles it)")
        self.algo = self.spec.algo
        self.world = dist.get_world_size(group)
        self.compressor: Compressor = make_compressor(
            self.spec.compressor, seed=self.spec.seed, rank=dist.get_rank(group)
        )
        aggregation = self.spec.aggregation
        ef21 = self.spec.compressor.feedback.variant == "ef21"  # adds each aggregate to its estimate: once
        self.two_phase = self.compressor.aggregation is Aggregation.GATHER and (
            aggregation == "two_phase" or (aggregation == "auto" and self.world >= TWO_PHASE_FROM and not ef21)
        )
        # gradcomp's own group (same ranks, shared by its engines): DDP issues collectives of its
        # own from the training thread (find_unused_parameters' bitmap, static_graph's checks); on
        # DDP's group they would interleave with the engine's differently on each rank (gloo aborts
        # with "Received data size doesn't match expected size").
        self.group = private(group, timeout)
        self._checked = False
        self._rank = dist.get_rank(self.group)
        self._capacities: dict[tuple[Key, ...], int] = {}  # padded all-gather bytes per bucket
        self._issues_only = (
            self.algo == "native" and self.compressor.rounds == 1 and self.compressor.aggregation is Aggregation.SUM
        )
        self.step = 0
        self.records: collections.deque[BucketRecord] = collections.deque(maxlen=history)
        self.steps_prepared = 0
        """Steps whose buckets were compressed (counted in the caller's thread): the warm-up's clock."""
        self._uncompressed = make_compressor("none")

    def reduce(
        self,
        buffer: Tensor,
        keys: Sequence[Key] | None,
        shapes: Sequence[torch.Size] | None,
        bucket: int = 0,
        last: bool = True,
    ) -> Handle[Tensor]:
        """Replace ``buffer`` by its average over the group, compressed; returns at once.

        ``buffer`` is flat and contiguous and concatenates tensors of ``shapes``; ``keys`` identify
        them across steps (their state is kept per key). Both may be None when :attr:`per_tensor`
        is False. ``bucket`` numbers the buffer within the step and ``last`` ends the step, for
        :attr:`records`.
        """
        if not buffer.is_floating_point():
            raise TypeError(f"gradients must be floating-point, got {buffer.dtype}")
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("the engine reduces flat, contiguous buffers (a DDP bucket's)")
        record = BucketRecord(0, bucket, buffer.numel() * buffer.element_size(), time.perf_counter())
        if not self.per_tensor:  # the bucket travels whole: its tensors are not needed
            keys, shapes = [], []
        elif keys is None or shapes is None:
            raise ValueError(f"{self.spec} needs the keys and shapes of the bucket's tensors")
        elif len(keys) != len(shapes) or sum(math.prod(s) for s in shapes) != buffer.numel():
            raise ValueError(
                f"{len(keys)} keys and shapes holding {sum(math.prod(s) for s in shapes)} elements "
                f"do not describe a buffer of {buffer.numel()}"
            )
        # Divide and compress here, in the caller's thread (DDP's backward), and leave only the
        # communication and what follows it to the ordered executor: the next bucket's compression
        # then overlaps this bucket's communication instead of queueing behind it.
        keys, shapes = list(keys), list(shapes)
        dense, ratio = self._warmup(self.steps_prepared)
        # The padded all-gather keeps the largest frame it saw: learning it from the warm-up's
        # shrinking payloads would pad every later step to them. Warm-up steps send exact sizes.
        padded = self.steps_prepared >= self.spec.warmup
        compressor = self._uncompressed if dense else self.compressor
        if dense:
            prepared = self._prepare_dense(buffer, keys, shapes, record)
        elif self.two_phase:
            prepared = None  # compressed on the executor: the ratio is set there
        else:
            self._set_ratio(ratio)
            prepared = self._prepare(buffer, keys, shapes, record)
        self.steps_prepared += int(last)
        done: Future[tuple[Tensor, Traffic | None]] = Future()

        def complete(finish: Callable[[], None] | None = None) -> None:
            """Run what is left (decompression), close the record and hand the bucket back."""
            try:
                if finish is not None:
                    finish()
                record.finished = time.perf_counter()
                self.records.append(record)
                done.set_result((buffer, None))
            except BaseException as error:  # reaches whoever waits on the handle
                done.set_exception(error)

        def operation() -> tuple[None, None]:
            try:
                record.step = self.step
                record.started = time.perf_counter()
                self.step += int(last)
                if not self._checked:
                    check_same_spec(str(self.spec), self.group, buffer.device)
                    self._checked = True
                if prepared is None:
                    self._set_ratio(ratio)
                    self._reduce_two_phase(buffer, keys, shapes, record)
                    complete()
                else:
                    self._finish(compressor, buffer, *prepared, record, complete, tuple(keys), padded)
            except BaseException as error:
                done.set_exception(error)
            return None, None

        # An operation that only issues the backend's asynchronous all-reduce runs in this thread
        # when the executor is idle (in order all the same), as torch's own hooks issue theirs.
        brief = self._issues_only or (dense and self.algo == "native")
        executor().submit(operation, brief=self._checked and brief)
        return Handle(done)

    def state_dict(self) -> dict[str, Any]:
        """What the engine learned about its transfers, the padded all-gather's capacity per bucket,
        and the steps it compressed (the warm-up's clock), as plain values. Saved with the
        compressor's state, a resumed run sends exactly what the run straight through sends, without
        re-learning the capacities, and continues a warm-up where it stopped."""
        capacities = [{"keys": list(keys), "bytes": size} for keys, size in self._capacities.items()]
        return {"capacities": capacities, "steps": self.steps_prepared}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._capacities = {tuple(entry["keys"]): int(entry["bytes"]) for entry in state["capacities"]}
        self.steps_prepared = int(state.get("steps", 0))  # states saved before warm-ups counted none

    @property
    def per_tensor(self) -> bool:
        """Whether :meth:`reduce` needs the bucket's keys and shapes: not for an element-wise,
        stateless compressor (``allreduce``, the casts), which compresses the bucket whole, so that
        a hook need not list its parameters."""
        return not self.compressor.elementwise

    def _warmup(self, step: int) -> tuple[bool, float | None]:
        """Whether ``step`` goes uncompressed, and the keep-ratio to set for a ratio-based sparsifier
        (None: nothing to change)."""
        warmup, codec = self.spec.warmup, self.compressor.codec
        ratio = None
        if codec.ratio_based and warmup and step <= warmup:
            ratio = warmup_ratio(self.spec.compressor.config.ratio, warmup, step)  # type: ignore[union-attr]
        return step < warmup and (ratio is None or ratio >= codec.dense_from), ratio

    def _set_ratio(self, ratio: float | None) -> None:
        """The warm-up's keep-ratio for a ratio-based sparsifier (None: nothing to change)."""
        if ratio is not None:
            self.compressor.codec.ratio = ratio  # type: ignore[attr-defined]

    def _prepare_dense(
        self, buffer: Tensor, keys: list[Key], shapes: list[torch.Size], record: BucketRecord
    ) -> tuple[list[Tensor], list[tuple[Payload, Any]]]:
        """A warm-up step: each tensor's share of the sum (momentum correction and clipping of error
        feedback included), then the bucket as the all-reduce hook sends it."""
        with record.phase("compress"):
            if self.per_tensor:
                for part, key in zip(_views(buffer, shapes), keys, strict=True):
                    self.compressor.dense_share(part, self.world, key)
            else:
                buffer.div_(self.world)
            return [buffer], [self._uncompressed.compress(buffer)]

    def _prepare(
        self, buffer: Tensor, keys: list[Key], shapes: list[torch.Size], record: BucketRecord
    ) -> tuple[list[Tensor], list[tuple[Payload, Any]]]:
        """Split into the bucket's tensors and compress each divided by the world size (round one)."""
        with record.phase("compress"):
            if self.compressor.elementwise:  # stateless, element by element: one payload for the bucket
                return [buffer], [self.compressor.compress_divided(buffer, self.world)]
            parts = _views(buffer, shapes)
            # compress(part / world): compressors that can fold the division into their first pass do
            compress = self.compressor.compress_divided
            return parts, [compress(part, self.world, key) for part, key in zip(parts, keys, strict=True)]

    def _finish(
        self,
        compressor: Compressor,
        buffer: Tensor,
        parts: list[Tensor],
        states: list[tuple[Payload, Any]],
        record: BucketRecord,
        complete: Callable[[Callable[[], None] | None], None],
        bucket: tuple[Key, ...],
        padded: bool = True,
    ) -> None:
        """Communicate every round, then decompress into the bucket (on the executor), and call
        ``complete``. A final round on the backend's own all-reduce is left in flight: the executor
        moves on to the next bucket's collectives while the backend moves this one, and
        ``complete(decompress)`` runs on the backend's thread when it lands."""
        for _ in range(1, compressor.rounds):
            record.payload_bytes += sum(compressor.wire_bytes(p) for p, _ in states)
            with record.phase("communicate"):
                summed = self._sum([payload for payload, _ in states], record)
            with record.phase("compress"):
                states = [compressor.next_round(p, ctx) for p, (_, ctx) in zip(summed, states, strict=True)]
        finals = [payload for payload, _ in states]
        record.payload_bytes += sum(compressor.wire_bytes(p) for p in finals)
        if compressor.aggregation is Aggregation.SUM:

            def decompress(summed: list[Payload]) -> None:
                with record.phase("decompress"):
                    for payload, (_, ctx), part in zip(summed, states, parts, strict=True):
                        compressor.decompress(payload, ctx, out=part)

            self._sum_last(finals, record, complete, decompress)
            return
        with record.phase("communicate"):
            gathered = self._gather(finals, record, bucket, padded)
        with record.phase("decompress"):
            for everyone, (_, ctx), part in zip(gathered, states, parts, strict=True):
                compressor.decompress_sum(everyone, ctx, out=part)
        complete(None)

    def _sum_last(
        self,
        payloads: list[Payload],
        record: BucketRecord,
        complete: Callable[[Callable[[], None] | None], None],
        then: Callable[[list[Payload]], None],
    ) -> None:
        """The final round's sum, then ``then(summed)`` and ``complete``: at once with gradcomp's
        algorithms, or, on the backend's all-reduce, from its completion callback (the executor
        does not wait for it: rule "one ordered path" only needs collectives *issued* in order)."""
        if self.algo != "native":
            with record.phase("communicate"):
                summed = self._sum(payloads, record)
            then(summed)
            complete(None)
            return
        joined, regroup = _join_by_dtype(payloads)
        for tensor in joined:  # the backend's traffic is not observable: its ring's count
            record.add_traffic(None, native=ring_traffic(self.world) * tensor.numel() * tensor.element_size())
        issued = time.perf_counter()
        try:
            works = [dist.all_reduce(tensor, group=self.group, async_op=True) for tensor in joined]
        except RuntimeError as error:
            raise backend_failure("the backend's all-reduce of a bucket", self._rank, self.world, error) from error

        def landed(collected: torch.futures.Future[list[torch.futures.Future[Any]]]) -> None:
            def finish() -> None:
                match_torch_threads()  # the backend's thread: decompress with the process's thread count
                try:
                    for future in collected.value():
                        future.value()  # raises the backend's error (``work.wait()`` here would deadlock)
                except RuntimeError as error:
                    raise backend_failure(
                        "the backend's all-reduce of a bucket", self._rank, self.world, error
                    ) from error
                finally:
                    now = time.perf_counter()
                    record.communicate_s += now - issued
                    record.spans.append(("communicate", issued, now))
                then(regroup(joined))

            complete(finish)

        torch.futures.collect_all([work.get_future() for work in works]).then(landed)

    def _reduce_two_phase(
        self, buffer: Tensor, keys: list[Key], shapes: list[torch.Size], record: BucketRecord
    ) -> None:
        buffer.div_(self.world)
        with record.phase("communicate"):  # compression and communication interleave here
            exchange = transport.GroupExchange(self.group, record.add_traffic)
            record.payload_bytes = two_phase.reduce(self.compressor, _views(buffer, shapes), keys, exchange)

    def _sum(self, payloads: list[Payload], record: BucketRecord) -> list[Payload]:
        """All-reduce (sum) every tensor of every payload, one all-reduce per dtype, and wait."""
        joined, regroup = _join_by_dtype(payloads)
        for tensor in joined:
            traffic = collectives.all_reduce(tensor, "sum", algo=self.algo, group=self.group).traffic
            record.add_traffic(traffic, native=ring_traffic(self.world) * tensor.numel() * tensor.element_size())
        return regroup(joined)

    def _gather(
        self, payloads: list[Payload], record: BucketRecord, bucket: tuple[Key, ...], padded: bool = True
    ) -> list[list[Payload]]:
        """Every rank's payloads, per tensor then rank. On ``algo=native`` one of the backend's own
        all-gathers, padded to the bucket's capacity (kept per bucket: the same on every rank, as
        every rank derives it from the same gathered frames); otherwise (and while ``padded`` is
        False: a warm-up) gradcomp's point-to-point all-gather, sizes first."""
        device = payloads[0][0].device if payloads and payloads[0] else torch.device("cpu")
        exchange = transport.GroupExchange(self.group, record.add_traffic)
        if self.algo == "native" and padded:
            capacity = self._capacities.get(bucket, 0)
            per_rank, self._capacities[bucket] = transport.all_gather_padded(payloads, device, exchange, capacity)
        else:
            per_rank = transport.all_gather_payloads(payloads, device, exchange)
        return [list(parts) for parts in zip(*per_rank, strict=True)]


def check_same_spec(spec: str, group: dist.ProcessGroup, device: torch.device) -> None:
    """Every rank of ``group`` was given the hook spec ``spec`` (its canonical text), or a
    :class:`SpecMismatchError` naming every rank's; a rank that never comes is a :class:`PeerError`."""
    mine = torch.tensor(list(spec.encode()), dtype=torch.uint8, device=device)
    try:
        specs = [bytes(p.tolist()).decode() for p in collectives.all_gatherv(mine, group=group).wait()]
    except PeerError as error:
        raise PeerError(
            f"the ranks did not all reach the first step's check of the hook spec ({spec}): a rank with "
            "another hook (noop never communicates), or one that is frozen or failed? " + str(error)
        ) from error
    if len(set(specs)) > 1:
        listing = "; ".join(f"rank {r}: {s!r}" for r, s in enumerate(specs))
        raise SpecMismatchError(f"ranks were given different hook specs: {listing}")


TWO_PHASE_FROM = 8
"""``aggregation="auto"`` all-gathers below this many ranks: there all-gather sends at most
(p - 1) = 7 compressed tensors per rank against two-phase's 2 (p - 1) / p ~ 2, and skips the second
compression error; from 8 ranks on, bytes dominate."""


def _join_by_dtype(payloads: list[Payload]) -> tuple[list[Tensor], Callable[[list[Tensor]], list[Payload]]]:
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
            offset = 0
            for i in members:
                pieces[i] = flat[offset : offset + tensors[i].numel()].view(tensors[i].shape)
                offset += tensors[i].numel()
        return transport.regroup(payloads, [pieces[i] for i in range(len(tensors))])

    return joined, regroup


def _views(buffer: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """The bucket's tensors, as views of it."""
    parts, start = [], 0
    for shape in shapes:
        parts.append(buffer[start : start + math.prod(shape)].view(shape))
        start += math.prod(shape)
    return parts
