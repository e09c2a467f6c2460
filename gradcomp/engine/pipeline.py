"""The engine: a bucket's plan, executed. ``Engine.reduce(buffer, keys, shapes)`` averages a bucket
(the concatenation of several tensors) over a group in place, asynchronously, compressed.

One :class:`Engine` per process group and hook spec. For each bucket it takes the plan
(:func:`gradcomp.engine.plan.plan_bucket`: which tensors go which way, at which ratio, and why) and
runs it, send by send, part by part (:mod:`gradcomp.engine.routes`): each part is compressed in the
caller's thread (DDP's backward) and communicated on the collectives' ordered executor, so that one
bucket's compression overlaps the previous one's communication, every round of every bucket runs
in the same order on every rank, and nothing communicates from a backend's callback thread (rule
"one ordered path", ``docs/architecture.md``). What the plan decides, and why:

- **Each tensor is compressed on its own**, with its own key: its state (error-feedback residual,
  PowerSGD memory, random streams) follows the tensor, not the bucket, so results do not depend on
  how DDP groups tensors into buckets, which changes after DDP's first iteration and again when a
  run resumes (rule "state per tensor"). Stateless element-wise compressors (the casts) compress
  runs of the bucket whole.
- **Communication is per part**: ``sum`` payloads concatenated by dtype and all-reduced at once;
  ``gather`` payloads packed into one byte buffer and all-gathered, then summed in rank order.
- The bucket is divided by the world size *before* compression, so that low-precision sums cannot
  overflow (rule "divide before sum") and the average is taken exactly once.
- ``HookSpec.min_numel`` and ``HookSpec.vectors`` send the tensors they pick uncompressed, each
  rank's share of one all-reduce (a warm-up step's, bitwise the all-reduce hook's average), their
  bytes counted apart (``BucketRecord.uncompressed_bytes``); ``HookSpec.local_size`` runs the route
  across nodes; ``HookSpec.pieces`` sends the step's last bucket in pieces; ``HookSpec.warmup`` sends
  the first steps uncompressed, or at a falling keep-ratio.
- **One step clock**: :attr:`Engine.steps_done` counts the steps a caller ended (:meth:`Engine.end_step`,
  the same way for every hook), numbers the records and drives the warm-up; it is saved.
- The first call checks that every rank uses the same spec, and fails with every rank's spec named.
- The engine communicates on gradcomp's own process group, with the same ranks (one per parent group
  and timeout, shared by every engine), so that DDP's own collectives never interleave with it.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives, host
from gradcomp.collectives.executor import Handle, executor
from gradcomp.collectives.groups import as_timeout, private, rank_of, size_of
from gradcomp.collectives.hierarchical import subgroups
from gradcomp.collectives.link import Traffic
from gradcomp.compressors import Compressor, Key, make_compressor
from gradcomp.compressors.keys import plain
from gradcomp.engine import handover, hierarchical, sparse
from gradcomp.engine.plan import BucketPlan, Context, Route, Send, needs_tensors, plan_bucket, segments_of
from gradcomp.engine.routes import DenseRoute, GatherRoute, NodesRoute, RouteSteps, SumRoute, TwoPhaseRoute
from gradcomp.engine.spec import TWO_PHASE_FROM, HookSpec, HookSpecLike
from gradcomp.engine.stats import BucketRecord
from gradcomp.errors import PeerError, SpecMismatchError

__all__ = ["TWO_PHASE_FROM", "Engine", "check_same_spec"]

Landed = tuple[Tensor, Traffic | None]
"""What a bucket's future holds once it landed: the averaged buffer (and no traffic of its own)."""

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
        own_group: True (the default): the collectives go on gradcomp's own group of ``group``'s
            ranks; False: on ``group`` itself, which then must carry nothing else meanwhile (no
            ``local_size``, no ``timeout``: the group's own bounds the waits). For a group that
            ``torch.distributed`` does not know and its maker reconfigures (torchft's).
    """

    def __init__(
        self,
        spec: HookSpecLike,
        *,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | float | None = None,
        history: int = 10_000,
        own_group: bool = True,
    ) -> None:
        timeout = as_timeout(timeout)  # a number of seconds, or refused here
        self.spec = HookSpec.parse(spec)  # before touching any process group: a bad spec fails first
        if self.spec.compressor is None:
            raise ValueError("noop sends nothing: it needs no engine (gradcomp.hooks.make handles it)")
        if not own_group and (self.spec.local_size > 1 or timeout is not None):
            raise ValueError(
                "on a group it does not own the engine makes no group of its own: not local_size (its "
                "node groups), nor a timeout of its own (the group's is what bounds its waits)"
            )
        self.world = size_of(group)
        self.compressor: Compressor = make_compressor(self.spec.compressor, seed=self.spec.seed, rank=rank_of(group))
        # gradcomp's own group (same ranks, shared by its engines): DDP issues collectives of its
        # own from the training thread (find_unused_parameters' bitmap, static_graph's checks); on
        # DDP's group they would interleave with the engine's differently on each rank (gloo aborts
        # with "Received data size doesn't match expected size"). ``own_group=False``: ``group``
        # itself, for a group that nothing else communicates on while the engine runs and that
        # its maker reconfigures in place (torchft's): a group of its ranks would break with a
        # member that dies.
        self.group: dist.ProcessGroup = private(group, timeout) if own_group else (group or _world())
        self.local_rank = 0
        """This rank's index in its node (``local_size``), else 0."""
        self.routes: dict[Route, RouteSteps] = self._routes()
        """The routes that execute the plans' parts (:mod:`gradcomp.engine.routes`)."""
        self.records: collections.deque[BucketRecord] = collections.deque(maxlen=history)
        self.steps_done = 0
        """The engine's one step clock: steps ended in the whole run, resumed ones included (saved).
        The step the next bucket belongs to: the warm-up reads it, the records are numbered by it."""
        self._plans: dict[tuple[Any, ...], BucketPlan] = {}  # past the warm-up, a bucket's plan stays
        self._checked = False

    def _routes(self) -> dict[Route, RouteSteps]:
        """Every route over the group, and with ``local_size`` across nodes inside a hierarchy."""
        exact = make_compressor("none")
        # EF21 keeps no state for a tensor it never compresses: its uncompressed share is a plain one
        shares = exact if self.spec.compressor and self.spec.compressor.feedback.variant == "ef21" else self.compressor
        routes: dict[Route, RouteSteps] = {Route.DENSE: DenseRoute(shares, self.group, self.spec.algo, exact)}
        routes.update(self._compressed(self.group))
        local = self.spec.local_size
        if local > 1:
            hierarchical.check_local_size(local, self.world)
            intra, inter = subgroups(self.group, local)
            self.local_rank = dist.get_rank(intra)
            routes[Route.NODES] = NodesRoute(self._compressed(inter), intra, local)
        return routes

    def _compressed(self, group: dist.ProcessGroup) -> dict[Route, RouteSteps]:
        algo = self.spec.algo
        return {
            Route.SUM: SumRoute(self.compressor, group, algo),
            Route.GATHER: GatherRoute(self.compressor, group, algo),
            Route.TWO_PHASE: TwoPhaseRoute(self.compressor, group, algo),
        }

    def plan(
        self,
        numel: int,
        keys: Sequence[Key] | None,
        shapes: Sequence[torch.Size] | None,
        bucket: int = 0,
        last: bool = False,
        accelerator: bool = False,
    ) -> BucketPlan:
        """The plan of a bucket at the engine's current step (:func:`gradcomp.engine.plan.plan_bucket`),
        kept per bucket once the warm-up is over (it no longer changes)."""
        settled = self.steps_done >= self.spec.warmup
        memo = (None if keys is None else tuple(keys), numel, bucket, last, accelerator)
        held = self._plans.get(memo) if settled else None
        if held is not None:
            return held
        segments = segments_of(self.spec, numel, keys, shapes)
        context = Context(self.world, self.local_rank, accelerator)
        made = plan_bucket(self.spec, context, self.steps_done, segments, bucket, last)
        if settled:
            self._plans[memo] = made
        return made

    def reduce(
        self,
        buffer: Tensor,
        keys: Sequence[Key] | None,
        shapes: Sequence[torch.Size] | None,
        bucket: int = 0,
        last: bool = False,
    ) -> Handle[Tensor]:
        """Replace ``buffer`` by its average over the group, compressed; returns at once.

        ``buffer`` is flat and contiguous and concatenates tensors of ``shapes``; ``keys`` identify
        them across steps (their state is kept per key). Both may be None when :attr:`per_tensor`
        is False. ``bucket`` numbers the buffer within the step; ``last`` says it is the step's last
        bucket (it may travel in pieces). The step goes on until the caller ends it (:meth:`end_step`).
        """
        if not buffer.is_floating_point():
            raise TypeError(f"gradients must be floating-point, got {buffer.dtype}")
        if buffer.is_sparse:  # an nn.Embedding(sparse=True)'s, in a DDP bucket of its own
            return self._reduce_sparse(buffer, bucket)
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("the engine reduces flat, contiguous buffers (a DDP bucket's)")
        plan = self.plan(buffer.numel(), keys, shapes, bucket, last, not host.reads_are_free(buffer.device))
        queued = time.perf_counter()
        # each send compressed here, in the caller's thread, while the one before it travels
        landings = [self._send(buffer, plan, send, queued) for send in plan.sends]
        if len(landings) == 1:
            return Handle(landings[0])
        done: Future[Landed] = Future()
        _when_all(landings, lambda error: done.set_exception(error) if error else done.set_result((buffer, None)))
        return Handle(done)

    def _reduce_sparse(self, gradient: Tensor, bucket: int) -> Handle[Tensor]:
        """A sparse gradient averaged as DDP's default averages it (:mod:`gradcomp.engine.sparse`), on
        the ordered executor; refused, in one line, by a spec that compresses."""
        refused = sparse.refusal(self.spec)
        if refused is not None:
            raise ValueError(refused)
        size = sparse.payload_bytes(gradient)
        record = BucketRecord(self.steps_done, bucket, size, time.perf_counter())
        record.uncompressed_bytes = record.payload_bytes = size
        record.routes = "sparse"

        def operation() -> tuple[Tensor, None]:
            record.started = time.perf_counter()
            self._check_spec(gradient.device)
            with record.phase("communicate"):
                summed = sparse.all_reduce(gradient, self.group, rank_of(self.group), self.world)
            record.add_traffic(None, native=(self.world - 1) * size)  # gloo all-gathers every rank's
            record.finished = time.perf_counter()
            self.records.append(record)
            return summed, None

        return executor().submit(operation)

    def end_step(self) -> None:
        """End the step: the clock (:attr:`steps_done`) moves on. Every caller ends its steps so,
        once it handed over the step's last bucket (DDP's hook, and HSDP's at the end of backward;
        the ``auto`` hook for every candidate's engine, whether it averaged anything this step or
        not; a synchronizer after each synchronization)."""
        self.steps_done += 1

    def _send(self, buffer: Tensor, plan: BucketPlan, send: Send, queued: float) -> Future[Landed]:
        """Compress ``send``'s parts here, in the caller's thread (it overlaps the previous bucket's
        communication), and queue their communication on the ordered executor."""
        size = buffer.element_size()
        record = BucketRecord(self.steps_done, plan.bucket, (send.stop - send.start) * size, queued, part=send.piece)
        record.uncompressed_bytes = send.uncompressed * size
        record.routes = " + ".join(part.label for part in send.parts)
        routes = [self.routes[part.route] for part in send.parts]
        prepared = [route.prepare(part, buffer, record) for route, part in zip(routes, send.parts, strict=True)]
        done: Future[Landed] = Future()

        def operation() -> tuple[None, None]:  # on the ordered executor
            try:
                record.started = time.perf_counter()
                self._check_spec(buffer.device)
                landings = [route.send(p) for route, p in zip(routes, prepared, strict=True)]
            except BaseException as error:  # reaches whoever waits on the handle
                done.set_exception(error)
                return None, None
            _when_all([f for f in landings if f is not None], lambda error: self._close(buffer, record, done, error))
            return None, None

        executor().submit(operation, issues_only=self._checked and all(route.issues_only for route in routes))
        return done

    def _check_spec(self, device: torch.device) -> None:
        """At the first bucket: every rank was given the same spec."""
        if not self._checked:
            check_same_spec(str(self.spec), self.group, device)
            self._checked = True

    def _close(
        self,
        buffer: Tensor,
        record: BucketRecord,
        done: Future[Landed],
        error: BaseException | None = None,
    ) -> None:
        """Hand the bucket back (or its error), its record closed."""
        if error is not None:
            done.set_exception(error)
            return
        record.finished = time.perf_counter()
        self.records.append(record)
        done.set_result((buffer, None))

    @property
    def cuts(self) -> handover.Cuts:
        """How the engine cuts a tensor before compressing it (pieces, node shards, two-phase shards)."""
        local = max(self.spec.local_size, 1)
        multiple = self.spec.compressor.capabilities.piece_multiple if self.spec.compressor else 1
        return handover.Cuts(self.spec.pieces, multiple, self.spec.min_numel, local, self.world // local)

    def take_residual(self, parameter: Key, shape: torch.Size) -> Tensor | None:
        """What the engine has not sent yet of tensor ``parameter`` (its key as the caller gave it)
        of ``shape``, every part of it in its place, and every state of the tensor forgotten: for a
        caller that averages the tensor another way from now on (:mod:`gradcomp.engine.handover`)."""
        return handover.take_residual(self.compressor, self.cuts, parameter, shape)

    def state_dict(self) -> dict[str, Any]:
        """What the engine learned about its transfers, the padded all-gather's capacity per bucket,
        and its step clock, as plain values. Saved with the compressor's state, a resumed run sends
        exactly what the run straight through sends, without re-learning the capacities, and
        continues a warm-up where it stopped."""
        held = self._gather_route.capacities
        capacities = [{"keys": [plain(k) for k in keys], "bytes": size} for keys, size in held.items()]
        return {"capacities": capacities, "steps": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._gather_route.capacities = {tuple(entry["keys"]): int(entry["bytes"]) for entry in state["capacities"]}
        self.steps_done = int(state.get("steps", 0))  # states saved before warm-ups counted none

    @property
    def _gather_route(self) -> GatherRoute:
        route = self.routes[Route.GATHER]
        assert isinstance(route, GatherRoute)
        return route

    @property
    def per_tensor(self) -> bool:
        """Whether :meth:`reduce` needs the bucket's keys and shapes: not for an element-wise,
        stateless compressor (``allreduce``, the casts), which compresses the bucket whole, so that
        a hook need not list its parameters, unless a per-tensor policy picks tensors out of it."""
        return needs_tensors(self.spec)


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None, "no default process group: call torch.distributed.init_process_group first"
    return world


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
