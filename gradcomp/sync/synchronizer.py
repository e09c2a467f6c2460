"""Infrequent synchronization of full replicas: local SGD and DiLoCo, through any compressor.

Each rank trains its own replica with its own (inner) optimizer and calls :meth:`Synchronizer.step`
after each inner step. Every ``every`` steps a fragment of the parameters synchronizes:

1. its **outer gradient**, the fragment's last synchronized ("global") parameters minus the local
   ones, goes to the engine (:class:`gradcomp.engine.Engine`), which averages it over the group
   through the hook spec's compressor (error feedback keyed per parameter, as for DDP's gradients);
2. ``delay`` inner steps later (at once with 0) the average lands: an **outer SGD step** (DiLoCo:
   Nesterov, lr 0.7, momentum 0.9; local SGD: lr 1, no momentum, which lands on the replicas'
   average) moves the global parameters, identical on every rank;
3. every replica adopts them, keeping ``mix`` of its own (Streaming DiLoCo's mixing, for a replica
   that trained on while its synchronization travelled).

The communication runs on the collectives' ordered executor, issued in the same order on every rank
(every rank calls ``step`` as often, and the schedule is a function of the step), so a delayed
synchronization overlaps the next inner steps without racing anything (rule "one ordered path",
``docs/architecture.md``). Costs per rank: two copies of the trainable parameters (the global ones,
in float32 or wider, and a send buffer) and the outer optimizer's momentum.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import datetime
import logging
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradcomp import collectives
from gradcomp.collectives.executor import Handle
from gradcomp.collectives.groups import as_timeout
from gradcomp.compressors import fusion
from gradcomp.compressors.finite import refuse_non_finite
from gradcomp.engine import Engine, HookSpec, HookSpecLike, rules
from gradcomp.engine.pipeline import check_same_spec
from gradcomp.engine.stats import BucketRecord, StepStats, newest, per_step, write_trace
from gradcomp.flat import views
from gradcomp.state import TrainingHookState
from gradcomp.sync import fragments
from gradcomp.sync.spec import SyncSpec, SyncSpecLike

ENGINE_HISTORY = 1024
"""Records the outer gradients' engine keeps (one per synchronization)."""

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SyncStepStats(StepStats):
    """An inner step of a synchronizer: what the synchronizations that landed in it cost, as a DDP
    hook's step (:class:`~gradcomp.engine.stats.StepStats`, ``buckets`` counting the engine's calls),
    and what only synchronizations have. Steps without one count zeros."""

    exposed_s: float = 0.0
    """Seconds the training thread waited for the synchronizations to land."""
    synchronized: int = 0
    """Fragments that landed (each applied with its outer step, or skipped)."""
    skipped: int = 0
    """Outer steps skipped for a non-finite average."""

    def phases(self) -> dict[str, float | None]:
        """As a hook's, and ``exposed``."""
        return {**super().phases(), "exposed": self.exposed_s}


@dataclasses.dataclass
class _InFlight:
    """A fragment's synchronization between its start and its landing."""

    fragment: int
    lands: int
    """The inner step after which it is applied."""
    handle: Handle[Tensor] | None
    """The engine's operation; None for one restored from a checkpoint (its average already there)."""
    average: Tensor | None = None
    number: int | None = None
    """The engine's step when the call was made (the number its record carries), None when restored."""


