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
- A per-tensor policy (``HookSpec.min_numel``, ``HookSpec.vectors``) sends the tensors it picks
  uncompressed, each rank's share of one all-reduce per bucket (a warm-up step's, bitwise the
  all-reduce hook's average), beside the others' route; their bytes are counted apart
  (``BucketRecord.uncompressed_bytes``).
- With ``HookSpec.local_size`` the route runs across nodes: uncompressed inside each node,
  compressed between them (:mod:`gradcomp.engine.hierarchical`).
- With ``HookSpec.pieces`` the step's last bucket travels in parts, each compressed while the one
  before it is sent, and large tensors are compressed as pieces of their rows in every bucket
  (:mod:`gradcomp.engine.pieces`).
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
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives
from gradcomp.collectives.executor import Handle, executor
from gradcomp.collectives.groups import as_timeout, private
from gradcomp.collectives.hierarchical import subgroups
from gradcomp.collectives.link import Traffic
from gradcomp.compressors import Compressor, Key, make_compressor
from gradcomp.compressors.base import piece_multiple
from gradcomp.compressors.keys import plain
from gradcomp.engine import handover, hierarchical, pieces
from gradcomp.engine.routes import BucketWork, DenseRoute, GatherRoute, RouteSteps, SumRoute, TwoPhaseRoute
from gradcomp.engine.spec import TWO_PHASE_FROM, HookSpec, HookSpecLike, Route
from gradcomp.engine.stats import BucketRecord
from gradcomp.engine.warmup import Warmup, WarmupStep
from gradcomp.errors import PeerError, SpecMismatchError
from gradcomp.flat import numel, views

__all__ = ["TWO_PHASE_FROM", "Engine", "check_same_spec"]

