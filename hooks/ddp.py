"""``hooks.make`` and ``hooks.register``: every gradcomp compressor as a DDP communication hook."""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at run time.
import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket

from gradcomp.collectives.executor import Handle
from gradcomp.collectives.groups import as_timeout
from gradcomp.compressors import fusion
from gradcomp.compressors.finite import refuse_non_finite
from gradcomp.engine import Engine, sparse
from gradcomp.engine.sharded import ShardedEngine, ShardSpec
from gradcomp.engine.spec import HookSpec, HookSpecLike
from gradcomp.engine.stats import StepStats, steps_since, write_trace
from gradcomp.hooks.auto_spec import is_auto_spec
from gradcomp.hooks.loss_scale import LossScale
from gradcomp.state import TrainingHookState

Hook = Callable[["HookState", GradBucket], torch.futures.Future[Tensor]]

PER_PARAMETER = (
    "each parameter's (grad, param) instead of buckets: DDP's Python reducer, for compiled autograd "
    "(torch._dynamo.config.optimize_ddp = 'python_reducer'), does that with every communication hook. "
    "Keep optimize_ddp at its default ('ddp_optimizer'): torch.compile then runs the model compiled and "
    "the hook per bucket, as in eager mode (docs/hooks.md, 'torch.compile')"
)


class ParameterKeys:
    """A stable key per parameter: its index, numbered in the order the parameters are first seen.

    DDP's first iteration always hands parameters to the hook in the same order, so keys are the same
    in every run (a checkpoint's state finds its tensors again), and since the engine keeps state per
    parameter, DDP's bucket rebuild after the first iteration changes nothing (rule "state per tensor").
    """

    def __init__(self) -> None:
        self._indices: dict[int, int] = {}

    def __call__(self, parameters: list[Tensor]) -> list[int]:
        """The keys of ``parameters``, in their order (new ones numbered on)."""
        return [self._indices.setdefault(id(p), len(self._indices)) for p in parameters]


