"""The ``auto`` hook: it measures the link and the compressors on the real buckets, and picks per bucket.

::

    state = hooks.register(ddp_model, "auto")
    state = hooks.register(ddp_model, "auto:candidates=fp16|powersgd:rank=4,ef=true|topk:ratio=0.01,ef=true")

How it decides (every rank applies the same decision: rank 0 takes it and broadcasts it):

1. Steps before ``measure_at`` (default 4) go uncompressed (``allreduce``) while the hook records when
   each bucket is handed over, between the model's forward (stamped by hooks on the DDP module)
   and the next step: the model's compute and when each gradient is ready.
2. At step ``measure_at``, after its last bucket: a few all-reduces and all-gathers of chosen sizes on
   this group fit the link (:func:`gradcomp.cost.profile.fit_link`); rank 0 times every candidate's
   kernels on copies of this step's buckets (:func:`gradcomp.cost.kernels.time_tensor`); each
   candidate runs once through a fresh engine on the largest bucket, which gives the engine's own
   overhead; the cost model predicts every candidate's step (:mod:`gradcomp.cost.step`) and chooses
   per bucket (:func:`gradcomp.cost.choose.choose`). Unless something is predicted faster than the
   uncompressed gradient by more than ``margin``, the hook stays uncompressed.
3. Every ``check_every`` steps rank 0 compares the measured step (the median since the last check)
   with the prediction; if they differ by more than ``stray``, or ``recheck`` steps have passed, it
   measures and decides again (the compute stays as first measured).

Each decision, with its reason and predictions, is in :attr:`AutoState.decisions` (and in
TensorBoard for training runs). Switching a bucket away from a compressor takes what it had not sent
yet (``Compressor.take_residual``: error feedback's residual) into the bucket's next gradient (in units
of the gradient, so the new method sends it), so nothing is lost; EF21's estimates and momentum
correction's velocities are dropped, not sent (they hold no unsent gradient). Candidates are gradcomp hook specs,
separated by ``|``; the uncompressed ``allreduce`` is always among them (the first); hooks across
nodes (``local_size``, one node size) too: then the link inside a node and across nodes are probed
as well (:func:`gradcomp.cost.online.probe_nodes`). Options:
``candidates``, ``measure_at``, ``recheck``, ``check_every``, ``stray``, ``margin``, ``seed``.

Costs: the measuring step takes longer (the probes: on a 100 Mbit/s link a few seconds; the
kernels: tens of ms per candidate for a model of 6M parameters), then every ``check_every`` steps one
small broadcast. Memory: one copy of the gradients during the measuring step, and each candidate's
state (error-feedback residuals) for the buckets it ever averaged.
"""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at run time.
import dataclasses
import datetime
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket

from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.collectives.executor import Handle, executor, join
from gradcomp.collectives.groups import registered
from gradcomp.collectives.hierarchical import subgroups
from gradcomp.cost import online
from gradcomp.cost.choose import choose, explain
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.online import Bucket
from gradcomp.cost.profile import Timings
from gradcomp.cost.step import Workload, method_of
from gradcomp.engine import Engine
from gradcomp.engine.pipeline import check_same_spec
from gradcomp.engine.stats import StepStats, per_step, write_trace
from gradcomp.errors import GradcompError, backend_failure
from gradcomp.flat import numel, views
from gradcomp.hooks.auto_spec import DEFAULT_CANDIDATES, NAME, AutoSpec, is_auto_spec
from gradcomp.hooks.ddp import ParameterKeys, check_saved, deliver, refuse_sparse, shapes_of
from gradcomp.hooks.loss_scale import LossScale
from gradcomp.state import TrainingHookState

logger = logging.getLogger(__name__)

UNFITTED = -1.0
"""Rank 0's answer when the link's timings could not be fitted (times that did not grow with size)."""
RETRIES = 3
"""Steps in a row it measures again after such an answer, before it keeps the decision as it is."""
FAILED = -2.0
"""Rank 0's answer when deciding raised: every rank stops with an error instead of waiting."""
STATE_KEYS = frozenset({"spec", "world_size", "step", "choice", "pending", "candidates", "engines", "decisions",
                        "compute", "order", "predicted_s", "measured_at", "measure_next"})  # fmt: skip
"""The keys of :meth:`AutoState.state_dict`: a state with others (or without one of them) is refused."""

