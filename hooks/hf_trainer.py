"""The Hugging Face Trainer: a gradcomp hook on the model it wraps in DDP, the hook's statistics in its
logs, every rank's hook state in its checkpoints, and :class:`~gradcomp.hooks.CompressedAdamW` as its
optimizer.

>>> from transformers import Trainer
>>> from gradcomp.hooks.hf_trainer import GradcompCallback
>>> trainer = Trainer(model=model, args=args, train_dataset=data)
>>> trainer.add_callback(GradcompCallback(trainer, "topk:ratio=0.01,ef=true"))
>>> trainer.train()                                # or train(resume_from_checkpoint=True)

The Trainer wraps the model in DDP inside ``train()``, and its ``ddp_kwargs`` take only torch's own
hooks: the callback registers gradcomp's (any DDP spec, ``auto`` too) on ``trainer.model_wrapped``
when training begins, which is why it needs the Trainer (a callback is handed the model unwrapped). With
a :class:`~gradcomp.hooks.CompressedAdamW` given as ``Trainer(optimizers=(optimizer, None))`` it
attaches the optimizer instead, the spec being its warm-up hook's. Each checkpoint the Trainer writes
gets every rank's hook state, a file per rank beside the Trainer's own per-rank RNG states
(``checkpoint-N/gradcomp_rank<r>.pt``: :func:`gradcomp.hooks.trainers.save_own`), and a resumed run
loads its rank's before the first step, so it continues as the run straight through. Launch with
``accelerate launch --multi_gpu --num_processes 2 train.py`` or ``torchrun``; on a machine without
GPUs give ``TrainingArguments(use_cpu=True, ddp_backend="gloo")``. Install with
``pip install 'gradcomp[transformers]'``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradcomp.hooks.compressed_adamw import CompressedAdamW
from gradcomp.hooks.trainers import load_own, metrics, save_own
from gradcomp.state import RunSummary, RunTotals, TrainingHookState

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("gradcomp.hooks.hf_trainer needs transformers: pip install 'gradcomp[transformers]'") from error

logger = logging.getLogger(__name__)


class GradcompCallback(TrainerCallback):
    """A gradcomp hook for the Hugging Face Trainer (module notes): registered on the DDP model when
    training begins, its ``hook/*`` metrics logged with the Trainer's (the latest step's, at every
    logging step), its state saved per rank in every checkpoint and restored when a run resumes.

    Args:
        trainer: the Trainer to serve (add the callback to it: ``trainer.add_callback(callback)``).
        spec: a DDP hook spec (``"topk:ratio=0.01,ef=true"``, ``"auto"``, ``docs/hooks.md``) or a state
            :func:`gradcomp.hooks.make` returned; with a
            :class:`~gradcomp.hooks.CompressedAdamW` optimizer, its warm-up hook's (``"allreduce"``,
            ``"fp16"``, ``"quantize:bits=4"``).
        resume_from: the checkpoint folder a resumed run reads the hook states from; default: the one
            ``TrainingArguments.resume_from_checkpoint`` names, else ``output_dir/checkpoint-N`` at the
            step N the Trainer resumes at (what ``train(resume_from_checkpoint=True)`` picks). A resumed
            run whose folder holds no hook state is refused: it would start with empty residuals.
        options: :func:`gradcomp.hooks.register`'s (``scaler``, ``timeout``, ``seed``, ...); for
            ``CompressedAdamW``, ``attach``'s (``timeout``).

    With one process (nothing to average) the callback does nothing. ``callback.state`` is the hook's
    state once training began (statistics, the error); :meth:`summary` the run's totals, which rank 0
    logs when training ends.
    """

    def __init__(
        self, trainer: Trainer, spec: Any, *, resume_from: str | os.PathLike[str] | None = None, **options: Any
    ) -> None:
        from gradcomp import hooks

        if isinstance(spec, str) and not isinstance(_optimizer(trainer), CompressedAdamW):
            hooks.parse(spec)  # a bad spec fails here, before training (CompressedAdamW's attach checks its own)
        self.trainer, self.spec, self.resume_from, self.options = trainer, spec, resume_from, options
        self.state: TrainingHookState | None = None
        """The hook's state, once training began (None with one process)."""
        self._model: DistributedDataParallel | None = None  # the model the hook is registered on
        self._resume_at: int | None = None  # the step a resumed run restores the hook's state at
        self._next = 0  # the first hook step not logged yet
        self.totals = RunTotals()
        """What averaging cost this rank in this process's run, kept step by step: :meth:`summary`."""

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Register the hook on the model the Trainer wrapped; a resumed run restores every rank's state."""
        if state.global_step > 0:
            self._resume_at = state.global_step
        self._register(args, wrapped=False)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Where a Trainer wraps the model after ``on_train_begin``: register before the first backward."""
        self._register(args, wrapped=True)

    def _register(self, args: TrainingArguments, wrapped: bool) -> None:
        model = self.trainer.model_wrapped
        if self._model is None or self._model is not model:
            if not isinstance(model, DistributedDataParallel):
                world = dist.get_world_size() if dist.is_initialized() else 1
                if wrapped and world > 1:
                    raise TypeError(
                        f"GradcompCallback registers a DDP hook; the Trainer's model is a {type(model).__name__} "
                        "(FSDP and DeepSpeed average gradients their own way)"
                    )
                return
            optimizer = _optimizer(self.trainer)
            if isinstance(optimizer, CompressedAdamW):
                self.state = optimizer.attach(model, self.spec, **self.options)
            else:
                from gradcomp import hooks

                self.state = hooks.register(model, self.spec, **self.options)
            self._model = model
        if self._resume_at is not None and self.state is not None:
            load_own(self.state, self._checkpoint(args, self._resume_at), self._resume_at)
            self._resume_at = None

    def _checkpoint(self, args: TrainingArguments, step: int) -> str | os.PathLike[str]:
        """The folder a run resumed at ``step`` reads the hook states from."""
        if self.resume_from is not None:
            return self.resume_from
        if isinstance(args.resume_from_checkpoint, str) and os.path.isdir(args.resume_from_checkpoint):
            return args.resume_from_checkpoint
        return _checkpoint(args, step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """At a step the Trainer logs: the hook's latest step as ``hook/*`` metrics, through
        ``trainer.log`` (to every reporter), just before the Trainer's own line (its flow callback,
        which comes first, has decided by now)."""
        if self.state is not None:
            self.totals.update(self.state)
        self._log(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The same where the Trainer logs at the end of an epoch (``logging_strategy="epoch"``)."""
        self._log(control)

    def _log(self, control: TrainerControl) -> None:
        if not control.should_log or self.state is None:
            return
        steps = self.state.steps_since(self._next)
        if steps:
            self._next = steps[-1].step + 1
            self.trainer.log(metrics(steps[-1]))
            control.should_log = True  # which the log just reset: the Trainer's own line still comes

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """This rank's hook state into the checkpoint the Trainer has just written (every rank is here)."""
        if self.state is not None:
            save_own(self.state, _checkpoint(args, state.global_step), state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.state is not None and state.is_world_process_zero:
            logger.info("gradcomp %s: %s", self.spec, self.summary())

    def summary(self) -> RunSummary:
        """What averaging cost this rank in this process's run, every step of it (``state.summary()``
        covers the steps the hook's history keeps); empty before training and with one process."""
        if self.state is not None:
            self.totals.update(self.state)
        return self.totals.summary()


def _checkpoint(args: TrainingArguments, step: int) -> str:
    """The folder of the Trainer's checkpoint at ``step`` (``output_dir/checkpoint-N``)."""
    return os.path.join(str(args.output_dir), f"{PREFIX_CHECKPOINT_DIR}-{step}")


def _optimizer(trainer: Trainer) -> Any:
    """The user's optimizer, inside Accelerate's wrapper once the Trainer has prepared it."""
    optimizer = trainer.optimizer
    return getattr(optimizer, "optimizer", optimizer)
