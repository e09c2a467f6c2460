"""FSDP2's own gradient reduction, spelt ``torch:NAME`` in sharded runs: the anchors of every comparison.

::

    torch:reduce_scatter     FSDP2's default: gradients reduce-scattered in their own dtype (float32)
    torch:bf16, torch:fp16   FSDP2 with MixedPrecisionPolicy(reduce_dtype=...): cast, then reduce-scattered

The reduce dtype is part of how a model is sharded (:meth:`TorchFSDPSpec.policy`, given to
``fully_shard``). :func:`register` then installs FSDP2's own reduce-scatter (torch's
``DefaultReduceScatter``, subclassed only to record each call: FSDP2 takes the same path as
without it) and returns a :class:`TorchFSDPState`, with the same per-step records as a gradcomp
hook's ``steps()``. ``sent_estimate`` counts what a ring reduce-scatter sends, (p - 1) / p of the
input: the backend's traffic is not observable.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradcomp.engine.stats import BucketRecord, CallSteps, StepStats, steps_since, write_trace
from gradcomp.hooks.ddp import check_saved
from gradcomp.hooks.fsdp2 import shard_group, sharded_modules
from gradcomp.hooks.torch_hooks import PREFIX, is_torch_spec
from gradcomp.state import TrainingHookState

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # pragma: no cover - torch without FSDP2's custom reduce-scatter
    MixedPrecisionPolicy = DefaultReduceScatter = None  # type: ignore[assignment,misc]

REDUCE_DTYPES: dict[str, torch.dtype | None] = {"reduce_scatter": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""FSDP2's reductions by name (after ``torch:``), with the reduce dtype each sets (None: the gradient's)."""
RECORDS = 10_000


@dataclasses.dataclass(frozen=True)
class TorchFSDPSpec:
    """A parsed ``torch:`` spec of a sharded run: FSDP2's own reduce-scatter, in a reduce dtype."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in REDUCE_DTYPES:
            valid = ", ".join(PREFIX + n for n in REDUCE_DTYPES)
            raise ValueError(f"unknown FSDP2 reduction {PREFIX + self.name!r}; valid in sharded runs: {valid}")

    @classmethod
    def parse(cls, text: str) -> TorchFSDPSpec:
        if not is_torch_spec(text):
            raise ValueError(f"an FSDP2 reduction spec starts with {PREFIX!r}, got {text!r}")
        return cls(text.strip()[len(PREFIX) :])

    def __str__(self) -> str:
        return PREFIX + self.name

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return REDUCE_DTYPES[self.name]

    def policy(self) -> Any:
        """The ``MixedPrecisionPolicy`` to shard the model with (None: FSDP2's default)."""
        return None if self.reduce_dtype is None else MixedPrecisionPolicy(reduce_dtype=self.reduce_dtype)


class TorchFSDPState(TrainingHookState):
    """FSDP2's own reduce-scatter on a sharded model, and what it sent (:meth:`steps`, as a gradcomp
    hook's; only ``communicate_s`` is timed: the whole reduce-scatter)."""

    def __init__(self, spec: TorchFSDPSpec, world: int) -> None:
        self.spec, self.world = spec, world
        self.error: BaseException | None = None  # FSDP2's errors reach the training loop as they are
        self.records: collections.deque[BucketRecord] = collections.deque(maxlen=RECORDS)
        self.calls = CallSteps()

    def steps_since(self, first: int) -> list[StepStats]:
        return steps_since(self.records, first)

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        write_trace(self.records, path, dist.get_rank())

    def state_dict(self) -> dict[str, Any]:
        return {"spec": str(self.spec), "world_size": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_saved(state, str(self.spec), self.world, "FSDP2")


class RecordedReduceScatter(DefaultReduceScatter if DefaultReduceScatter is not None else object):  # type: ignore[misc]
    """FSDP2's default reduce-scatter, each call recorded in ``state`` (per module ``key``)."""

    def __init__(self, state: TorchFSDPState, key: str) -> None:
        super().__init__()
        self.state, self.key = state, key

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any, async_op: bool = False
    ) -> Any:
        leaving = (group.size() - 1) * output_tensor.numel() * output_tensor.element_size()
        record = BucketRecord(*self.state.calls.number(self.key), leaving, time.perf_counter(), payload_bytes=leaving)
        record.started = record.queued
        with record.phase("communicate"):
            result = super().__call__(output_tensor, input_tensor, group, op, async_op)
        record.add_traffic(None, native=leaving)  # a ring's: every other rank's shard, once
        record.finished = time.perf_counter()
        self.state.records.append(record)
        return result


def register(model: nn.Module, spec: TorchFSDPSpec | str) -> TorchFSDPState:
    """Record FSDP2's own reduce-scatter on every FSDP2 module of ``model`` holding parameters (after
    ``fully_shard``, with :meth:`TorchFSDPSpec.policy`)."""
    parsed = spec if isinstance(spec, TorchFSDPSpec) else TorchFSDPSpec.parse(spec)
    modules = sharded_modules(model)
    state = TorchFSDPState(parsed, dist.get_world_size(shard_group(modules[0][1])))
    for name, module in modules:
        module.set_custom_reduce_scatter(RecordedReduceScatter(state, name))
    return state