T = TypeVar("T")

__all__ = ["DEFAULT_CANDIDATES", "AutoSpec", "AutoState", "is_auto_spec", "register"]


class AutoState(TrainingHookState):
    """The ``auto`` hook's state: the candidates' engines, the decision per bucket, what it measured;
    statistics (per step as a gradcomp hook's, whichever candidates averaged its buckets), traces,
    checkpoints and the error as every hook's state (:class:`~gradcomp.state.TrainingHookState`)."""

    def __init__(
        self,
        spec: AutoSpec,
        group: dist.ProcessGroup | None,
        timeout: datetime.timedelta | None,
        link: LinkCosts | None = None,
    ) -> None:
        self._start(spec, link)
        self.world = dist.get_world_size(group)
        self.engines = [Engine(c, group=group, timeout=timeout) for c in self.candidates]
        self.group = self.engines[0].group  # gradcomp's own (shared by every engine of these ranks)
        self._nodes = subgroups(self.group, self.local) if self.local > 1 else None  # the engines' own
        self._parent, self._timeout = group, timeout
        self.rank = dist.get_rank(self.group)

    def _start(self, spec: AutoSpec, link: LinkCosts | None) -> None:
        """What does not depend on the group: the candidates, the decision, what was measured."""
        self.spec = spec
        self.link = link
        """A link given instead of measured (then the engine's overhead is not measured either)."""
        self.candidates = spec.hook_specs
        self.methods = [method_of(c) for c in self.candidates]
        self.local = spec.local_size
        """Ranks per node of the candidates across nodes (0: none): the nodes are probed too."""
        self.error: BaseException | None = None
        self.step = 0
        self.choice: dict[int, int] = {}
        """Per tensor (its key), the index of its candidate in :attr:`candidates` (absent: 0,
        ``allreduce``). Per tensor, not per bucket: DDP regroups its buckets on a resumed run's first
        step, and a bucket whose tensors have different candidates is averaged in runs, one per candidate."""
        self.pending: dict[int, Tensor] = {}
        """Residuals of a compressor a tensor left, added to its next gradient (units of gradient / world)."""
        self.loss_scale: LossScale | None = None
        """The loss scale of the gradient scaler whose units the carried state follows (``scaler=``)."""
        self.decisions: list[dict[str, Any]] = []
        """Every decision: its step, the candidate of each bucket, the predictions, the reason."""
        self.compute: Workload | None = None
        self.order: list[Bucket] = []
        """The buckets in the order of :attr:`compute`'s (the order backward hands them over)."""
        self.predicted_s: float | None = None
        self.measured_at: int | None = None
        self._measure_next = False
        self._unfitted = 0  # measurements in a row whose link timings could not be fitted
        self.keys = ParameterKeys()
        self._shapes: dict[Bucket, list[torch.Size]] = {}
        self._timelines: list[online.Timeline] = []
        self._copies: dict[Bucket, Tensor] = {}
        self._checked = False  # whether every rank was found to have the same spec and link (first bucket)

    # -- what DDP and the model call -------------------------------------------------------------

    def follow(self, scaler: torch.amp.GradScaler) -> None:
        """Keep what the hook carries between steps (every candidate's residuals, velocities and
        estimates, and the residuals in hand-over between candidates) in the units of ``scaler``'s
        loss scale, as a gradcomp hook does (:meth:`gradcomp.hooks.ddp.HookState.follow`)."""
        self.loss_scale = LossScale(scaler)

    def follow_scale(self) -> None:
        """At a step's first bucket: rescale the carried state if the loss scale changed."""
        assert self.loss_scale is not None
        ratio = self.loss_scale.change()
        if ratio is None:
            return
        for engine in self.engines:
            engine.compressor.rescale(ratio)
        if self.pending:
            torch._foreach_mul_(list(self.pending.values()), ratio)

    def forward_started(self, *_: Any) -> None:
        """The DDP module's forward pre-hook: a step (or a micro-batch) starts."""
        now = time.perf_counter()
        if self._timelines and self._timelines[-1].handed:
            self._timelines[-1].next_start = now
        if self._timelines and not self._timelines[-1].handed:
            self._timelines.pop()  # a micro-batch without synchronization (no_sync): the step starts later
        self._timelines = self._timelines[-(self.spec.check_every + self.spec.measure_at) :]
        self._timelines.append(online.Timeline(now))

    def forward_ended(self, *_: Any) -> None:
        """The DDP module's forward hook: backward comes next."""
        if self._timelines:
            self._timelines[-1].forward_end = time.perf_counter()

    def reduce(self, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        """Average one of DDP's buckets with the candidate chosen for it. An error raised here (the
        first bucket's check of the options, the measurement, the decision) is kept in :attr:`error`,
        as one that reaches a bucket's future is."""
        try:
            self._check_same_options(bucket.buffer().device)
            return deliver(self, self._average(bucket, bucket.buffer()))
        except Exception as error:
            self.error = self.error or error
            raise

    def _check_same_options(self, device: torch.device) -> None:
        """At the first bucket: every rank was given the same spec (``measure_at``, ``recheck``, the
        candidates, ...) and the same ``link`` (or none), else a :class:`SpecMismatchError` naming
        every rank's, on every rank (where they differ the ranks would measure at different steps
        and wait for each other until the group's timeout). DDP's path only: the fault-tolerant
        hook's group changes members, and it sends its decision round itself."""
        if self._checked:
            return
        link = "measured" if self.link is None else f"{self.link.alpha!r},{self.link.beta!r}"
        check_same_spec(f"{self.spec} (link: {link})", self.group, device)
        self._checked = True

    def _average(self, bucket: GradBucket, buffer: Tensor, flush: bool = True) -> Handle[Tensor]:
        """``buffer`` (the bucket's) averaged by the candidates chosen for its tensors; ``flush``: with
        the residuals of compressors its tensors left (else they wait for a later step)."""
        now = time.perf_counter()
        if self.loss_scale is not None and bucket.index() == 0:  # DDP hands buckets over in index order
            self.follow_scale()
        parameters = bucket.parameters()
        keys, shapes = self.keys(parameters), shapes_of(parameters)
        identity = tuple(keys)
        self._shapes[identity] = shapes
        if self._timelines:
            self._timelines[-1].handed[identity] = now
        if self._measuring_now():
            self._copies[identity] = buffer.clone()  # the gradients the kernels are timed on
        if flush:
            self._flush(buffer, keys, shapes)
        handles, start, first = [], 0, 0
        for end in range(1, len(keys) + 1):  # runs of consecutive tensors with the same candidate
            candidate = self.choice.get(keys[first], 0)
            if end < len(keys) and self.choice.get(keys[end], 0) == candidate:
                continue
            size = numel(shapes[first:end])
            engine = self.engines[candidate]
            handles.append(engine.reduce(buffer[start : start + size], keys[first:end], shapes[first:end],
                                         bucket.index(), bucket.is_last()))  # fmt: skip
            start, first = start + size, end
        handle = handles[0] if len(handles) == 1 else join(handles, buffer)
        if bucket.is_last():
            try:
                self._end_of_step()
            finally:
                self._copies.clear()
                self.step += 1
                for engine in self.engines:  # one clock: every candidate's warm-up and records follow the hook's steps
                    engine.end_step()
        return handle

    # -- statistics and checkpoints --------------------------------------------------------------

    def steps_since(self, first: int) -> list[StepStats]:
        fresh = [r for e in self.engines for r in e.records if r.step >= first]
        return per_step(sorted(fresh, key=lambda r: (r.step, r.queued)))

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        records = sorted((r for e in self.engines for r in e.records), key=lambda r: (r.step, r.queued))
        write_trace(records, path, dist.get_rank())

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly: the decision, the pending flushes,
        every candidate's compressor and engine state, and what was measured (plain values and
        tensors: loadable with ``torch.load(..., weights_only=True)``)."""
        return {
            "spec": str(self.spec),
            "world_size": self.world,
            "step": self.step,
            "choice": [[key, candidate] for key, candidate in self.choice.items()],
            "pending": [[key, tensor] for key, tensor in self.pending.items()],
            "candidates": [e.compressor.state_dict() for e in self.engines],
            "engines": [e.state_dict() for e in self.engines],
            "decisions": self.decisions,
            "compute": None if self.compute is None else self.compute.state(),
            "order": [list(identity) for identity in self.order],
            "predicted_s": self.predicted_s,
            "measured_at": self.measured_at,
            "measure_next": self._measure_next,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, from a hook of the same spec and world size."""
        check_saved(state, str(self.spec), self.world, NAME)
        unknown, missing = sorted(set(state) - STATE_KEYS), sorted(STATE_KEYS - set(state))
        if unknown or missing:
            raise ValueError(f"not an {NAME} hook state as this version saves it: unknown keys {unknown}, "
                             f"missing keys {missing}; valid: {', '.join(sorted(STATE_KEYS))}")  # fmt: skip
        choice = {int(key): int(c) for key, c in state["choice"]}
        wrong = {key: c for key, c in choice.items() if not 0 <= c < len(self.candidates)}
        if wrong:
            raise ValueError(f"this {NAME} hook state chooses candidates {wrong} (tensor: index); this hook has "
                             f"{len(self.candidates)}, indices 0 to {len(self.candidates) - 1}")  # fmt: skip
        self.step = int(state["step"])
        self.choice = choice
        self.pending = {int(key): tensor for key, tensor in state["pending"]}
        for engine, compressor, own in zip(self.engines, state["candidates"], state["engines"], strict=True):
            engine.compressor.load_state_dict(compressor)
            engine.load_state_dict(own)
        self.decisions = list(state["decisions"])
        self.compute = None if state["compute"] is None else Workload.from_state(state["compute"])
        self.order = [tuple(int(k) for k in identity) for identity in state["order"]]
        self.predicted_s = state["predicted_s"]
        self.measured_at = state["measured_at"]
        self._measure_next = bool(state["measure_next"])

    # -- deciding --------------------------------------------------------------------------------

    def _measuring_now(self) -> bool:
        """Whether this step ends with a measurement (the same answer on every rank, at every bucket)."""
        if self._measure_next:
            return True
        if self.measured_at is None:
            return self.step >= self.spec.measure_at and (self.compute is not None or bool(self._whole_steps()))
        recheck = self.spec.recheck > 0 and self.step - self.measured_at >= self.spec.recheck
        return recheck

    def _whole_steps(self) -> list[online.Timeline]:
        """Steps seen whole since DDP's bucket rebuild (step 0 has a single bucket), the latest ones."""
        whole = [t for t in self._timelines[:-1] if t.whole]
        return whole[-(self.spec.measure_at - 1) :]

    def _end_of_step(self) -> None:
        """After a step's last bucket: measure and decide, or check the prediction (every rank alike)."""
        if self._measuring_now():
            self._measure_and_decide()
            return
        due = self.measured_at is not None and self.spec.check_every > 0 and self.step > self.measured_at
        if due and (self.step - self.measured_at) % self.spec.check_every == 0:  # type: ignore[operator]
            flag = torch.tensor([float(self._strayed())], dtype=torch.float64)
            self._measure_next = self._broadcast(flag)[0] > 0

    def _strayed(self) -> bool:
        """Rank 0: whether the median measured step strays from the prediction by more than ``stray``."""
        if self.rank != 0 or self.predicted_s is None:
            return False
        whole = [t for t in self._timelines if t.whole][-self.spec.check_every :]
        recent = [t.next_start - t.start for t in whole if t.next_start is not None]
        if len(recent) < 2:
            return False
        measured = statistics.median(recent)
        strayed = abs(measured - self.predicted_s) > self.spec.stray * self.predicted_s
        if strayed:
            logger.info("auto: measured %.1f ms per step, predicted %.1f ms: measuring again",
                        measured * 1e3, self.predicted_s * 1e3)  # fmt: skip
        return strayed

    def _measure_and_decide(self) -> None:
        copies = self._copies
        if self.compute is None or set(self.order) != set(copies):  # first, or DDP regrouped (a resumed run)
            seen = [t for t in self._whole_steps() if set(t.handed) == set(copies)]
            if not seen:  # no whole step with these buckets yet (a resumed run's first): the next step
                self._measure_next = True
                return
            self.compute, self.order = online.workload_from(seen, self._shapes, self._step_end)
        largest = max(self.order, key=lambda identity: copies[identity].numel())
        timings, engine_seconds, nodes = None, None, None
        if self.link is None:
            largest_bytes = max(c.numel() * c.element_size() for c in copies.values())
            timings = self._with_peers("the link's probes", online.probe_link, self.group, largest_bytes)
            if self._nodes is not None:
                nodes = self._with_peers("the nodes' probes", online.probe_nodes, *self._nodes, largest_bytes)
            engine_seconds = self._with_peers("timing the candidates' engines", online.time_engines, self.candidates,
                                              copies[largest], list(largest), self._shapes[largest], self._parent,
                                              self._timeout)  # fmt: skip
        size = 1 + len(self.methods) + len(self.order)
        vector = [0.0] * size
        failure: Exception | None = None
        if self.rank == 0:
            try:
                vector = self._decide(timings, copies, engine_seconds, largest, nodes)
            except Exception as error:  # said to every rank, which would otherwise wait for the decision
                failure, vector = error, [FAILED] * size
        received = self._broadcast(torch.tensor(vector, dtype=torch.float64))
        if failure is not None:
            raise failure
        if received[0] == FAILED:
            raise GradcompError(
                f"rank {self.rank} of {self.world}: the {NAME} hook's rank 0 failed to decide at step {self.step} "
                "(its error says why); this rank stops instead of waiting for the decision"
            )
        if received[0] == UNFITTED and self._unfitted < RETRIES:  # the same on every rank: rank 0's
            self._unfitted += 1
            self._measure_next = True
            return
        if received[0] == UNFITTED:  # still no fit: keep what is, measure again at the next recheck
            self.measured_at, self._measure_next, self._unfitted = self.step, False, 0
            return
        self._unfitted = 0
        predicted, uniform = received[0], received[1 : 1 + len(self.methods)]
        assignment = [int(c) for c in received[1 + len(self.methods) :]]
        self._install({key: c for identity, c in zip(self.order, assignment, strict=True) for key in identity})
        self.predicted_s, self.measured_at, self._measure_next = predicted, self.step, False
        reason = explain(self.methods, assignment, predicted, uniform, self.spec.margin)
        self.decisions.append({
            "step": self.step,
            "buckets": [str(self.candidates[c]) for c in assignment],
            "predicted_ms": predicted * 1e3,
            "alone_ms": {str(c): t * 1e3 for c, t in zip(self.candidates, uniform, strict=True)},
            "reason": reason,
        })  # fmt: skip
        logger.info("auto at step %d: %s", self.step, reason)

    def _decide(
        self,
        timings: Timings | None,
        copies: dict[Bucket, Tensor],
        engine_seconds: list[float] | None,
        largest: Bucket,
        nodes: online.Nodes | None = None,
    ) -> list[float]:
        """Rank 0: the choice as [predicted seconds, each candidate's alone, each bucket's candidate]."""
        assert self.compute is not None
        if timings is None:
            assert self.link is not None
            local = max(self.local, 1)  # a given link: the same inside nodes and across them
            cluster = Cluster(self.world, self.link, local, native_all_reduce=self.link, native_all_gather=self.link)
        else:
            try:
                cluster = online.fit(timings, self.world)
            except ValueError as error:  # a link too noisy to fit: no basis for a decision
                logger.warning("auto: measuring again at the next step: %s", error)
                return [UNFITTED] * (1 + len(self.methods) + len(self.order))
            if nodes is not None:
                try:
                    cluster = online.fit(timings, self.world, nodes)
                except ValueError as error:  # the nodes' own links only refine the one among all ranks
                    logger.warning("auto: every hop priced at the link among all ranks: %s", error)
                    cluster = dataclasses.replace(cluster, local_size=self.local)
        shapes = {identity: self._shapes[identity] for identity in self.order}
        gradients = {identity: copies[identity] for identity in self.order}
        costs = online.kernel_costs(self.methods, gradients, shapes, cluster, engine_seconds, largest,
                                    self.spec.seed, self.rank)  # fmt: skip
        choice = choose(self.compute, self.methods, cluster, costs.__getitem__, self.spec.margin)
        return [choice.predicted_s, *choice.uniform_s, *choice.per_bucket]

    def _step_end(self, timeline: online.Timeline) -> float:
        """When the step's communication was done: its buckets' latest finish (else its last hand-over)."""
        last = max(timeline.handed.values())
        finished = [
            r.finished
            for e in self.engines
            for r in e.records
            if timeline.start <= r.queued <= last and r.finished
        ]  # fmt: skip
        return max([last, *finished])

    def _broadcast(self, values: Tensor) -> list[float]:
        """Rank 0's ``values`` on every rank (through the ordered executor, on the hook's group)."""

        def send() -> tuple[list[float], None]:
            if registered(self.group):
                dist.broadcast(values, src=dist.get_global_rank(self.group, 0), group=self.group)
            else:  # a group torch.distributed does not know (torchft's): its rank 0 as the group numbers it
                dist.broadcast(values, group=self.group, group_src=0)
            return values.tolist(), None

        return self._with_peers("the decision's broadcast", lambda: executor().submit(send, wait=True).wait())

    def _with_peers(self, what: str, run: Callable[..., T], *args: Any) -> T:
        """``run(*args)``, a step every rank takes together; the backend's failure (a peer frozen,
        dead, or at another step) as a :class:`~gradcomp.errors.PeerError` saying what failed where."""
        try:
            return run(*args)
        except GradcompError:
            raise
        except RuntimeError as error:  # gloo's timeouts and closed connections
            raise backend_failure(f"the {NAME} hook's {what} at step {self.step}", self.rank, self.world,
                                  error) from error  # fmt: skip

    def _install(self, choice: dict[int, int]) -> None:
        """Take the new decision; a tensor leaving a compressor takes what it had not sent yet
        (error feedback's residual: ``Compressor.take_residual``) into its next gradient."""
        shapes = {key: shape for keys, held in self._shapes.items() for key, shape in zip(keys, held, strict=True)}
        for key, new in choice.items():
            old = self.choice.get(key, 0)
            residual = self._take_residual(old, key, shapes[key]) if old != new else None
            if residual is not None:
                self.pending[key] = residual
        self.choice = choice

    def _take_residual(self, candidate: int, key: int, shape: torch.Size) -> Tensor | None:
        """What ``key`` had not sent through ``candidate``, in the tensor's shape: every part of it
        that candidate's engine cut it into (pieces, node shards, two-phase shards) in its place
        (:meth:`gradcomp.engine.Engine.take_residual`)."""
        return self.engines[candidate].take_residual(key, shape)

    def _flush(self, buffer: Tensor, keys: list[int], shapes: list[torch.Size]) -> None:
        """Add pending residuals into this bucket's gradients (times the world size: the engine
        divides by it), so the bucket's new method sends what the old one had not."""
        for key, part in zip(keys, views(buffer, shapes), strict=True):
            residual = self.pending.pop(key, None)
            if residual is not None:
                part.add_(residual.view_as(part), alpha=self.world)


