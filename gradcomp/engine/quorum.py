"""An engine per quorum: gradcomp's engine on a process group that torchft reconfigures in place.

torchft's ``Manager`` configures one process group anew at each quorum (a replica group lost or
joined: another world size, other ranks). An engine's state is of its group (the ranks it exchanges
with, its learned capacities, its compressor's state), so :class:`QuorumEngine` makes a fresh
engine on that group when its configuration changed or the caller restarts it (after a step that
failed), at a point the caller chooses (a step's first bucket, a synchronization's start), and
carries over what error feedback
had not sent yet: each tensor's residual, taken from the old engine in units of the gradient over
the old world size, is added to the tensor's next input times that size, so that it reaches the
average once, whatever the new world size (as ``auto`` hands residuals between its candidates).
The rest of the compressor's state starts anew (momentum correction's velocities, EF21's estimates,
PowerSGD's warm starts, noise counters).

Used by :mod:`gradcomp.hooks.fault_tolerant` (DDP) and :mod:`gradcomp.sync.fault_tolerant`
(local SGD, DiLoCo); the engine runs with ``own_group=False`` (no private group of its ranks, which a
dead member would leave broken).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp.collectives.executor import executor
from gradcomp.collectives.groups import rank_of, size_of
from gradcomp.engine.pipeline import Engine
from gradcomp.engine.spec import HookSpec
from gradcomp.engine.stats import BucketRecord, StepStats, steps_since

Key = TypeVar("Key", bound=Hashable)

RECORDS_KEPT = 10_000
"""Records of earlier quorums' engines kept for statistics (the latest)."""


def take_residuals(engine: Engine, shapes: Mapping[Key, torch.Size], pending: dict[Key, Tensor]) -> None:
    """What ``engine`` had not sent yet of each tensor of ``shapes`` (its key's shape), times its
    world size (the units of the tensor's input, whatever the next engine's world size), added to
    ``pending``: to be added to the tensor's next input once."""
    for key, shape in shapes.items():
        residual = engine.take_residual(key, shape)
        if residual is not None:
            residual.mul_(engine.world)
            held = pending.get(key)
            pending[key] = residual if held is None else held.add_(residual)


def agreed(values: Sequence[float], op: Any, group: Any) -> list[float]:
    """``values`` (float64) all-reduced with ``op`` over ``group``, through the ordered executor: small
    host values every rank must agree on, in order with the engines' collectives on that group."""
    tensor = torch.tensor(list(values), dtype=torch.float64)

    def reduce() -> tuple[list[float], None]:
        dist.all_reduce(tensor, op=op, group=group)
        return tensor.tolist(), None

    return executor().submit(reduce, wait=True).wait()


def configuration_of(group: Any) -> tuple[int, int, int]:
    """What identifies the quorum ``group`` is configured for: its size, this rank, and the group
    inside (torchft makes another at each reconfiguration)."""
    return size_of(group), rank_of(group), id(getattr(group, "parent", group))


class QuorumEngine:
    """The engine of ``group``'s current configuration, made again when it changes.

    Args:
        spec: what the engines run (a flat group: no ``local_size``).
        group: the process group torchft's manager reconfigures (its ``ProcessGroupGloo``, or any
            group whose ``size()`` and rank answer for the current quorum).
        history: records each engine keeps (``Engine``'s).
    """

    def __init__(self, spec: HookSpec, group: Any, history: int = 10_000) -> None:
        self.spec, self.group, self.history = spec, group, history
        self.engine: Engine | None = None
        self.quorums = 0
        """How many engines have been made: one per quorum configuration averaged on, and one after
        each restart (1 while nothing changed)."""
        self.pending: dict[Hashable, Tensor] = {}
        """Per key, what an engine of an earlier quorum had not sent yet (times its world size), to be
        added to the tensor's next input (:meth:`add_pending`)."""
        self._made_for: tuple[int, int, int] | None = None
        self._restart = False
        self._records: collections.deque[BucketRecord] = collections.deque(maxlen=RECORDS_KEPT)
        self._shapes: dict[Hashable, torch.Size] = {}

    def restart(self) -> None:
        """The next :meth:`current` with ``renew`` makes the engine again, even on the same group: after
        a step whose collectives failed midway (the caller makes sure every rank restarts alike)."""
        self._restart = True

    @property
    def restarting(self) -> bool:
        """Whether :meth:`restart` was called since the engine was last made."""
        return self._restart

    def current(self, renew: bool = True) -> Engine:
        """The engine for the group as it is now; with ``renew`` (at a step's first bucket, a
        synchronization's start: never inside a step) made again first if the group's configuration
        changed or :meth:`restart` was called."""
        if self.engine is not None and not renew:  # inside a step: the step's engine, nothing read
            return self.engine
        configuration = configuration_of(self.group)
        if self.engine is None or configuration != self._made_for or self._restart:
            if self.engine is not None:
                self._records.extend(self.engine.records)
                self._take_residuals(self.engine)
            self.engine = Engine(self.spec, group=self.group, own_group=False, history=self.history)
            self._made_for, self._restart = configuration, False
            self.quorums += 1
        return self.engine

    def remember(self, keys: Sequence[Hashable], shapes: Sequence[torch.Size]) -> None:
        """The shapes of the tensors of ``keys`` (what a residual is taken back in)."""
        self._shapes.update(zip(keys, shapes, strict=True))

    def add_pending(self, flat: Tensor, keys: Sequence[Hashable], shapes: Sequence[torch.Size]) -> None:
        """The carried residuals of the tensors of ``keys`` (laid end to end in ``flat``) added to them."""
        at = 0
        for key, shape in zip(keys, shapes, strict=True):
            numel = shape.numel()
            held = self.pending.pop(key, None)
            if held is not None:
                flat[at : at + numel].add_(held.reshape(-1).to(flat.dtype))
            at += numel

    def _take_residuals(self, engine: Engine) -> None:
        take_residuals(engine, self._shapes, self.pending)

    @property
    def records(self) -> list[BucketRecord]:
        """Every engine's records, the earlier quorums' first."""
        return [*self._records, *(self.engine.records if self.engine is not None else [])]

    def steps_since(self, first: int) -> list[StepStats]:
        """Per step, what averaging cost, across quorums."""
        return steps_since(self.records, first)


class Restarts:
    """When every rank of torchft's quorum restarts its engines, all of them alike: at a step's start
    (a DDP step's first bucket, a synchronization's start), when the last step was committed nowhere
    (its collectives failed midway: should_commit said no on every group) or a group heals in this
    step (one that joined, or fell behind because its own step failed: its state is a peer's now).
    Both are read from torchft's ``manager``, the same on every rank; a failure seen on one rank
    only is not (the others' engines would go on as they were, and a stateful compressor, PowerSGD's
    warm starts, would average with mismatched state)."""

    def __init__(self, manager: Any, group: Any) -> None:
        self.manager, self.group = manager, group
        self._seen: int | None = None

    def due(self) -> bool:
        """At a step's start, after its quorum: whether state starts anew in this step."""
        step = self.manager.current_step()
        uncommitted, self._seen = step == self._seen, step
        return uncommitted or self.manager.num_participants() < size_of(self.group)
