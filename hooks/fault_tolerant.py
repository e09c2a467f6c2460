"""gradcomp's compression on torchft's fault-tolerant replica groups (``pip install gradcomp[torchft]``).

torchft (``pytorch/torchft``) trains replica groups that join a quorum through a lighthouse at every
step; when a group dies the others go on in a smaller quorum, and a restarted group heals from a
live one. Its ``Manager`` reconfigures one process group in place at each quorum. This module puts a
gradcomp hook on that group, in place of torchft's uncompressed all-reduce:

>>> manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1, ...)
>>> model = fault_tolerant.DistributedDataParallel(manager, module, "topk:ratio=0.01,ef=true")
>>> optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))

(``"auto"`` as the spec: :mod:`gradcomp.hooks.fault_tolerant_auto`.)

Each step (``optimizer.zero_grad`` starts the quorum, ``optimizer.step`` commits only where the
manager says every group's step succeeded), every bucket is averaged by gradcomp's engine on the
manager's group itself (``Engine(own_group=False)``: no group of its own, which a dead member would
leave broken), over the replica groups that take part in the step: a healing group sends zeros, as
with torchft's own all-reduce. A collective that fails (a peer died) is reported to the manager: the
bucket comes back as it was, ``should_commit`` says no on every group, and the next quorum goes on
without the dead group.

State across quorums: the engine is made again when the quorum's group changes (a group lost or
joined, the world size with it) or state starts anew on every rank alike
(:class:`~gradcomp.engine.quorum.Restarts`: the last step committed nowhere, or a group heals in
this one). What error feedback had not sent yet (each tensor's residual, in units of the gradient
over the old world size) is carried over: taken from the old engine and added to the tensor's next
gradient times the old world size, so that it reaches the average once, whatever the new world
size (as ``auto`` hands residuals between its candidates). The rest of the compressor state starts
anew: momentum correction's velocities, EF21's estimates, PowerSGD's warm starts, the noise
counters. A healed group gets the model and the optimizer from a live peer (torchft's checkpoint
transport) and starts with an empty compressor state: residuals are a group's own unsent
gradients, which no peer holds.
"""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at run time.
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed import GradBucket

from gradcomp.collectives.executor import Handle
from gradcomp.compressors import fusion
from gradcomp.engine import Engine
from gradcomp.engine.quorum import QuorumEngine, Restarts
from gradcomp.engine.spec import HookSpec, HookSpecLike
from gradcomp.engine.stats import StepStats
from gradcomp.hooks.auto_spec import AutoSpec, is_auto_spec
from gradcomp.hooks.ddp import ParameterKeys, shapes_of


class FaultTolerantState:
    """What the hook keeps between steps: the manager, the spec, and the engine of the current
    quorum's group (:class:`~gradcomp.engine.quorum.QuorumEngine`: made again when the group changes
    or state starts anew, :class:`~gradcomp.engine.quorum.Restarts`; its residuals carried)."""

    def __init__(self, manager: Any, spec: HookSpec, group: Any) -> None:
        self.manager, self.spec, self.group = manager, spec, group
        self.engines = QuorumEngine(spec, group)
        self.restarts = Restarts(manager, group)
        self.keys = ParameterKeys()
        self.error: BaseException | None = None
        """The last error a step's averaging reported to the manager (its step was discarded)."""

    @property
    def engine(self) -> Engine | None:
        """The current quorum's engine (None before the first bucket)."""
        return self.engines.engine

    @property
    def quorums(self) -> int:
        """How many engines the hook has made: one per quorum group it averaged on, and one after
        each step that started anew (1 while nothing changed)."""
        return self.engines.quorums

    def failed(self, error: BaseException) -> None:
        """A step's averaging failed here: reported to the manager, which discards the step."""
        self.error = error
        self.manager.report_error(error)

    def average(self, bucket: GradBucket, buffer: Tensor, participating: bool) -> tuple[Handle[Tensor], int]:
        """``buffer`` (the bucket's) averaged by the current quorum's engine: its handle, and the
        world size it averages over."""
        engines = self.engines
        if bucket.index() == 0 and self.restarts.due():
            engines.restart()
        engine = engines.current(renew=bucket.index() == 0)
        keys, shapes = None, None
        if engine.per_tensor:
            parameters = bucket.parameters()
            keys, shapes = self.keys(parameters), shapes_of(parameters)
            engines.remember(keys, shapes)
            if engines.pending and participating:  # else they wait for a step it takes part in
                engines.add_pending(buffer, keys, shapes)
        handle = engine.reduce(buffer, keys, shapes, bucket.index(), bucket.is_last())
        if bucket.is_last():
            engine.end_step()
        return handle, engine.world

    def steps_since(self, first: int) -> list[StepStats]:
        """Per step, what averaging cost (``TrainingHookState.steps_since``), across quorums."""
        return self.engines.steps_since(first)