class Synchronizer(TrainingHookState):
    """Local SGD or DiLoCo over a group: every rank holds a full replica of ``model``. Statistics,
    traces, checkpoints and the error as a hook's state (:class:`~gradcomp.state.TrainingHookState`).

    Args:
        model: this rank's replica (not wrapped in DDP: nothing communicates per step). Its trainable
            parameters synchronize; its buffers (batch-norm statistics) stay each rank's own. At
            construction every rank takes rank 0's parameters and buffers, as DDP does.
        sync: a sync spec (:class:`~gradcomp.sync.spec.SyncSpec` or its text): ``"localsgd:every=8"``,
            ``"diloco:every=50,fragments=4,delay=2"``.
        spec: the hook spec the outer gradients travel by (``"allreduce"``, ``"quantize:bits=4,ef=true"``,
            any compressor, with ``algo`` and ``seed``).
        optimizer: the inner optimizer: a replica that diverged restarts its state too (AdamW's
            moments, which would otherwise stay NaN); needed when the sync spec averages its state
            (``state=true``).
        group: the ranks to synchronize (default: the world).
        timeout: what any collective may take before it fails (a frozen or dead peer); default: the
            group's own.
        history: how many steps of statistics (:meth:`steps`) to keep, the latest.

    A non-finite outer gradient (a replica diverged) skips that fragment's outer step, on every rank
    alike (they all see the same average): the global parameters and the outer momentum stay as they
    were, every replica restarts the fragment from them, and a replica holding a non-finite value
    anywhere restarts whole, with a fresh inner optimizer state.
    """

    def __init__(
        self,
        model: nn.Module,
        sync: SyncSpecLike,
        spec: HookSpecLike = "allreduce",
        *,
        optimizer: torch.optim.Optimizer | None = None,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | float | None = None,
        history: int = 10_000,
    ) -> None:
        timeout = as_timeout(timeout)  # a number of seconds, or refused here
        self._configure(model, sync, spec, optimizer, group)
        self.engine = Engine(self.spec, group=group, timeout=timeout, history=ENGINE_HISTORY)
        self._state_engine = Engine("allreduce", group=group, timeout=timeout) if self.sync.state else None
        self.world = self.engine.world
        self._keep(self._first_globals(model, self._dtype), history)

    def _configure(
        self,
        model: nn.Module,
        sync: SyncSpecLike,
        spec: HookSpecLike,
        optimizer: torch.optim.Optimizer | None,
        group: dist.ProcessGroup | None,
    ) -> None:
        """The specs parsed and checked, and the model's tensors in fragments: before any collective."""
        self.sync = SyncSpec.parse(sync)
        self.spec = HookSpec.parse(spec)
        rules.check(self.spec, rules.Surface.SYNC)
        self._refuse(model, optimizer, group)
        self.optimizer = optimizer
        self.model = model
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("the model has no trainable parameters to synchronize")
        if not all(p.is_floating_point() for p in self.parameters):
            raise TypeError("parameters must be floating-point to be averaged")
        self.tensors = [local(p) for p in self.parameters]
        """What synchronizes of each parameter: the parameter, or this rank's shard of a sharded one
        (FSDP2's, sharded over a node: the ranks of ``group`` hold the same shard of every node's replica)."""
        self.fragments = fragments.split([t.numel() for t in self.tensors], self.sync.fragments)
        self.error: BaseException | None = None
        """The error that failed a synchronization (a :class:`gradcomp.errors.PeerError` names the peer)."""
        self._dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.parameters) else torch.float32

    def _keep(self, globals_: list[Tensor], history: int) -> None:
        """The first global parameters kept, with the outer optimizers and buffers made for them, and
        ``history`` steps of statistics."""
        dtype = self._dtype
        self.globals = globals_
        """The last synchronized parameters, bitwise the same on every rank (float32, or float64)."""
        self.outer = [self._outer([self.globals[i] for i in members]) for members in self.fragments]
        self._buffers = [
            torch.empty(sum(self.tensors[i].numel() for i in members), dtype=dtype, device=self.tensors[0].device)
            for members in self.fragments
        ]
        if self.spec.compressor is not None:  # its fused kernels, before the first synchronization
            fusion.precompile(self.spec.compressor, dtype, self.tensors[0].device)
        self.steps_done = 0
        """Inner steps so far (carried over by a checkpoint)."""
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._stats: collections.deque[SyncStepStats] = collections.deque(maxlen=history)
        self._steps_here = 0  # step() calls in this process (statistics count from 0, also on resume)
        _made[:] = [made for made in _made if made() is not None]
        _made.append(weakref.ref(self))  # flushed at interpreter exit if still in flight then (_flush_at_exit)

    def _refuse(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, group: dist.ProcessGroup | None
    ) -> None:
        """What no synchronizer can do with these arguments, refused before any collective."""
        if self.sync.local_size > 1 and group is None:
            raise ValueError(
                "local_size: a replica per node synchronizes across nodes; give the group of the local rank j of "
                "every node (gradcomp.collectives.hierarchical.subgroups, docs/local-sgd.md)"
            )
        if self.sync.state and optimizer is None:
            raise ValueError("state=true averages the inner optimizer's state: pass the optimizer")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise TypeError(
                "the model is wrapped in DistributedDataParallel, which averages every step's gradients: with a "
                "synchronizer the run would communicate twice; give it the plain module (model.module), unwrapped"
            )

    def _outer(self, globals_: list[Tensor]) -> torch.optim.SGD:
        """A fragment's outer optimizer: SGD on its global parameters, with the spec's momentum."""
        sync = self.sync
        return torch.optim.SGD(globals_, lr=sync.outer_lr, momentum=sync.momentum, nesterov=sync.nesterov)

    def _first_globals(self, model: nn.Module, dtype: torch.dtype) -> list[Tensor]:
        """Every rank checked to run the same specs, given rank 0's parameters and buffers (one start
        on every rank, as DDP's), and the global parameters made from them."""
        check_same_spec(f"{self.sync} over {self.spec}", self.engine.group, self.tensors[0].device)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                collectives.broadcast(local(tensor.detach()), 0, group=self.engine.group)
        return [t.detach().to(dtype, copy=True) for t in self.tensors]

    # -- the training loop's calls ---------------------------------------------------------------

    def step(self) -> None:
        """Call after every inner optimizer step, on every rank: starts the fragments due after this
        step and applies the synchronizations that land now (waiting for them if they have not)."""
        self.steps_done += 1
        with self._keeping_error():
            for fragment in self._due(self.steps_done):
                self._start(fragment)
            landed = self._land_until(self.steps_done)
        self._record(*landed, new_step=True)

    def flush(self) -> None:
        """Apply every synchronization still in flight now (waiting for it), counted in the latest
        step's statistics: at the end of training, so that the global parameters hold every
        synchronization started."""
        with self._keeping_error():
            landed = self._land_until(None)
        self._record(*landed, new_step=not self._stats)

    def _due(self, step: int) -> list[int]:
        """The fragments whose synchronization starts after inner step ``step``: those of the schedule's
        step, or with ``early`` of the step ``delay`` later."""
        scheduled = step + self.sync.delay if self.sync.early else step
        return fragments.due(scheduled, self.sync.every, self.sync.fragments)

    @contextlib.contextmanager
    def _keeping_error(self) -> Iterator[None]:
        """Keep the first error that fails a synchronization in :attr:`error` (later ones follow from it)."""
        try:
            yield
        except BaseException as error:
            self.error = self.error or error
            raise

    @property
    def in_flight(self) -> int:
        """Synchronizations started and not landed yet."""
        return len(self._in_flight)

    @contextlib.contextmanager
    def global_model(self) -> Iterator[nn.Module]:
        """The model with the global parameters (the same on every rank) for the ``with`` block, then
        its own again: what to evaluate, or to save as the trained model."""
        saved = [t.detach().clone() for t in self.tensors]
        with torch.no_grad():
            for t, g in zip(self.tensors, self.globals, strict=True):
                t.copy_(g)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for t, s in zip(self.tensors, saved, strict=True):
                    t.copy_(s)

    # -- one synchronization ------------------------------------------------------------------

    def _outer_gradient(self, fragment: int) -> tuple[Tensor, list[int], list[torch.Size]]:
        """The fragment's outer gradient (its global parameters minus the local ones) in its send
        buffer, with its tensors' indices and shapes."""
        buffer, members = self._buffers[fragment], self.fragments[fragment]
        with torch.no_grad():
            for i, view in zip(members, self._views(buffer, members), strict=True):
                torch.sub(self.globals[i], self.tensors[i].detach(), out=view)
        return buffer, members, [self.tensors[i].shape for i in members]

    def _start(self, fragment: int) -> None:
        """The fragment's outer gradient to the engine (compressed here, sent on the executor)."""
        buffer, members, shapes = self._outer_gradient(fragment)
        number = self.engine.steps_done  # every call is a step of the engine's clock: its record's number
        handle = self.engine.reduce(buffer, members, shapes, bucket=fragment, last=True)
        self.engine.end_step()
        lands = self.steps_done + self.sync.delay
        self._in_flight.append(_InFlight(fragment, lands, handle, number=number))

    def _land_until(self, step: int | None) -> tuple[list[BucketRecord], float, int, int]:
        """Apply the synchronizations that land by inner step ``step`` (None: all), in the order they
        started; returns their engine records, the seconds waited, and how many were applied and
        skipped."""
        records: list[BucketRecord] = []
        exposed, applied, skipped = 0.0, 0, 0
        while self._in_flight and (step is None or self._in_flight[0].lands <= step):
            waited, ok = self._land(self._in_flight.popleft(), records)
            exposed, applied, skipped = exposed + waited, applied + 1, skipped + (not ok)
        return records, exposed, applied, skipped

    def _land(self, flight: _InFlight, records: list[BucketRecord]) -> tuple[float, bool]:
        """Wait for ``flight``'s average, take the outer step and adopt it; returns the seconds waited
        and whether the step was taken (not skipped for a non-finite average)."""
        began = time.perf_counter()
        average = self._average(flight)
        waited = time.perf_counter() - began
        records += self._records_of(self.engine, flight.number)
        return waited, self._apply(flight.fragment, average, records)

    def _apply(self, fragment: int, average: Tensor, records: list[BucketRecord]) -> bool:
        """The fragment's outer step on its ``average`` outer gradient, adopted by the replica (keeping
        ``mix`` of its own); returns whether the step was taken (not skipped for a non-finite average)."""
        members = self.fragments[fragment]
        finite = bool(torch.isfinite(average).all())
        if finite:
            for i, view in zip(members, self._views(average, members), strict=True):
                self.globals[i].grad = view
            self.outer[fragment].step()
            self.outer[fragment].zero_grad(set_to_none=True)
        else:
            logger.warning(
                "step %d: fragment %d's averaged outer gradient is not finite; its outer step is skipped",
                self.steps_done, fragment,
            )  # fmt: skip
        keep = self.sync.mixing if finite else 0.0
        with torch.no_grad():
            for i in members:
                p, g = self.tensors[i], self.globals[i]
                if keep == 0:
                    p.copy_(g)
                else:  # keep * own + (1 - keep) * global
                    p.lerp_(g.to(p.dtype), 1 - keep)
        if not finite:
            self._restart_if_diverged()
        if self._state_engine is not None:
            self._average_optimizer_state(members, records)
        return finite

    def _restart_if_diverged(self) -> None:
        """After a skipped outer step: a replica that holds a non-finite value anywhere (its other
        fragments, its inner optimizer's state: AdamW's moments) restarts whole from the global
        parameters, with a fresh inner optimizer state, so that the NaN of one step costs that step
        and not the rest of the run (a replica restarted in one fragment only would poison it again
        from the others). The others keep their own. Host reads: only here, after a skipped step."""
        states = [] if self.optimizer is None else [self.optimizer.state.get(p, {}) for p in self.parameters]
        values = [*self.tensors, *(local(v) for state in states for v in state.values())]
        checks = [torch.isfinite(v).all() for v in values if isinstance(v, Tensor) and v.is_floating_point()]
        if bool(torch.stack(checks).all()):
            return
        logger.warning(
            "step %d: this replica holds non-finite values: it restarts from the global parameters%s",
            self.steps_done, "" if self.optimizer is not None else
            " (its inner optimizer's state stays as it is: pass optimizer= to restart it too)",
        )  # fmt: skip
        with torch.no_grad():
            for t, g in zip(self.tensors, self.globals, strict=True):
                t.copy_(g)
        if self.optimizer is not None:
            for p in self.parameters:
                self.optimizer.state.pop(p, None)  # made anew at its next step (AdamW's moments at zero)

    def _average_optimizer_state(self, members: list[int], records: list[BucketRecord]) -> None:
        """The inner optimizer's per-parameter tensors (momentum, Adam's moments) of ``members``,
        averaged over the group uncompressed (every rank holds the same kinds: the same optimizer)."""
        assert self.optimizer is not None and self._state_engine is not None
        tensors = []
        for i in members:
            state = self.optimizer.state.get(self.parameters[i], {})
            entries = [local(state[k]) for k in sorted(state)]
            tensors += [entry for entry in entries if _averageable(entry, self.tensors[i])]
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._state_engine.reduce(flat, None, None, last=True).wait()
        self._state_engine.end_step()
        records.append(self._state_engine.records[-1])
        for t, average in zip(tensors, views(flat, [t.shape for t in tensors]), strict=True):
            t.copy_(average)

    # -- statistics ---------------------------------------------------------------------------

    def steps(self) -> list[SyncStepStats]:
        """Per inner step of this process (counted from 0): what the synchronizations applied in it
        cost, as a DDP hook's steps are reported (``input_bytes``, ``payload_bytes``, ``sent_bytes``,
        ``compress_s``, ``communicate_s``, ``decompress_s``, ...), plus ``exposed_s`` (the time the
        training thread waited for them), ``synchronized`` (fragments applied) and ``skipped`` (outer
        steps skipped for a non-finite average): :class:`SyncStepStats`. Steps without one count
        zeros; a checkpoint taken with synchronizations in flight adds an entry of its own for their
        transfers (:meth:`state_dict`)."""
        return self.steps_since(0)

    def steps_since(self, first: int) -> list[SyncStepStats]:
        """:meth:`steps` from step ``first`` on."""
        return newest(self._stats, first)

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """A Chrome / Perfetto JSON trace of every recorded synchronization (one bucket per fragment:
        when it started, its wait on the executor, and its compress / communicate / decompress phases)."""
        write_trace(self.engine.records, path, dist.get_rank(self.engine.group))

    def _record(self, records: list[BucketRecord], exposed: float, applied: int, skipped: int, new_step: bool) -> None:
        """The statistics of a step, or added to the latest step's (``new_step`` False: a flush)."""
        if new_step:
            self._stats.append(SyncStepStats.zero(self._steps_here))
            self._steps_here += 1
        entry = self._stats[-1]
        for summed in per_step(dataclasses.replace(r, step=entry.step) for r in records):  # one step, or none
            entry += summed
        self._stats[-1] = entry + SyncStepStats(
            entry.step, exposed_s=exposed, synchronized=applied, skipped=skipped, intra_node_bytes=0.0
        )

    @staticmethod
    def _records_of(engine: Engine, number: int | None) -> list[BucketRecord]:
        if number is None:  # restored from a checkpoint: its transfer happened before
            return []
        return [r for r in reversed(engine.records) if r.step == number][:1]

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue bitwise (with each rank's own model and inner
        optimizer, which differ between synchronizations: save every rank's): the specs, the step,
        the global parameters, the outer optimizers, the compressor's state (residuals) and the
        averages of synchronizations still in flight (waited for here: their transfers are then
        counted in a statistics entry of their own, not when they land, so that a run resumed from
        this state counts every byte once). Tensors and plain values: loadable with
        ``torch.load(..., weights_only=True)``."""
        records: list[BucketRecord] = []
        for flight in self._in_flight:
            self._average(flight)
            records += self._records_of(self.engine, flight.number)
            flight.number = None
        if records:
            self._record(records, 0.0, 0, 0, new_step=True)
        return {
            "sync": str(self.sync),
            "spec": str(self.spec),
            "world_size": self.world,
            "steps_done": self.steps_done,
            "globals": [g.clone() for g in self.globals],
            "outer": [o.state_dict() for o in self.outer],
            "compressor": self.engine.compressor.state_dict(),
            "engine": self.engine.state_dict(),
            "in_flight": [
                {"fragment": f.fragment, "lands": f.lands, "average": self._average(f).clone()} for f in self._in_flight
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, from a synchronizer of the same specs and world
        size: anything else is refused, naming both."""
        if not isinstance(state, dict) or "sync" not in state:
            raise ValueError("not a synchronizer's state (it records no sync spec)")
        saved = (state["sync"], state["spec"], state["world_size"])
        mine = (str(self.sync), str(self.spec), self.world)
        if saved != mine:
            raise ValueError(
                f"this state was saved by {saved[0]} over {saved[1]} at world size {saved[2]}; "
                f"this synchronizer is {mine[0]} over {mine[1]} at world size {mine[2]}"
            )
        shapes = [tuple(t.shape) for t in state["globals"]]
        if shapes != [tuple(g.shape) for g in self.globals]:
            raise ValueError(
                f"this state is of another model: {len(shapes)} trainable tensors of shapes {_shapes(shapes)}; "
                f"this synchronizer's model has {len(self.globals)} of shapes "
                f"{_shapes([tuple(g.shape) for g in self.globals])}"
            )
        # what it carries must be finite; an average in flight may not be (its outer step is skipped)
        refuse_non_finite({k: state[k] for k in ("globals", "outer", "compressor")}, "this synchronizer's state")
        with torch.no_grad():
            for g, s in zip(self.globals, state["globals"], strict=True):
                g.copy_(s)
        for outer, saved_outer in zip(self.outer, state["outer"], strict=True):
            outer.load_state_dict(saved_outer)
        self.engine.compressor.load_state_dict(state["compressor"])
        self.engine.load_state_dict(state["engine"])
        self.steps_done = int(state["steps_done"])
        device = self.globals[0].device
        self._in_flight = collections.deque(
            _InFlight(int(f["fragment"]), int(f["lands"]), None, f["average"].to(device)) for f in state["in_flight"]
        )

    def _average(self, flight: _InFlight) -> Tensor:
        """``flight``'s average, waited for once."""
        if flight.average is None:
            assert flight.handle is not None
            flight.average = flight.handle.wait()
        return flight.average

    def _views(self, flat: Tensor, members: list[int]) -> list[Tensor]:
        return views(flat, [self.tensors[i].shape for i in members])


class _Kind(Synchronizer):
    """A synchronizer of one kind, its options as keywords."""

    kind: str

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        spec: HookSpecLike = "allreduce",
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(model, (self.kind, options), spec, optimizer=optimizer, group=group, timeout=timeout)


class LocalSGD(_Kind):
    """Local SGD: every ``every`` steps the replicas are replaced by their average (through ``spec``:
    the average of what changed since the last one, so a compressor with error feedback applies).

    >>> sync = LocalSGD(model, every=8)                        # then sync.step() after each optimizer step

    Options (``every``, ``fragments``, ``delay``, ``mix``, ``state``) as :class:`SyncSpec`'s.
    """

    kind = "localsgd"


class DiLoCo(_Kind):
    """DiLoCo (Douillard et al., 2023), and Streaming DiLoCo with ``fragments`` and ``delay``.

    >>> sync = DiLoCo(model, inner, every=50, spec="quantize:bits=4,ef=true", fragments=4, delay=2)

    Options (``every``, ``outer_lr``, ``momentum``, ``nesterov``, ``fragments``, ``delay``, ``mix``,
    ``state``) as :class:`SyncSpec`'s; the defaults are the paper's (outer Nesterov SGD, lr 0.7,
    momentum 0.9).
    """

    kind = "diloco"


SETTLE_S = 0.05
"""How long the exit flush waits for the backend's threads to free what its collectives held."""

_made: list[weakref.ref[Synchronizer]] = []
"""Every synchronizer of the process, in the order made (the same on every rank), while it lives."""


@atexit.register
def _flush_at_exit() -> None:
    """A synchronization still in flight when the script ends lands now, while the interpreter and
    the process group are whole (every rank ends its script alike, so every rank flushes the same,
    in the order the synchronizers were made): left to interpreter exit, its collective would be
    torn down mid-way and abort the process. If the group is gone already (``destroy_process_group``
    before ``flush``), it cannot land: say so."""
    flushed = False
    for made in _made:
        synchronizer = made()
        if synchronizer is None or not synchronizer._in_flight or synchronizer.error is not None:
            continue
        if not dist.is_initialized():
            logger.warning("a synchronization was still in flight when the process group was destroyed: "
                           "call flush() before destroy_process_group()")  # fmt: skip
            continue
        try:
            synchronizer.flush()
            flushed = True
        except Exception as error:  # exit goes on; the cause is in the synchronizer's error
            logger.warning("flushing a synchronization at exit failed: %s", error)
    if flushed:
        # gloo's worker thread frees a finished collective's tensors just after completing it, and
        # needs the interpreter's lock to drop their Python objects: were the interpreter finalizing
        # by then, that thread would be ended mid-way and the process abort ("terminate called
        # without an active exception"). Waiting here, the lock released, lets it finish first.
        time.sleep(SETTLE_S)


def _shapes(shapes: list[tuple[int, ...]], most: int = 6) -> str:
    """Shapes in a message: the first few, and how many more."""
    shown = ", ".join(str(list(shape)) for shape in shapes[:most])
    return shown + (f", ... ({len(shapes) - most} more)" if len(shapes) > most else "")


def local(value: Any) -> Any:
    """This rank's shard of a sharded tensor (a DTensor: FSDP2's parameters and their optimizer
    state), any other value as it is. Under ``no_grad`` a shard is the DTensor's own storage."""
    if DTensor is not None and isinstance(value, DTensor):
        with torch.no_grad():
            return value.to_local()
    return value


def _averageable(value: Any, parameter: Tensor) -> bool:
    """An optimizer state entry that is per element of its parameter (not a step count)."""
    return isinstance(value, Tensor) and value.is_floating_point() and value.shape == parameter.shape
