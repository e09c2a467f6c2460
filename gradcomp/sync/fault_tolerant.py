"""Local SGD and DiLoCo on torchft's fault-tolerant replica groups (``pip install gradcomp[torchft]``).

torchft (``pytorch/torchft``) trains replica groups that join a quorum through a lighthouse; when a
group dies the others go on in a smaller quorum, and a restarted group heals from a live one. Here
gradcomp's synchronizers run on its ``Manager``: the outer gradients travel through any gradcomp
compressor on the manager's own process group, and a quorum is held at each synchronization only
(between them nothing communicates, as with torchft's own ``DiLoCo``):

>>> manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1, use_async_quorum=False, ...)
>>> outer = fault_tolerant.DiLoCo(manager, model, inner, every=50, spec="quantize:bits=4,ef=true")
>>> for batch in data:
...     loss(model, batch).backward(); inner.step(); inner.zero_grad()
...     outer.step()                                          # after every inner step

The schedule is torchft's: a synchronization every ``every / fragments`` inner steps, of the fragment
the manager's step count (its commits) names modulo ``fragments``, read once the quorum is formed,
so that a group healed at that quorum picks the one the others pick. It starts (the quorum, then the
outer gradient to the engine) and lands ``delay`` steps later, or with ``early=true`` starts ``delay``
steps before its step and lands on it (torchft's own timing). When it lands, the manager says whether
every group's synchronization succeeded (``should_commit``): if so, the outer step as
:class:`~gradcomp.sync.Synchronizer`'s; if not (a peer died, a collective failed: reported to the
manager), the fragment's parameters go back to its global ones, the inner steps since they were
last synchronized are lost (as in torchft), and the next synchronization tries the same fragment
again (the step count did not move).

State on a failure: the global parameters and the outer optimizers are registered with the manager
(key ``gradcomp_sync``): a restarted group heals them, with the model and inner optimizer the
training script registers, from a live group at the quorum it joins. Error feedback's residuals are
a group's own unsent outer gradients: a healed group starts without them, and across quorums of
other sizes they are carried (:class:`~gradcomp.engine.quorum.QuorumEngine`). The engine is made
again on every group alike: when the quorum changes, and when any group saw a failure or restarted
(one small all-reduce at each synchronization's start says so), so that a stateful compressor's
state (PowerSGD's warm starts) never differs between groups.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradcomp.collectives.groups import rank_of
from gradcomp.compressors.finite import refuse_non_finite
from gradcomp.engine import HookSpecLike
from gradcomp.engine.quorum import QuorumEngine, agreed
from gradcomp.engine.stats import BucketRecord, write_trace
from gradcomp.sync.spec import SyncSpecLike
from gradcomp.sync.synchronizer import ENGINE_HISTORY, Synchronizer, _InFlight

STATE_KEY = "gradcomp_sync"
"""The key the synchronizer's state is registered under with the manager (healing)."""


