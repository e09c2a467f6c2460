"""``hooks.make`` and ``hooks.register``: every gradcomp compressor as a DDP communication hook."""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at run time.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket

from gradcomp.collectives.executor import Handle
from gradcomp.engine import Engine
from gradcomp.engine.spec import HookSpec, HookSpecLike
from gradcomp.engine.stats import per_step, write_trace

Hook = Callable[["HookState", GradBucket], torch.futures.Future[Tensor]]


class HookState:
    """What a gradcomp hook keeps between steps: the engine, and a stable key per parameter.

    A parameter's key is its index, numbered in the order DDP first hands parameters to the hook.
    DDP's first iteration always sees the same order, so keys are the same in every run (a
    checkpoint's state finds its tensors again), and since the engine keeps state per parameter,
    DDP's bucket rebuild after the first iteration changes nothing (rule "state per tensor").
    """

    def __init__(self, engine: Engine | None) -> None:
        self.engine = engine
        self._indices: dict[int, int] = {}

    def keys(self, parameters: list[Tensor]) -> list[int]:
        return [self._indices.setdefault(id(p), len(self._indices)) for p in parameters]

    def steps(self) -> list[dict[str, Any]]:
        """Per step: buckets, input and payload bytes, compression ratio, bytes sent and received
        (None with the native all-reduce), seconds in compress / communicate / decompress.
        Read it after a step's backward (DDP has waited for every bucket by then)."""
        return [] if self.engine is None else per_step(self.engine.records)

    def write_trace(self, path: str) -> None:
        """A Chrome / Perfetto JSON trace of every recorded bucket: ready, queued, and each phase."""
        if self.engine is not None:
            write_trace(self.engine.records, path, dist.get_rank())

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state (residuals, warm starts, generators): loadable with
        ``torch.load(..., weights_only=True)``."""
        return {} if self.engine is None else {"compressor": self.engine.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self.engine is not None:
            self.engine.compressor.load_state_dict(state["compressor"])


def _gradcomp_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    buffer = bucket.buffer()
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    if state.engine is None:  # noop: the compute floor
        future.set_result(buffer)
        return future
    parameters = bucket.parameters()

    def finished(handle: Handle[Tensor]) -> None:
        try:
            future.set_result(handle.wait())
        except Exception as error:  # reaches DDP's wait in the training thread
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub says Tensor

    keys, shapes = state.keys(parameters), [p.shape for p in parameters]
    state.engine.reduce(buffer, keys, shapes, bucket.index(), bucket.is_last()).then(finished)
    return future


def make(
    spec: HookSpecLike,
    *,
    group: dist.ProcessGroup | None = None,
    algo: str | None = None,
    aggregation: str | None = None,
    seed: int | None = None,
) -> tuple[HookState, Hook]:
    """A (state, hook) pair for ``ddp_model.register_comm_hook``. A bad spec fails here, before training.

    Args:
        spec: a hook spec (:class:`HookSpec` or its text): a compressor spec, ``allreduce`` or
            ``noop``; its text may also set ``algo``, ``aggregation`` and ``seed``
            (``"fp16:algo=ring"``), which then override the arguments below.
        group: the process group (default: DDP's, the world).
        algo: all-reduce algorithm for summable payloads: native (default), ring, tree or halving_doubling.
        aggregation: for the other compressors: gather, two_phase, or auto (default: two-phase from 8 ranks).
        seed: seed of the compressor's generators (default 0); the same on every rank.
    """
    given = {"algo": algo, "aggregation": aggregation, "seed": seed}
    parsed = HookSpec.parse(spec, **{key: value for key, value in given.items() if value is not None})
    if parsed.noop:
        return HookState(None), _gradcomp_hook
    return HookState(Engine(parsed, group=group)), _gradcomp_hook


def register(model: torch.nn.parallel.DistributedDataParallel, spec: HookSpecLike, **options: Any) -> HookState:
    """``make`` and ``model.register_comm_hook`` in one call; returns the state (for checkpoints)."""
    state, hook = make(spec, **options)
    model.register_comm_hook(state, hook)
    return state