def register(model: torch.nn.parallel.DistributedDataParallel, spec: str | AutoSpec, **options: Any) -> AutoState:
    """Attach the ``auto`` hook to ``model`` (and the forward hooks that time its compute); returns
    its state (for statistics and checkpoints). ``options``: ``group`` (default: the model's),
    ``timeout``, ``seed``, ``scaler`` (a mixed-precision run's ``GradScaler``, whose loss scale the
    carried residuals follow), and ``link`` (a :class:`~gradcomp.collectives.cost_model.LinkCosts` to
    decide with instead of measuring the link: when you know it, or to test the decision)."""
    parsed = spec if isinstance(spec, AutoSpec) else AutoSpec.parse(spec)
    unknown = sorted(set(options) - {"group", "timeout", "seed", "link", "scaler"})
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for the auto hook; valid: group, timeout, seed, link, scaler")
    if options.get("seed") is not None:
        parsed = dataclasses.replace(parsed, seed=options["seed"])
    refuse_sparse(model, str(parsed))  # auto's candidates compress dense buffers
    group = options.get("group") or model.process_group
    state = AutoState(parsed, group, options.get("timeout"), options.get("link"))
    if options.get("scaler") is not None:
        state.follow(options["scaler"])
    # Bookkeeping in Python (timestamps, lists): under torch.compile it runs as it is, not traced (a
    # traced branch on the list's length would recompile at every step up to dynamo's limit). Wrapped
    # here, not where they are defined: torch.compiler.disable imports dynamo, a second at every import.
    model.register_forward_pre_hook(torch.compiler.disable(state.forward_started))
    model.register_forward_hook(torch.compiler.disable(state.forward_ended))
    model.register_comm_hook(state, _auto_hook)
    return state


def _auto_hook(state: AutoState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    return state.reduce(bucket)