class HookState(TrainingHookState):
    """What a gradcomp hook keeps between steps: its spec, the engine, and a stable key per parameter
    (:class:`ParameterKeys`; FSDP2's hook, :mod:`gradcomp.hooks.fsdp2`, keeps the same with a sharded
    spec and engine, keyed by module). Statistics, traces, checkpoints and the error as every hook's
    state (:class:`~gradcomp.state.TrainingHookState`): per step (:meth:`steps`), buckets, input and
    payload bytes, compression ratio, bytes sent and received (None with the native all-reduce),
    seconds in compress / communicate / decompress, and the tail (``tail_s``: from the last bucket's
    hand-over to the end of the step's communication).

    Made before the process group exists (Lightning's ``DDPStrategy`` takes its hook state before it
    creates the group), it has no engine until :meth:`bind` makes one, at the first bucket: on the
    group it was made for (None: the world, whatever it is then); a state loaded meanwhile is applied then.
    """

    def __init__(
        self,
        spec: HookSpec | ShardSpec,
        engine: Engine | ShardedEngine | None,
        world: int,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | float | None = None,
        world_known: bool = True,
    ) -> None:
        self.spec, self.engine, self.world = spec, engine, world
        self._world_known = world_known  # False: made before the process group, the world comes at bind
        self.error: BaseException | None = None
        self.keys = ParameterKeys()
        self._group, self._timeout = group, timeout
        self._saved: dict[str, Any] | None = None  # loaded before the engine was made
        self.loss_scale: LossScale | None = None
        """The loss scale of the gradient scaler the hook follows (:meth:`follow`)."""

    def bind(self, group: dist.ProcessGroup | None = None) -> Engine | ShardedEngine | None:
        """The engine; made now if the hook was made before the process group, on ``group`` (or the
        one given when it was made, or the world). A hook serves one group: another is refused."""
        if group is not None:
            if self._group is not None and not _same_group(group, self._group):
                raise ValueError(
                    f"this hook state serves ranks {_ranks(self._group)}, not ranks {_ranks(group)}: a hook "
                    "state averages over one process group; make one per model"
                )
            self._group = group
        if self.engine is None and not self.spec.noop:
            assert isinstance(self.spec, HookSpec), "a sharded hook's engine is made with it"
            self._group = self._group or dist.group.WORLD  # bound: another group is refused from now on
            self.engine = Engine(self.spec, group=self._group, timeout=self._timeout)
            self.world, self._world_known = self.engine.world, True
            if self._saved is not None:
                saved, self._saved = self._saved, None
                self.load_state_dict(saved)
        return self.engine

    def follow(self, scaler: torch.amp.GradScaler) -> None:
        """Keep what the hook carries between steps (error feedback's residuals, momentum
        correction's velocities) in the units of ``scaler``'s loss scale: when the scale changes
        (grown, or backed off after an overflow), they are multiplied by the new scale over the old
        before the step's first bucket, so that they are added to gradients of their own size.
        Costs: on the CPU nothing unless the scale changed; on an accelerator one multiply pass over
        them per step (deciding without it would read the scale on the host)."""
        self.loss_scale = LossScale(scaler)

    def follow_scale(self) -> None:
        """At a step's start (the hooks call it): rescale the carried state if the loss scale changed."""
        assert self.loss_scale is not None
        ratio = self.loss_scale.change()
        if ratio is not None and self.engine is not None:
            self.engine.compressor.rescale(ratio)

    def steps_since(self, first: int) -> list[StepStats]:
        return [] if self.engine is None else steps_since(self.engine.records, first)

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """A Chrome / Perfetto JSON trace of every recorded bucket: ready, queued, and each phase."""
        if self.engine is not None:
            write_trace(self.engine.records, path, dist.get_rank())

    def state_dict(self) -> dict[str, Any]:
        """The hook's spec and world size, the compressor's state (residuals, warm starts,
        generators) and the engine's (what it learned about its transfers): loadable with
        ``torch.load(..., weights_only=True)``."""
        if self.engine is None and self._saved is not None:
            return self._saved  # loaded before the first bucket: still what it was
        state: dict[str, Any] = {"spec": str(self.spec), "world_size": self.world}
        if self.engine is not None:
            state["compressor"] = self.engine.compressor.state_dict()
            state["engine"] = self.engine.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, from a hook of the same spec and world size
        (residuals are in units of the gradient over the world size): anything else is refused."""
        if self.engine is None and not self.spec.noop:  # no engine yet: applied when it is made
            check_saved(state, str(self.spec), self.world if self._world_known else None, "gradcomp")
            self._saved = state  # the world size checked again when the engine is made
            return
        check_saved(state, str(self.spec), self.world, "gradcomp")
        if self.engine is not None:
            self.engine.compressor.load_state_dict(state["compressor"])
            if "engine" in state:  # states saved before the engine kept any have none
                self.engine.load_state_dict(state["engine"])


def check_saved(state: Any, spec: str, world: int | None, kind: str) -> None:
    """Refuse a hook state that is not a ``kind`` hook's, or was saved by another spec or world size
    (``world`` None: not known yet, not compared), or holds a NaN or Inf (:func:`refuse_non_finite`)."""
    if not isinstance(state, dict) or "spec" not in state or "world_size" not in state:
        raise ValueError(f"not a {kind} hook state (it records no spec and world size)")
    saved, mine = (state["spec"], state["world_size"]), (spec, state["world_size"] if world is None else world)
    if saved != mine:
        raise ValueError(
            f"this hook state was saved by the hook {saved[0]!r} at world size {saved[1]}; "
            f"this hook is {mine[0]!r} at world size {mine[1]}"
        )
    refuse_non_finite(state, f"this {kind} hook state")  # every hook's load comes here


def gradcomp_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """The hook :func:`make` returns: ``bucket`` averaged through ``state``'s engine."""
    if not isinstance(bucket, GradBucket):
        raise TypeError(f"a gradcomp hook averages DDP's gradient buckets; DDP handed it {PER_PARAMETER}")
    engine = state.bind()  # made now if the hook was made before the process group
    if engine is None:  # noop: the compute floor
        return unchanged(bucket)
    assert isinstance(engine, Engine), "a sharded engine reduce-scatters for FSDP2, not for DDP"
    if state.loss_scale is not None and bucket.index() == 0:  # DDP hands buckets over in index order
        state.follow_scale()
    keys, shapes = None, None
    if engine.per_tensor:
        parameters = bucket.parameters()
        keys = state.keys(parameters)
        shapes = shapes_of(parameters)
    handle = engine.reduce(bucket.buffer(), keys, shapes, bucket.index(), bucket.is_last())
    if bucket.is_last():
        engine.end_step()
    return deliver(state, handle)


