"""Hugging Face Accelerate: a gradcomp hook on the model ``accelerator.prepare`` wrapped, its
statistics through ``accelerator.log``, every rank's hook state in ``accelerator.save_state``.

>>> from accelerate import Accelerator
>>> from gradcomp.hooks import accelerate as gradcomp_accelerate
>>> accelerator = Accelerator(cpu=True)             # cpu=True on a machine without GPUs
>>> model, optimizer, data = accelerator.prepare(model, optimizer, data)
>>> state = gradcomp_accelerate.register(accelerator, model, "topk:ratio=0.01,ef=true")
>>> statistics = gradcomp_accelerate.Statistics(accelerator, state)
>>> ...                     # each step: accelerator.backward(loss), optimizer.step(), statistics.log(step)

Launch with ``accelerate launch --multi_gpu --num_processes 2 train.py``: Accelerate's multi-process
launcher (torchrun), which on a machine without GPUs starts gloo processes when the script passes
``Accelerator(cpu=True)`` (``--cpu`` would pick its single-process launcher instead). Accelerate's
``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's own hooks; any gradcomp spec
(``auto`` too) is registered here, on the prepared model. Gradient accumulation
(``accelerator.accumulate(model)``) runs DDP's ``no_sync``: the hook averages the accumulated
gradient once per optimizer step. Install with ``pip install 'gradcomp[accelerate]'``.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradcomp.hooks.trainers import every_rank, metrics, own_rank
from gradcomp.state import TrainingHookState

try:
    from accelerate import Accelerator
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("gradcomp.hooks.accelerate needs Accelerate: pip install 'gradcomp[accelerate]'") from error


class EveryRank:
    """A hook state as Accelerate checkpoints custom objects: every rank's state in the one file
    the main process writes (gathered when Accelerate asks every rank for it), each rank taking its
    own back when the checkpoint is loaded."""

    def __init__(self, state: TrainingHookState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return every_rank(self.state)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.load_state_dict(own_rank(saved))


def register(accelerator: Accelerator, model: nn.Module, spec: Any, **options: Any) -> TrainingHookState | None:
    """Attach a gradcomp hook (any DDP spec, or ``auto``) to ``model``, as ``accelerator.prepare``
    returned it, and add its state to what ``accelerator.save_state`` and ``load_state`` keep.

    Returns the hook's state (statistics, the error), or None when Accelerate runs one process (the
    model is not wrapped: nothing to average). ``options`` as :func:`gradcomp.hooks.register`'s.
    """
    from gradcomp import hooks

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes == 1:
        if launched > 1:
            raise RuntimeError(
                f"launched as {launched} processes, but this Accelerator runs alone: on a machine without "
                "GPUs make it with Accelerator(cpu=True), so that its processes form one gloo group"
            )
        return None
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register the hook on the model accelerator.prepare returned (DistributedDataParallel), "
            f"got {type(model).__name__}"
        )
    state: TrainingHookState = hooks.register(model, spec, **options)
    accelerator.register_for_checkpointing(EveryRank(state))
    return state


class Statistics:
    """Logs the hook's statistics once per synchronizing step through ``accelerator.log`` (its
    trackers: TensorBoard, ...): the ``hook/*`` metrics of :func:`gradcomp.hooks.trainers.metrics`.
    Call :meth:`log` after each optimizer step; it reads only the steps not logged yet."""

    def __init__(self, accelerator: Accelerator, state: TrainingHookState | None) -> None:
        self.accelerator, self.state = accelerator, state
        self._next = 0  # the first hook step not logged yet

    def log(self, step: int | None = None) -> dict[str, float]:
        """Log the latest step's metrics at ``step`` and return them: empty when nothing synchronized
        since the last call (an accumulating micro-batch) or for a run of one process."""
        steps = [] if self.state is None else self.state.steps_since(self._next)
        if not steps:
            return {}
        self._next = steps[-1].step + 1
        values = metrics(steps[-1])
        self.accelerator.log(values, step=step)
        return values
