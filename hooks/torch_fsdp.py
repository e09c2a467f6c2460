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

FSDP2's native HSDP (a model sharded over a 2-D mesh, ``("replicate", "shard")``) reduce-scatters
inside the node, then all-reduces the shard across replicas: its records count both, the
reduce-scatter as ``intra_node_bytes`` and a ring all-reduce's 2 (r - 1) / r of the shard across
(timed until FSDP2's all-reduce hook, which it calls once the all-reduce is done).
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from gradcomp.engine.stats import BucketRecord, CallSteps, StepStats, steps_since, write_trace
from gradcomp.hooks.ddp import check_saved
from gradcomp.hooks.fsdp2 import DTensor, shard_group, sharded_modules
from gradcomp.hooks.torch_fsdp_spec import TorchFSDPSpec
from gradcomp.state import TrainingHookState

try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # pragma: no cover - torch without FSDP2's custom reduce-scatter
    DefaultReduceScatter = None  # type: ignore[assignment,misc]

RECORDS = 10_000


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
    """FSDP2's default reduce-scatter, each call recorded in ``state`` (per module ``key``); with
    ``replicas`` > 1 (native HSDP) the record waits for the all-reduce across them (:meth:`all_reduced`)."""

    def __init__(self, state: TorchFSDPState, key: str, replicas: int = 1) -> None:
        super().__init__()
        self.state, self.key, self.replicas = state, key, replicas
        self._pending: BucketRecord | None = None

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
        if self.replicas > 1:
            record.intra_node_bytes = leaving
            self._pending = record
        else:
            self.state.records.append(record)
        return result

    def all_reduced(self, shard: Tensor) -> None:
        """FSDP2's all-reduce hook under native HSDP, called once the shard is averaged across the
        replicas: the module's record closed with that all-reduce (a ring's count)."""
        record, self._pending = self._pending, None
        if record is None:
            return  # gradients accumulated without a reduce-scatter of this module: nothing to close
        across = 2 * (self.replicas - 1) / self.replicas * shard.numel() * shard.element_size()
        record.payload_bytes += int(across)
        record.add_traffic(None, native=across)
        end = time.perf_counter()
        record.add_span("communicate", record.finished, end)
        record.finished = end
        self.state.records.append(record)


def register(model: nn.Module, spec: TorchFSDPSpec | str) -> TorchFSDPState:
    """Record FSDP2's own reduce-scatter on every FSDP2 module of ``model`` holding parameters (after
    ``fully_shard``, with :meth:`TorchFSDPSpec.policy`), and under native HSDP its all-reduce too."""
    parsed = spec if isinstance(spec, TorchFSDPSpec) else TorchFSDPSpec.parse(spec)
    modules = sharded_modules(model)
    state = TorchFSDPState(parsed, dist.get_world_size(shard_group(modules[0][1])))
    replicas = native_replicas(modules[0][1])
    for name, module in modules:
        recorded = RecordedReduceScatter(state, name, replicas)
        module.set_custom_reduce_scatter(recorded)
        if replicas > 1:
            module.set_all_reduce_hook(recorded.all_reduced)
    return state


def native_replicas(module: nn.Module) -> int:
    """How many replicas FSDP2 all-reduces an FSDP2 module's shards across itself: the size of its
    mesh's replicate dimension under native HSDP (a 2-D mesh), else 1."""
    parameter = next(module.parameters())
    if not isinstance(parameter, DTensor):
        return 1
    dims = [i for i, placement in enumerate(parameter.placements) if placement.is_replicate()]
    return parameter.device_mesh.size(dims[0]) if dims else 1
