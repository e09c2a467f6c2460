"""``auto`` on torchft's replica groups: it measures and chooses as on DDP, and follows the quorum.

::

    model = fault_tolerant.DistributedDataParallel(manager, module, "auto")

The hook measures and decides as the ``auto`` hook does (:mod:`gradcomp.hooks.auto`): uncompressed
steps while it records the compute, then at step ``measure_at`` the link, the candidates' kernels and
the engine on the quorum's group, a choice per bucket broadcast by the group's rank 0, rechecks. On
torchft's groups three things differ, so that every rank of a quorum keeps doing the same:

- **Engines per quorum.** Each candidate's engine is made again when the quorum's group changes or
  state starts anew on every rank (:class:`~gradcomp.engine.quorum.Restarts`: the last step
  committed nowhere, or a group heals in this step). What error feedback had not sent yet is carried
  over (added to the tensor's next gradient), as for a single compressor
  (:mod:`gradcomp.engine.quorum`).
- **The decision travels to a healing group.** In those same steps the lowest-ranked group taking
  part sends the decision (the candidate of every tensor, the hook's step, when it measured and what
  it predicted, whether a measurement is due) to every rank, before any bucket is averaged: a group
  that restarted, or fell behind, averages with the others' candidates from its first step (torchft
  loads its model and optimizer only once that step's backward is over). Two small all-reduces.
- **Measuring waits for the whole quorum.** A measurement falls due only in a step every group takes
  part in (else at the next such step), and starts only once every rank has seen a whole step with
  these buckets (one small all-reduce: a healed group has no timings of its own yet).

A measurement that fails (a peer died during the probes) is a failed step like any other: reported
to the manager, discarded, and measured again at the next step the whole quorum takes part in.
Costs: as ``auto``'s, plus the two all-reduces in the steps where state starts anew and one before
each measurement; a group's start compiles every candidate's fused kernels (so that a rejoining
group does not make the others wait on its first step), seconds per candidate. A checkpoint of the
state (``state_dict``) holds the decision, not the residuals: a resumed job goes on with it.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket

from gradcomp.collectives.executor import Handle
from gradcomp.collectives.groups import rank_of, size_of
from gradcomp.engine import Engine
from gradcomp.engine.quorum import RECORDS_KEPT, Restarts, agreed, configuration_of, take_residuals
from gradcomp.engine.stats import BucketRecord, StepStats, per_step
from gradcomp.flat import views
from gradcomp.hooks.auto import AutoState
from gradcomp.hooks.auto_spec import AutoSpec


class FaultTolerantAutoState(AutoState):
    """``auto``'s state on torchft's ``manager`` and its reconfigured ``group`` (the module's notes);
    ``parameters``: how many parameters the model has (the decision's length)."""

    def __init__(self, manager: Any, spec: AutoSpec, group: Any, parameters: int) -> None:
        if spec.local_size > 1:
            raise ValueError("local_size makes node groups, which torchft's reconfigured group cannot carry")
        self._start(spec, link=None)
        self.manager, self.group, self._parent, self._timeout = manager, group, group, None
        self._nodes = None
        self.parameters = parameters
        self.world, self.rank = 0, 0  # read from the group at each quorum (it is configured then)
        self.engines: list[Engine] = []
        self.restarts = Restarts(manager, group)
        self._made_for: tuple[int, int, int] | None = None
        self._records: collections.deque[BucketRecord] = collections.deque(maxlen=RECORDS_KEPT)
        self.quorums = 0
        """How many times the candidates' engines were made: per quorum group, and per restart."""
        self.resyncs = 0
        """How many times the decision was sent round (as often: steps where state started anew)."""

    # -- what the fault-tolerant hook calls ------------------------------------------------------

    def average(self, bucket: GradBucket, buffer: Tensor, participating: bool) -> tuple[Handle[Tensor], int]:
        """``buffer`` (the bucket's) averaged by the candidates chosen for its tensors: its handle, and
        the world size it averages over."""
        if bucket.index() == 0:
            self._begin_step()
        return self._average(bucket, buffer, flush=participating), self.world

    def failed(self, error: BaseException) -> None:
        """A step's averaging (or measuring) failed here: reported to the manager, which discards the
        step. A measurement cut short stays due (nothing it would have set was set): it is made again
        at the next step the whole quorum takes part in."""
        self.error = error
        self.manager.report_error(error)

    # -- quorums ---------------------------------------------------------------------------------

    def _begin_step(self) -> None:
        """At a step's first bucket: engines made again and the decision sent round where due."""
        restart = self.restarts.due()
        configuration = configuration_of(self.group)
        if restart or configuration != self._made_for:
            self._renew(configuration)
            self._resync()

    def _renew(self, configuration: tuple[int, int, int]) -> None:
        """Every candidate's engine made again on the group as it is; what their error feedback had
        not sent yet carried into the tensors' next gradients."""
        shapes = self._known_shapes()
        for engine in self.engines:
            self._records.extend(engine.records)
            take_residuals(engine, shapes, self.pending)
        self.world, self.rank = size_of(self.group), rank_of(self.group)
        self.engines = [Engine(c, group=self.group, own_group=False) for c in self.candidates]
        self._made_for = configuration
        self.quorums += 1

    def _resync(self) -> None:
        """The decision of the lowest-ranked participating group, on every rank (two all-reduces:
        who sends, then its values, every other rank adding zeros: exact)."""
        mine = self.rank if self.manager.is_participating() else self.world
        source = int(agreed([mine], dist.ReduceOp.MIN, self.group)[0])
        decision = self._decision()
        self._adopt(agreed(decision if self.rank == source else [0.0] * len(decision), dist.ReduceOp.SUM, self.group))
        self.resyncs += 1

    def _decision(self) -> list[float]:
        """What every rank must hold alike, as numbers: the hook's step, when it measured (-1: not
        yet), whether a measurement is due, the prediction (-1: none), the unfitted measurements in
        a row, and every tensor's candidate."""
        return [
            float(self.step),
            float(-1 if self.measured_at is None else self.measured_at),
            float(self._measure_next),
            float(-1 if self.predicted_s is None else self.predicted_s),
            float(self._unfitted),
            *(float(self.choice.get(key, 0)) for key in range(self.parameters)),
        ]  # fmt: skip

    def _adopt(self, decision: list[float]) -> None:
        """Take :meth:`_decision`'s numbers (another rank's, or a checkpoint's)."""
        step, measured_at, measure_next, predicted, unfitted, *choice = decision
        self.step, self._measure_next, self._unfitted = int(step), bool(measure_next), int(unfitted)
        self.measured_at = None if measured_at < 0 else int(measured_at)
        self.predicted_s = None if predicted < 0 else predicted
        self._install({key: int(c) for key, c in enumerate(choice)})

    # -- measuring -------------------------------------------------------------------------------

    def _measuring_now(self) -> bool:
        """As ``auto``'s, with the first measurement due by the step alone: whether this rank has
        seen a whole step yet is agreed when it starts (:meth:`_measure_and_decide`)."""
        if self._measure_next or self.measured_at is not None:
            return super()._measuring_now()
        return self.step >= self.spec.measure_at

    def _end_of_step(self) -> None:
        if self._measuring_now() and self.manager.num_participants() < self.world:
            self._measure_next = True  # a healing group's gradients are zeros: measure with the whole quorum
            return
        super()._end_of_step()

    def _measure_and_decide(self) -> None:
        """``auto``'s, once every rank has seen a whole step with these buckets (else at the next step)."""
        copies = set(self._copies)
        ready = (self.compute is not None and set(self.order) == copies) or any(
            set(t.handed) == copies for t in self._whole_steps()
        )
        if agreed([float(ready)], dist.ReduceOp.MIN, self.group)[0] < 1:
            self._measure_next = True
            return
        super()._measure_and_decide()

    # -- residuals in units of the gradient (the world size changes between quorums) -------------

    def _install(self, choice: dict[int, int]) -> None:
        """``auto``'s: a tensor leaving a candidate takes what that candidate had not sent yet into
        its next gradient, here in the units of the gradient, added to what it holds already
        (residuals of an earlier quorum's engines too); for the tensors this rank has seen (a group
        healed or resumed takes the decision before its first bucket, its engines holding nothing)."""
        shapes = self._known_shapes()
        for key, new in choice.items():
            old = self.choice.get(key, 0)
            if old != new and key in shapes:
                take_residuals(self.engines[old], {key: shapes[key]}, self.pending)
        self.choice = choice

    def _flush(self, buffer: Tensor, keys: list[int], shapes: list[torch.Size]) -> None:
        for key, part in zip(keys, views(buffer, shapes), strict=True):
            residual = self.pending.pop(key, None)
            if residual is not None:
                part.add_(residual.view_as(part))

    def _known_shapes(self) -> dict[int, torch.Size]:
        return {key: shape for keys, held in self._shapes.items() for key, shape in zip(keys, held, strict=True)}

    # -- statistics ------------------------------------------------------------------------------

    def steps_since(self, first: int) -> list[StepStats]:
        fresh = [r for r in [*self._records, *(r for e in self.engines for r in e.records)] if r.step >= first]
        return per_step(sorted(fresh, key=lambda r: (r.step, r.queued)))

    def state_dict(self) -> dict[str, Any]:
        """The decision (:meth:`_decision`): what a job resumed from a checkpoint starts with instead
        of measuring again. Not the residuals: a group's own unsent gradients, which start empty as a
        healed group's do. Not for the manager's state (``register_state_dict_fn``): the hook sends
        the decision to a healing group itself, before its step; torchft's copy would land after it."""
        return {"spec": str(self.spec), "decision": self._decision()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("spec") != str(self.spec):
            raise ValueError(f"this state is of {state.get('spec')!r}, not of this hook's {str(self.spec)!r}")
        self._adopt([float(v) for v in state["decision"]])