class Averaging(Protocol):
    """A fault-tolerant hook's state: :class:`FaultTolerantState`, or ``auto``'s
    (:class:`~gradcomp.hooks.fault_tolerant_auto.FaultTolerantAutoState`)."""

    manager: Any

    def average(self, bucket: GradBucket, buffer: Tensor, participating: bool) -> tuple[Handle[Tensor], int]: ...

    def failed(self, error: BaseException) -> None: ...


def hook(state: Averaging, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """The bucket averaged by gradcomp's engine over the replica groups taking part in the step; a
    failure is reported to the manager, which then discards the step (the module's notes)."""
    manager = state.manager
    manager.wait_quorum()
    buffer = bucket.buffer()
    if manager.errored() is not None:  # this step is lost already: nothing more to send
        return _done(buffer)
    try:
        participating = manager.is_participating()
        if not participating:  # healing: its gradients are not the others' model's
            buffer.zero_()
        handle, world = state.average(bucket, buffer, participating)
    except Exception as error:  # a peer died: reported, and the step discarded by should_commit
        state.failed(error)
        return _done(buffer)
    participants = manager.num_participants()
    done: torch.futures.Future[Tensor] = torch.futures.Future()

    def landed(handle: Any) -> None:  # on the engine's executor, while backward goes on
        try:
            averaged = handle.wait()
        except Exception as error:
            state.failed(error)
            done.set_result(buffer)
            return
        if participants and participants != world:  # healing groups sent zeros: the participants' mean
            averaged.mul_(world / participants)
        done.set_result(averaged)

    handle.then(landed)
    return done


def _done(tensor: Tensor) -> torch.futures.Future[Tensor]:
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(tensor)
    return done


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's DDP whose buckets a gradcomp hook averages through torchft's ``manager`` (as torchft's
    own ``torchft.ddp.DistributedDataParallel`` averages them uncompressed): the same conventions
    (the model is synchronized by the manager at step 0, not by DDP; buckets are never rebuilt, so
    that a healed group's match the others'). ``spec``: any hook spec on a flat group (a compressor,
    error feedback, ``allreduce``, ``auto``: :mod:`gradcomp.hooks.fault_tolerant_auto`; not
    ``local_size``). ``group``: the process group the manager reconfigures (default: the manager's
    own). The hook's state is :attr:`gradcomp_state`."""

    def __init__(self, manager: Any, module: nn.Module, spec: HookSpecLike | AutoSpec, *, group: Any = None,
                 **kwargs: Any) -> None:  # fmt: skip
        from torchft.process_group import ProcessGroupDummy

        from gradcomp.hooks.fault_tolerant_auto import FaultTolerantAutoState

        given = AutoSpec.parse(spec) if isinstance(spec, str) and is_auto_spec(spec) else spec
        auto = given if isinstance(given, AutoSpec) else None
        specs = auto.hook_specs if auto is not None else [HookSpec.parse(given)]  # type: ignore[arg-type]
        for parsed in specs:  # torch's hooks: refused by the owners of their specs
            if parsed.compressor is None:
                raise ValueError(f"{parsed} sends nothing: fault tolerance needs an averaging hook")
            if parsed.local_size > 1:
                raise ValueError("local_size makes node groups, which torchft's reconfigured group cannot carry")
        # torchft's own choices: a dummy group soaks up DDP's initial broadcast (the manager syncs
        # the model), and unused-parameter detection keeps DDP from rebuilding its buckets
        super().__init__(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True, **kwargs)
        pg = group if group is not None else manager._pg  # the group the manager configures at each quorum
        self.gradcomp_state: FaultTolerantState | FaultTolerantAutoState
        if auto is not None:
            self.gradcomp_state = FaultTolerantAutoState(manager, auto, pg, len(list(module.parameters())))
            # auto times the model's compute from its forward (as gradcomp.hooks.auto.register does)
            self.register_forward_pre_hook(torch.compiler.disable(self.gradcomp_state.forward_started))
            self.register_forward_hook(torch.compiler.disable(self.gradcomp_state.forward_ended))
        else:
            self.gradcomp_state = FaultTolerantState(manager, specs[0], pg)
        self.register_comm_hook(self.gradcomp_state, hook)
        parameter = next(module.parameters(), None)
        if parameter is not None:  # compiled now, not in a step the other groups wait on (a rejoin's)
            for parsed in specs:
                fusion.precompile(parsed.compressor, parameter.dtype, parameter.device)