class FaultTolerantSynchronizer(Synchronizer):
    """Local SGD or DiLoCo over torchft's replica groups (the module's notes): every replica group
    holds a full replica of ``model``; call :meth:`step` after each inner step.

    Args:
        manager: torchft's ``Manager``, made with ``use_async_quorum=False`` (a group healed at a
            synchronization's quorum takes part in it, as torchft's ``DiLoCo`` requires). The model
            and inner optimizer are the training script's to register with it (what a healed group
            fetches); this registers its own state.
        model, sync, spec, optimizer, history: as :class:`~gradcomp.sync.Synchronizer`'s; ``every``
            a multiple of ``fragments``, a ``delay`` below ``every / fragments`` (one quorum at a
            time), no ``state`` averaging nor ``local_size``.
        group: the process group the manager reconfigures (default: the manager's own).
    """

    def __init__(
        self,
        manager: Any,
        model: nn.Module,
        sync: SyncSpecLike,
        spec: HookSpecLike = "allreduce",
        *,
        optimizer: torch.optim.Optimizer | None = None,
        group: Any = None,
        history: int = 10_000,
    ) -> None:
        self.manager = manager
        self.group = group if group is not None else manager._pg  # the group the manager configures per quorum
        self._configure(model, sync, spec, optimizer, None)
        self._refuse_for_torchft()
        self.engines = QuorumEngine(self.spec, self.group, history=ENGINE_HISTORY)
        self._state_engine = None  # state=true is refused here
        self.world = 0
        """Replica groups in the last synchronization's quorum (0 before the first)."""
        self.failures = 0
        """Synchronizations not committed (a peer lost, a collective failed)."""
        with torch.no_grad():  # every group starts from its own: seed alike, or let the manager heal
            self._keep([t.detach().to(self._dtype, copy=True) for t in self.tensors], history)
        self._period = self.sync.every // self.sync.fragments
        self._since_start = self.sync.delay if self.sync.early else 0  # the first start after period - this
        manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    def _refuse_for_torchft(self) -> None:
        sync = self.sync
        if getattr(self.manager, "_use_async_quorum", False):
            raise ValueError("the manager must be made with use_async_quorum=False: a group healed at a "
                             "synchronization's quorum takes part in it with the state it fetched")  # fmt: skip
        if sync.every % sync.fragments:
            raise ValueError(f"every ({sync.every}) must be a multiple of fragments ({sync.fragments}): on torchft a "
                             f"synchronization comes every every / fragments steps")  # fmt: skip
        if sync.delay >= sync.every // sync.fragments:
            raise ValueError(
                f"delay={sync.delay}: torchft's manager holds one quorum at a time, so a synchronization lands "
                f"before the next starts: use a delay below every / fragments ({sync.every // sync.fragments})"
            )
        if sync.state or sync.local_size:
            raise ValueError(
                "state and local_size are not supported on torchft: its quorum is of whole replica groups, and a "
                "group's inner optimizer state heals from a peer as the script registers it"
            )
        if self.spec.local_size > 1:
            raise ValueError("local_size makes node groups, which torchft's reconfigured group cannot carry")

    # -- the schedule -------------------------------------------------------------------------

    @property
    def phase(self) -> int:
        """Inner steps since the last synchronization started (before the first: counted so that it
        starts on time). The same on every group in a quorum: a restarted group falls in step at
        the quorum it joins."""
        return self._since_start

    def step(self) -> None:
        """Call after every inner step: starts a synchronization every ``every / fragments`` steps
        (its quorum first: this is where a lost group is noticed and a restarted one heals) and lands
        the one due now."""
        self.steps_done += 1
        self._since_start += 1
        with self._keeping_error():
            if self._since_start == self._period:
                self._since_start = 0
                self._start_in_quorum()
            landed = self._land_until(self.steps_done)
        self._record(*landed, new_step=True)

    def _start_in_quorum(self) -> None:
        """The quorum (healing this group if it joins late), then the outer gradient of the fragment
        it names to the engine; a failure is the manager's to know (the synchronization then fails
        on every group)."""
        manager = self.manager
        manager.start_quorum()
        fragment = manager.current_step() % self.sync.fragments
        lands = self.steps_done + self.sync.delay
        try:
            if self._any_restarts():
                self.engines.restart()
            engine = self.engines.current(renew=True)
            self.engine, self.world = engine, engine.world
            buffer, members, shapes = self._outer_gradient(fragment)
            participating = manager.is_participating()
            if not participating:  # not in this step's participants: sends zeros
                buffer.zero_()
            self.engines.remember(members, shapes)
            if self.engines.pending and participating:
                self.engines.add_pending(buffer, members, shapes)
            number = engine.steps_done
            handle = engine.reduce(buffer, members, shapes, bucket=fragment, last=True)
            engine.end_step()
        except Exception as error:  # a peer died: the commit fails everywhere
            self._failed(error)
            self._in_flight.append(_InFlight(fragment, lands, None))
            return
        self._in_flight.append(_InFlight(fragment, lands, handle, number=number))

    def _land(self, flight: _InFlight, records: list[BucketRecord]) -> tuple[float, bool]:
        """Wait for the average, ask the manager whether every group's synchronization succeeded, and
        take the outer step if so; else the fragment goes back to its global parameters."""
        began = time.perf_counter()
        average = None
        if flight.handle is not None:
            try:
                average = self._average(flight)
            except Exception as error:
                self._failed(error)
        waited = time.perf_counter() - began
        if flight.number is not None:
            records += self._records_of(self.engine, flight.number)
        manager = self.manager
        if not manager.should_commit() or average is None:
            self.failures += 1
            with torch.no_grad():
                for i in self.fragments[flight.fragment]:
                    self.tensors[i].copy_(self.globals[i])
            return waited, False
        participants = manager.num_participants()
        if participants and participants != self.world:  # groups outside the participants sent zeros
            average.mul_(self.world / participants)
        return waited, self._apply(flight.fragment, average, records)

    def _failed(self, error: BaseException) -> None:
        self.error = error
        self.engines.restart()  # on every rank at the next start (_any_restarts)
        self.manager.report_error(error)

    def _any_restarts(self) -> bool:
        """Whether any group restarts its engine at this synchronization (one that saw a failure, or
        has none yet: it restarted): then every group does, so that their compressors' state stays
        alike (PowerSGD's warm starts, warm-up counts). One small all-reduce per synchronization,
        through the ordered executor (a synchronization in flight may be using the group)."""
        mine = float(self.engines.engine is None or self.engines.restarting)
        return agreed([mine], dist.ReduceOp.MAX, self.group)[0] > 0

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a healed group fetches from a live one (and what a checkpoint keeps): the specs, the
        global parameters and the outer optimizers. Not the residuals (a group's own) nor a
        synchronization in flight (the manager heals only at a quorum, when none is)."""
        return {
            "sync": str(self.sync),
            "spec": str(self.spec),
            "globals": [g.clone() for g in self.globals],
            "outer": [o.state_dict() for o in self.outer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a live group's, when healing); another sync
        spec, hook spec or model is refused, naming both."""
        if not isinstance(state, dict) or "sync" not in state:
            raise ValueError("not a synchronizer's state (it records no sync spec)")
        saved, mine = (state["sync"], state["spec"]), (str(self.sync), str(self.spec))
        if saved != mine:
            raise ValueError(f"this state was saved by {saved[0]} over {saved[1]}; this synchronizer is {mine[0]} "
                             f"over {mine[1]}")  # fmt: skip
        shapes = [tuple(t.shape) for t in state["globals"]]
        if shapes != [tuple(g.shape) for g in self.globals]:
            raise ValueError(f"this state is of another model: shapes {shapes[:6]}, not "
                             f"{[tuple(g.shape) for g in self.globals][:6]}")  # fmt: skip
        refuse_non_finite(state, "this synchronizer's state")
        with torch.no_grad():
            for g, s in zip(self.globals, state["globals"], strict=True):
                g.copy_(s)
        for outer, saved_outer in zip(self.outer, state["outer"], strict=True):
            outer.load_state_dict(saved_outer)

    def write_trace(self, path: Any) -> None:
        """A Chrome / Perfetto JSON trace of every recorded synchronization, across quorums."""
        write_trace(self.engines.records, path, rank_of(self.group))


class _Kind(FaultTolerantSynchronizer):
    kind: str

    def __init__(
        self,
        manager: Any,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        spec: HookSpecLike = "allreduce",
        group: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(manager, model, (self.kind, options), spec, optimizer=optimizer, group=group)


class LocalSGD(_Kind):
    """Local SGD on torchft's manager: ``LocalSGD(manager, model, inner, every=8, spec=...)``."""

    kind = "localsgd"


class DiLoCo(_Kind):
    """DiLoCo (and Streaming DiLoCo) on torchft's manager: ``DiLoCo(manager, model, inner, every=50,
    fragments=2, delay=1, early=True, spec="quantize:bits=4,ef=true")``."""

    kind = "diloco"

