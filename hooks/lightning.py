"""PyTorch Lightning: gradcomp's DDP hooks through Lightning's DDP strategy, their statistics in its
logger, every rank's hook state in its checkpoints.

>>> import lightning as L
>>> from gradcomp.hooks.lightning import GradcompStrategy, HookStatistics
>>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy=GradcompStrategy("topk:ratio=0.01,ef=true"),
...                     callbacks=[HookStatistics()])

:class:`GradcompStrategy` is Lightning's ``DDPStrategy`` with a gradcomp hook: the hook state is made
when the strategy is (before Lightning creates the process group: the engine comes at the first
bucket, :meth:`gradcomp.hooks.HookState.bind`) and registered on the DDP model Lightning wraps, on
every device. (Lightning's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers a
communication hook only when the model is on CUDA: on the CPU it would be silently left out.)
:class:`HookStatistics` logs the hook's statistics every step through Lightning's logger and keeps
every rank's hook state (error feedback's residuals) in the checkpoint, so a resumed run continues
as the run straight through. Install with ``pip install 'gradcomp[lightning]'``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gradcomp import sync
from gradcomp.engine.sharded import ShardSpec, ShardSpecLike
from gradcomp.engine.spec import HookSpecLike
from gradcomp.hooks import auto, fsdp2
from gradcomp.hooks.auto import AutoState
from gradcomp.hooks.auto_spec import AutoSpec, is_auto_spec
from gradcomp.hooks.ddp import HookState, make, register
from gradcomp.hooks.trainers import every_rank, gathered, metrics, own_rank
from gradcomp.state import TrainingHookState

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("gradcomp.hooks.lightning needs PyTorch Lightning: pip install 'gradcomp[lightning]'") from error


class GradcompStrategy(DDPStrategy):
    """Lightning's DDP strategy averaging gradients through a gradcomp hook.

    Args:
        spec: a hook spec (``"quantize:bits=4,ef=true"``, ``docs/hooks.md``), ``auto`` (its state is
            made when Lightning wraps the model: it times the model's forward), ``noop`` (nothing
            averaged: local SGD and DiLoCo, :class:`Synchronize`), or a state that
            :func:`gradcomp.hooks.make` returned (made before the process group is fine).
        kwargs: ``DDPStrategy``'s own (``process_group_backend``, ``find_unused_parameters``,
            ``static_graph``, ``start_method``, ...), not its communication hook arguments.
    """

    def __init__(self, spec: HookSpecLike | AutoSpec | HookState, **kwargs: Any) -> None:
        taken = sorted({"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"} & set(kwargs))
        if taken:
            raise TypeError(f"GradcompStrategy registers gradcomp's hook itself; leave out {taken}")
        self._auto = (
            spec if isinstance(spec, AutoSpec) else AutoSpec.parse(spec) if isinstance(spec, str) and is_auto_spec(spec)
            else None
        )  # fmt: skip
        self.hook_state: HookState | AutoState | None = None
        """The hook's state: statistics (``steps()``), checkpoints, the error (``auto``'s: once
        Lightning has wrapped the model)."""
        if self._auto is None:
            self.hook_state = spec if isinstance(spec, HookState) else make(spec)[0]  # type: ignore[arg-type]
        super().__init__(**kwargs)

    def _register_ddp_hooks(self) -> None:
        """On any device (Lightning's own registers a hook only on CUDA), on the DDP model's group."""
        if self._auto is not None:
            self.hook_state = auto.register(self.model, self._auto)  # type: ignore[arg-type]
        else:
            register(self.model, self.hook_state)  # type: ignore[arg-type]


class GradcompModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, applied in ``LightningModule.configure_model``)
    with gradcomp's reduce-scatter (:func:`gradcomp.hooks.fsdp`) on every FSDP2 module of the model.

    Args:
        spec: a sharded spec (``"quantize:bits=4,ef=true"``, ``"none"``: FSDP2's own reduce-scatter,
            through gradcomp; ``docs/fsdp.md``).
        kwargs: ``ModelParallelStrategy``'s own (``data_parallel_size``, ``tensor_parallel_size``: 1
            here, gradcomp shards data only, ``process_group_backend``, ``save_distributed_checkpoint``, ...).
    """

    def __init__(self, spec: ShardSpecLike, **kwargs: Any) -> None:
        self.spec = ShardSpec.parse(spec)  # a bad spec fails here, before any process starts
        self.hook_state: HookState | None = None
        """The hook's state (statistics, checkpoints, the error), once Lightning has sharded the model."""
        super().__init__(**kwargs)

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's (``configure_model`` shards the model), then gradcomp's reduce-scatter on it."""
        super().setup(trainer)
        assert self.lightning_module is not None, "Lightning sets the module before setup"
        self.hook_state = fsdp2.fsdp(self.lightning_module, self.spec)


class HookStatistics(pl.Callback):
    """Logs the gradcomp hook's statistics at every training step through Lightning's logger
    (``hook/wire_mb``, ``hook/payload_mb``, ``hook/compression_ratio``, ``hook/communicate_ms``,
    ``hook/buckets``; ``hook/inter_node_mb`` across nodes), and keeps every rank's hook state in
    checkpoints (gathered when one is written, each rank taking its own when it is loaded).

    Args:
        state: the hook's state; default: the trainer's :class:`GradcompStrategy`'s.
    """

    def __init__(self, state: TrainingHookState | None = None) -> None:
        self.state = state
        self._next = 0  # the first hook step not logged yet
        self._pending: dict[str, Any] | None = None  # a checkpoint's hook state, until training starts
        self._trainer: pl.Trainer | None = None  # set at setup: the state to save is its strategy's hook's

    def _hook(self, trainer: pl.Trainer) -> TrainingHookState:
        if self.state is not None:
            return self.state
        strategy = trainer.strategy
        if not isinstance(strategy, (GradcompStrategy, GradcompModelParallelStrategy)):
            kind = type(strategy).__name__
            raise TypeError(f"HookStatistics reads a gradcomp strategy's hook, not a {kind}'s: pass state=")
        assert strategy.hook_state is not None, "the strategy's hook is registered when Lightning wraps the model"
        return strategy.hook_state

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        steps = self._hook(trainer).steps_since(self._next)
        if not steps:  # a micro-batch that accumulated without synchronizing
            return
        self._next = steps[-1].step + 1
        pl_module.log_dict(metrics(steps[-1]), on_step=True, on_epoch=False, batch_size=1)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A checkpoint's hook state, restored before this: handed to the hook now, before its first
        bucket (Lightning restores callbacks before it wraps the model)."""
        if self._pending is not None:
            self._hook(trainer).load_state_dict(self._pending)
            self._pending = None

    def state_dict(self) -> dict[str, Any]:
        """Every rank's hook state (Lightning asks every rank when it writes a checkpoint: a collective)."""
        mine = self.state if self._trainer is None else self._hook(self._trainer)
        return {} if mine is None else every_rank(mine)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's hook state from the checkpoint, handed to the hook when training starts; a
        checkpoint of another world size is refused."""
        if state_dict:
            self._pending = own_rank(state_dict)


class Synchronize(pl.Callback):
    """Local SGD or DiLoCo through Lightning (:class:`gradcomp.sync.Synchronizer`): each rank trains its
    own replica, and every ``every`` optimizer steps the replicas synchronize through ``spec``.

    Use it with ``strategy=GradcompStrategy("noop")``: Lightning's DDP then starts every replica from
    rank 0's parameters and averages nothing per step; this callback synchronizes. It makes the
    synchronizer when training starts, steps it after every optimizer step (not every micro-batch
    under ``accumulate_grad_batches``), flushes it when training ends, logs ``sync/*`` metrics at each
    synchronizing step, and keeps every rank's synchronizer and inner optimizer states in checkpoints
    (Lightning keeps rank 0's optimizer only; a resumed run continues bitwise). Evaluate or save the
    synchronized model inside ``callback.synchronizer.global_model()``.

    Args:
        sync_spec: ``"localsgd:every=8"``, ``"diloco:every=50,fragments=2,delay=2"``, ... (``docs/local-sgd.md``).
        spec: the hook spec the outer gradients travel by (default: uncompressed).
        kwargs: :class:`gradcomp.sync.Synchronizer`'s other options (``timeout``, ``history``).
    """

    def __init__(self, sync_spec: str, spec: HookSpecLike = "allreduce", **kwargs: Any) -> None:
        self.sync_spec, self.spec, self.options = sync.SyncSpec.parse(sync_spec), spec, kwargs
        self.synchronizer: sync.Synchronizer | None = None
        self._stepped = 0  # the trainer's optimizer steps the synchronizer has seen
        self._next = 0  # the first synchronizer step not logged yet
        self._pending: dict[str, Any] | None = None
        self._trainer: pl.Trainer | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if dist.is_initialized() and not (isinstance(strategy, GradcompStrategy) and _averages_nothing(strategy)):
            raise ValueError(
                "Synchronize trains a replica per rank: give the trainer strategy=GradcompStrategy('noop'), "
                f"not {type(strategy).__name__} (which would also average every step's gradients)"
            )
        optimizer = trainer.optimizers[0]  # restarted with a replica that diverged; averaged with state=true
        self.synchronizer = sync.Synchronizer(pl_module, self.sync_spec, self.spec, optimizer=optimizer, **self.options)
        if self._pending is not None:  # after Lightning restored rank 0's optimizer state on every rank
            self.synchronizer.load_state_dict(self._pending["sync"])
            for inner, saved in zip(trainer.optimizers, self._pending["optimizers"], strict=True):
                inner.load_state_dict(saved)
            self._pending = None
        self._stepped = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        assert self.synchronizer is not None, "made at on_train_start"
        while self._stepped < trainer.global_step:  # an optimizer step was taken (not a micro-batch)
            self._stepped += 1
            self.synchronizer.step()
        for step in self.synchronizer.steps_since(self._next):
            self._next = step.step + 1
            if step.buckets:
                pl_module.log_dict({key.replace("hook/", "sync/"): value for key, value in metrics(step).items()},
                                   on_step=True, on_epoch=False, batch_size=1)  # fmt: skip

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.synchronizer is not None:
            self.synchronizer.flush()

    def state_dict(self) -> dict[str, Any]:
        """Every rank's synchronizer state and inner optimizers' (a collective: Lightning asks every
        rank). Lightning keeps rank 0's optimizer state only, which is every rank's under DDP; each
        replica's own (its momentum, Adam's moments) differs here."""
        if self.synchronizer is None or self._trainer is None:
            return {}
        optimizers = [inner.state_dict() for inner in self._trainer.optimizers]
        return gathered({"sync": self.synchronizer.state_dict(), "optimizers": optimizers})

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's synchronizer and inner optimizer states, applied when training starts."""
        if state_dict:
            self._pending = own_rank(state_dict)


def _averages_nothing(strategy: GradcompStrategy) -> bool:
    state = strategy.hook_state
    return isinstance(state, HookState) and state.spec.noop