_ROUTES: dict[Route, type[SumRoute | GatherRoute | TwoPhaseRoute]] = {
    Route.SUM: SumRoute,
    Route.GATHER: GatherRoute,
    Route.TWO_PHASE: TwoPhaseRoute,
}


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
        timeout: datetime.timedelta | float | None = None,
        history: int = 10_000,
    ) -> None:
        timeout = as_timeout(timeout)  # a number of seconds, or refused here
        self.spec = HookSpec.parse(spec)  # before touching any process group: a bad spec fails first
        if self.spec.compressor is None:
            raise ValueError("noop sends nothing: it needs no engine (gradcomp.hooks.make handles it)")
        self.world = dist.get_world_size(group)
        self.compressor: Compressor = make_compressor(
            self.spec.compressor, seed=self.spec.seed, rank=dist.get_rank(group)
        )
        # gradcomp's own group (same ranks, shared by its engines): DDP issues collectives of its
        # own from the training thread (find_unused_parameters' bitmap, static_graph's checks); on
        # DDP's group they would interleave with the engine's differently on each rank (gloo aborts
        # with "Received data size doesn't match expected size").
        self.group = private(group, timeout)
        self.route: RouteSteps = self._route()
        """How the spec's payloads travel (:mod:`gradcomp.engine.routes`; across nodes,
        :mod:`gradcomp.engine.hierarchical`)."""
        exact = make_compressor("none")
        self._dense = DenseRoute(self.compressor, self.group, self.spec.algo, exact)
        # The per-tensor policy's uncompressed tensors: each rank's share as a warm-up step's (EF21
        # keeps no state for a tensor it never compresses: a plain share).
        ef21 = self.spec.compressor.feedback.variant == "ef21"
        self._uncompressed = DenseRoute(exact if ef21 else self.compressor, self.group, self.spec.algo, exact)
        self._scratches: dict[tuple[Key, ...], Tensor] = {}
        self._splits: dict[tuple[Key, ...], list[bool]] = {}  # per bucket: which tensors travel uncompressed
        self.warmup = Warmup(self.spec, self.compressor)
        self.records: collections.deque[BucketRecord] = collections.deque(maxlen=history)
        self.steps_done = 0
        """The engine's one step clock: steps ended in the whole run, resumed ones included (saved).
        The step the next bucket belongs to: the warm-up reads it, the records are numbered by it."""
        self._checked = False

    def _route(self) -> RouteSteps:
        """The spec's route over the group, or with ``local_size`` across nodes inside a hierarchy."""
        local = self.spec.local_size
        if local <= 1:
            return _ROUTES[self.spec.route(self.world)](self.compressor, self.group, self.spec.algo)
        hierarchical.check_local_size(local, self.world)
        intra, inter = subgroups(self.group, local)
        inner = _ROUTES[self.spec.route(self.world // local)](self.compressor, inter, self.spec.algo)
        return hierarchical.HierarchicalRoute(inner, intra, local, self.compressor.elementwise)

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
        is False. ``bucket`` numbers the buffer within the step; ``last`` says it is the step's last
        bucket (it may travel in pieces) and ends the step (:meth:`end_step`) once handed over: a
        caller that learns where a step ends only later passes False and calls :meth:`end_step`.
        """
        work = self._work(buffer, keys, shapes, bucket)
        plan = self.warmup.at(self.steps_done)
        parts = self._parts(work) if last and self.spec.pieces > 1 and not plan.dense else [work]
        # each part compressed here, in the caller's thread, while the one before it travels
        landings = [self._send(part, plan) for part in parts]
        if last:
            self.end_step()
        if len(landings) == 1:
            return Handle(landings[0])
        done: Future[tuple[Tensor, Traffic | None]] = Future()
        _when_all(landings, lambda error: done.set_exception(error) if error else done.set_result((buffer, None)))
        return Handle(done)

    def end_step(self) -> None:
        """End the step: the clock (:attr:`steps_done`) moves on. ``reduce(..., last=True)`` calls
        it; a caller that learns where a step ends only once its buckets are handed over (HSDP's
        all-reduce hook, at the end of backward; the ``auto`` hook, for every candidate's engine,
        whether it averaged anything this step or not) passes ``last=False`` and calls it then."""
        self.steps_done += 1

    def _send(self, work: BucketWork, plan: WarmupStep) -> Future[tuple[Tensor, Traffic | None]]:
        """Compress ``work`` here, in the caller's thread (it overlaps the previous bucket's
        communication), and queue its communication on the ordered executor."""
        work.ratio, work.settled = plan.ratio, plan.settled
        sends: list[tuple[RouteSteps, BucketWork]] = [(self._dense, work)] if plan.dense else self._by_policy(work)
        for route, part in sends:
            route.prepare(part)
        done: Future[tuple[Tensor, Traffic | None]] = Future()

        def operation() -> tuple[None, None]:  # on the ordered executor
            try:
                work.record.started = time.perf_counter()
                self._check_spec(work.buffer.device)
                landings = [route.send(part) for route, part in sends]
            except BaseException as error:  # reaches whoever waits on the handle
                done.set_exception(error)
                return None, None
            _when_all([f for f in landings if f is not None], lambda error: self._close(work, sends, done, error))
            return None, None

        issues_only = self._checked and all(route.issues_only for route, _ in sends)
        executor().submit(operation, issues_only=issues_only)
        return done

    def _parts(self, work: BucketWork) -> list[BucketWork]:
        """The step's last bucket in up to ``spec.pieces`` parts of whole tensors or pieces (cut in
        :meth:`_work`), or of the buffer when it travels whole (:mod:`gradcomp.engine.pieces`), each
        with its own record (numbered ``part``) handed over when the bucket was."""
        if not work.shapes:
            multiple = piece_multiple(self.spec.compressor.config) if self.spec.compressor else 1
            cuts = pieces.spans(work.buffer.numel(), self.spec.pieces, multiple)
            groups: list[tuple[int, int, list[Key], list[torch.Size]]] = [(start, stop, [], []) for start, stop in cuts]
        else:
            sizes = [math.prod(shape) for shape in work.shapes]
            starts = [0, *itertools.accumulate(sizes)]
            groups = [
                (starts[g.start], starts[g.stop], work.keys[g.start : g.stop], work.shapes[g.start : g.stop])
                for g in pieces.parts(sizes, self.spec.pieces)
            ]
        if len(groups) < 2:
            return [work]
        record, size = work.record, work.buffer.element_size()
        return [
            BucketWork(
                work.buffer[start:stop],
                list(keys),
                list(shapes),
                BucketRecord(record.step, record.bucket, (stop - start) * size, record.queued, part=index),
            )
            for index, (start, stop, keys, shapes) in enumerate(groups)
        ]

    def _by_policy(self, work: BucketWork) -> list[tuple[RouteSteps, BucketWork]]:
        """The bucket's tensors by the spec's per-tensor policy: those it sends uncompressed (copied
        together into a buffer kept per bucket) to their share of an all-reduce, the others through the
        spec's route, in place."""
        if not self.spec.keeps_some_dense or not work.shapes:
            return [(self.route, work)]
        bucket = tuple(work.keys)
        dense = self._splits.get(bucket)
        if dense is None:  # a bucket's tensors stay what they are: decided once per bucket
            dense = self._splits[bucket] = [self.spec.uncompressed(shape) for shape in work.shapes]
        if not any(dense):
            return [(self.route, work)]
        work.record.uncompressed_bytes = work.buffer.element_size() * numel(
            [s for s, d in zip(work.shapes, dense, strict=True) if d]
        )
        if all(dense):
            return [(self._uncompressed, work)]
        parts = views(work.buffer, work.shapes)
        kept = [i for i, d in enumerate(dense) if not d]
        left = [i for i, d in enumerate(dense) if d]
        compressed = BucketWork(work.buffer, [work.keys[i] for i in kept], [work.shapes[i] for i in kept],
                                work.record, work.ratio, work.settled, parts=[parts[i] for i in kept])  # fmt: skip
        shapes = [work.shapes[i] for i in left]
        scratch = self._scratch(bucket, numel(shapes), work.buffer)
        torch.cat([parts[i].reshape(-1) for i in left], out=scratch)
        uncompressed = BucketWork(scratch, [work.keys[i] for i in left], shapes, work.record)
        uncompressed.landing = [parts[i] for i in left]
        return [(self.route, compressed), (self._uncompressed, uncompressed)]

    def _scratch(self, bucket: tuple[Key, ...], size: int, like: Tensor) -> Tensor:
        """The buffer of a bucket's uncompressed tensors, kept for the next steps (DDP waits for every
        bucket before the next backward, so a step's buffer is free when the next one needs it)."""
        held = self._scratches.get(bucket)
        if held is None or held.numel() != size or held.dtype != like.dtype or held.device != like.device:
            held = self._scratches[bucket] = torch.empty(size, dtype=like.dtype, device=like.device)
        return held

    def _work(
        self, buffer: Tensor, keys: Sequence[Key] | None, shapes: Sequence[torch.Size] | None, bucket: int
    ) -> BucketWork:
        """The bucket as the routes take it, its input checked, its record started."""
        if not buffer.is_floating_point():
            raise TypeError(f"gradients must be floating-point, got {buffer.dtype}")
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("the engine reduces flat, contiguous buffers (a DDP bucket's)")
        record = BucketRecord(self.steps_done, bucket, buffer.numel() * buffer.element_size(), time.perf_counter())
        if not self.per_tensor:  # the bucket travels whole: its tensors are not needed
            return BucketWork(buffer, [], [], record)
        if keys is None or shapes is None:
            raise ValueError(f"{self.spec} needs the keys and shapes of the bucket's tensors")
        if len(keys) != len(shapes) or numel(shapes) != buffer.numel():
            raise ValueError(
                f"{len(keys)} keys and shapes holding {numel(shapes)} elements "
                f"do not describe a buffer of {buffer.numel()}"
            )
        if self.spec.pieces > 1 and self.spec.compressor is not None:  # in every bucket: rule "state per tensor"
            multiple = piece_multiple(self.spec.compressor.config)
            keys, shapes = pieces.cut(keys, shapes, self.spec.pieces, multiple, self.spec.min_numel)
        return BucketWork(buffer, list(keys), list(shapes), record)

    def _check_spec(self, device: torch.device) -> None:
        """At the first bucket: every rank was given the same spec."""
        if not self._checked:
            check_same_spec(str(self.spec), self.group, device)
            self._checked = True

    def _close(
        self,
        work: BucketWork,
        sends: list[tuple[RouteSteps, BucketWork]],
        done: Future[tuple[Tensor, Traffic | None]],
        error: BaseException | None = None,
    ) -> None:
        """Hand the bucket back (or its error), its uncompressed tensors copied home, its record closed."""
        if error is not None:
            done.set_exception(error)
            return
        for _, part in sends:
            if part.landing:
                for home, averaged in zip(part.landing, views(part.buffer, part.shapes), strict=True):
                    home.copy_(averaged)
        work.record.finished = time.perf_counter()
        self.records.append(work.record)
        done.set_result((work.buffer, None))

    @property
    def cuts(self) -> handover.Cuts:
        """How the engine cuts a tensor before compressing it (pieces, node shards, two-phase shards)."""
        local = max(self.spec.local_size, 1)
        multiple = piece_multiple(self.spec.compressor.config) if self.spec.compressor else 1
        return handover.Cuts(self.spec.pieces, multiple, self.spec.min_numel, local, self.world // local)

    def take_residual(self, parameter: Key, shape: torch.Size) -> Tensor | None:
        """What the engine has not sent yet of tensor ``parameter`` (its key as the caller gave it)
        of ``shape``, every part of it in its place, and every state of the tensor forgotten: for a
        caller that averages the tensor another way from now on (:mod:`gradcomp.engine.handover`)."""
        return handover.take_residual(self.compressor, self.cuts, parameter, shape)

    def state_dict(self) -> dict[str, Any]:
        """What the engine learned about its transfers, the padded all-gather's capacity per bucket,
        and the steps it compressed (the warm-up's clock), as plain values. Saved with the
        compressor's state, a resumed run sends exactly what the run straight through sends, without
        re-learning the capacities, and continues a warm-up where it stopped."""
        held = self.route.capacities if isinstance(self.route, GatherRoute) else {}
        capacities = [{"keys": [plain(k) for k in keys], "bytes": size} for keys, size in held.items()]
        return {"capacities": capacities, "steps": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.route, GatherRoute):
            self.route.capacities = {tuple(entry["keys"]): int(entry["bytes"]) for entry in state["capacities"]}
        self.steps_done = int(state.get("steps", 0))  # states saved before warm-ups counted none

    @property
    def per_tensor(self) -> bool:
        """Whether :meth:`reduce` needs the bucket's keys and shapes: not for an element-wise,
        stateless compressor (``allreduce``, the casts), which compresses the bucket whole, so that
        a hook need not list its parameters, unless a per-tensor policy picks tensors out of it."""
        return not self.compressor.elementwise or self.spec.keeps_some_dense


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


def _when_all(landings: Sequence[Future[Any]], then: Callable[[BaseException | None], None]) -> None:
    """Call ``then(error)`` once every future of ``landings`` is done (at once if none), with the
    first error among them or None."""
    if not landings:
        then(None)
        return
    pending = list(landings)
    remaining = [len(pending)]
    lock = threading.Lock()

    def landed(_: Future[None]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            error = next((f.exception() for f in pending if f.exception() is not None), None)
            pending.clear()  # no cycle through the futures' callbacks: freed now, not by a collection
            then(error)

    for future in landings:
        future.add_done_callback(landed)