def unchanged(bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """A completed future of the bucket as it is: this rank's own gradients, nothing sent."""
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def shapes_of(parameters: list[Tensor]) -> list[torch.Size]:
    """The shapes a bucket holds its parameters' gradients in: complex ones as pairs of reals."""
    return [torch.view_as_real(p).shape if p.is_complex() else p.shape for p in parameters]


def deliver(state: TrainingHookState, handle: Handle[Tensor]) -> torch.futures.Future[Tensor]:
    """The future DDP waits on for ``handle``'s bucket: its result, or its error raised in DDP's wait
    (the first error is kept in ``state.error``: later buckets fail because of it)."""
    done: torch.futures.Future[Tensor | BaseException] = torch.futures.Future()

    def finished(handle: Handle[Tensor]) -> None:
        try:
            done.set_result(handle.wait())
        except Exception as error:  # delivered to DDP's wait in the training thread by _raise
            state.error = state.error or error  # the first is the cause; later buckets fail because of it
            done.set_result(error)

    handle.then(finished)
    # DDP reads the future in C++, where only an error raised by a `then` callback counts as one
    # (torch's Future.set_exception stores the exception as the value: "Unable to cast ... to Tensor").
    return done.then(_raise)


def _raise(future: torch.futures.Future[Tensor | BaseException]) -> Tensor:
    result = future.value()
    if isinstance(result, BaseException):
        raise result.with_traceback(None)  # the message is what matters; the hook's frames are noise
    return result


def make(
    spec: HookSpecLike,
    *,
    group: dist.ProcessGroup | None = None,
    algo: str | None = None,
    aggregation: str | None = None,
    seed: int | None = None,
    timeout: datetime.timedelta | float | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[HookState, Hook]:
    """A (state, hook) pair for ``ddp_model.register_comm_hook``. A bad spec fails here, before training.

    It may be made before ``init_process_group`` (as Lightning's ``DDPStrategy`` takes it): the
    engine is then made at the first bucket, on ``group`` (default: the world as it is then).

    Args:
        spec: a hook spec (:class:`HookSpec` or its text): a compressor spec, ``allreduce`` or
            ``noop``; its text may also set ``algo``, ``aggregation`` and ``seed``
            (``"fp16:algo=ring"``), which then override the arguments below.
        group: the process group to average over: the one DDP communicates on (``register`` passes
            the model's ``process_group``; default: the world).
        algo: all-reduce algorithm for summable payloads: native (default), ring, tree or halving_doubling.
        aggregation: for the other compressors: gather, two_phase, or auto (default: two-phase from 8 ranks).
        seed: seed of the compressor's generators (default 0); the same on every rank.
        timeout: what any collective of the hook may take before it fails, naming the peer (a frozen
            or failed rank); default: ``group``'s own (what ``init_process_group`` was given).
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision run: error feedback's residuals
            then follow its loss scale (:meth:`HookState.follow`); without it they would be added at
            the size of the scale they were made in.
    """
    timeout = as_timeout(timeout)  # a number of seconds, or refused here
    if is_auto_spec(spec):
        raise ValueError(
            "auto times the model's forward and backward: attach it with gradcomp.hooks.register(model, 'auto')"
        )
    given = {"algo": algo, "aggregation": aggregation, "seed": seed}
    parsed = HookSpec.parse(spec, **{key: value for key, value in given.items() if value is not None})
    if not dist.is_initialized():  # the engine at the first bucket
        state = HookState(parsed, None, 1, group, timeout, world_known=False)
    else:
        state = HookState(parsed, None, dist.get_world_size(group), group, timeout)
        state.bind()
    if scaler is not None:
        state.follow(scaler)
    return state, gradcomp_hook


def register(
    model: torch.nn.parallel.DistributedDataParallel, spec: HookSpecLike | HookState, **options: Any
) -> HookState:
    """``make`` and ``model.register_comm_hook`` in one call, averaging over the group DDP communicates
    on (its ``process_group``) unless ``group`` is given; returns the state (for checkpoints). ``spec``
    may be a state :func:`make` returned earlier (before the process group existed): it is bound to
    the model's group, and refused if it serves another."""
    if getattr(model, "_use_python_reducer", False):
        raise ValueError(f"this DDP model will hand its hooks {PER_PARAMETER}")
    check_no_hook(model)
    options.setdefault("group", model.process_group)
    if isinstance(spec, HookState):
        if set(options) != {"group"}:
            raise TypeError(f"a hook state was made with its options; got {sorted(set(options) - {'group'})}")
        refuse_sparse(model, spec.spec)
        spec.bind(options["group"])
        model.register_comm_hook(spec, gradcomp_hook)
        _precompile(model, spec)
        return spec
    state, hook = make(spec, **options)
    refuse_sparse(model, state.spec)
    model.register_comm_hook(state, hook)
    _precompile(model, state)
    return state


def refuse_sparse(model: torch.nn.Module, spec: HookSpec | ShardSpec | str) -> None:
    """Refuse, in one line, a spec that cannot average the sparse gradients ``model`` makes (its
    ``nn.Embedding`` and ``nn.EmbeddingBag`` modules with ``sparse=True``, as DDP finds them), at
    registration rather than at the first backward (:mod:`gradcomp.engine.sparse`)."""
    found = sparse_modules(model)
    refused = sparse.refusal(spec, ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")) if found else None
    if refused is not None:
        raise ValueError(refused)


def sparse_modules(model: torch.nn.Module) -> list[str]:
    """The modules of ``model`` whose weight gets a sparse gradient, as ``nn.Embedding(sparse=True) at 'name'``."""
    return [
        f"nn.{type(module).__name__}(sparse=True) at {name!r}"
        for name, module in getattr(model, "module", model).named_modules()  # DDP's module, named as the user's
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
        and module.weight.requires_grad
    ]  # fmt: skip


def check_no_hook(model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Refuse a DDP model that has a communication hook already, naming it (DDP takes one per model;
    torch's own refusal, a RuntimeError from its reducer, says neither which nor what to do), before a
    new hook's engine is built."""
    registered = getattr(model, "_comm_hooks", None) or []  # DDP's record of register_comm_hook's calls
    if registered:
        hook, state = registered[0]
        spec = getattr(state, "spec", None)
        name = str(spec) if spec is not None else getattr(hook, "__qualname__", repr(hook))
        raise ValueError(
            f"this DDP model has a communication hook already ({name}) and DDP takes one per model: "
            "register one spec per model (auto chooses among several), or wrap the module in a new "
            "DistributedDataParallel"
        )


def _precompile(model: torch.nn.Module, state: HookState) -> None:
    """The compressor's fused kernels compiled now, for the model's gradients, rather than inside
    its first backward (``gradcomp.compressors.fusion.precompile``: nothing where none compiles)."""
    parameter = next(model.parameters(), None)
    compressor = getattr(state.spec, "compressor", None)
    if parameter is not None and compressor is not None:
        fusion.precompile(compressor, parameter.dtype, parameter.device)


def _same_group(a: dist.ProcessGroup, b: dist.ProcessGroup) -> bool:
    return a is b or _ranks(a) == _ranks(b)


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)
