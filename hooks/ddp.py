"""``hooks.make`` and ``hooks.register``: every gradcomp compressor as a DDP communication hook."""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations at run time.
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket

from gradcomp.collectives.executor import Handle
from gradcomp.compressors.registry import Spec, SpecLike, split_spec
from gradcomp.engine import Engine, check_options
from gradcomp.engine.stats import per_step, write_trace

Hook = Callable[["HookState", GradBucket], torch.futures.Future[Tensor]]

ALIASES = {"allreduce": "none"}
"""Hook names for specs: ``allreduce`` is the uncompressed gradient (torch's default hook)."""


class HookState:
    """What a gradcomp hook keeps between steps: the engine, and a stable key per parameter.

    A parameter's key is its index, numbered in the order DDP first hands parameters to the hook.
    DDP's first iteration always sees the same order, so keys are the same in every run (a
    checkpoint's state finds its tensors again), and since the engine keeps state per parameter,
    DDP's bucket rebuild after the first iteration changes nothing (design rule 6).
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


ENGINE_OPTIONS = ("algo", "aggregation", "seed")
"""Options a hook spec may carry besides the compressor's: ``"topk:ratio=0.01,aggregation=two_phase"``."""


def make(
    spec: SpecLike,
    *,
    group: dist.ProcessGroup | None = None,
    algo: str = "native",
    aggregation: str = "auto",
    seed: int = 0,
) -> tuple[HookState, Hook]:
    """A (state, hook) pair for ``ddp_model.register_comm_hook``. A bad spec fails here, before training.

    Args:
        spec: a compressor spec, ``allreduce`` or ``noop``; it may also set ``algo``,
            ``aggregation`` and ``seed`` (``"fp16:algo=ring"``), which then override the arguments.
        group: the process group (default: DDP's, the world).
        algo: all-reduce algorithm for summable payloads: native, ring, tree or halving_doubling.
        aggregation: for the other compressors: gather, two_phase, or auto (two-phase from 8 ranks).
        seed: seed of the compressor's generators; the same on every rank.
    """
    compressor, engine_options = _resolve(spec, algo=algo, aggregation=aggregation, seed=seed)
    if compressor is None:
        return HookState(None), _gradcomp_hook
    return HookState(Engine(compressor, group=group, **engine_options)), _gradcomp_hook


def check(spec: SpecLike, *, algo: str = "native", aggregation: str = "auto", seed: int = 0) -> None:
    """Raise ValueError if :func:`make` would refuse ``spec``; needs no process group (for configs
    and command lines, to fail before any rank starts)."""
    _resolve(spec, algo=algo, aggregation=aggregation, seed=seed)


def _resolve(
    spec: SpecLike, *, algo: str, aggregation: str, seed: int
) -> tuple[tuple[str, dict[str, Any]] | None, dict[str, Any]]:
    """The compressor's (name, options), None for noop, and the engine's options, all validated."""
    name, options = _split(spec)
    engine_options: dict[str, Any] = {"algo": algo, "aggregation": aggregation, "seed": seed}
    for key in ENGINE_OPTIONS:
        if key in options:
            engine_options[key] = options.pop(key)
    try:
        engine_options["seed"] = int(engine_options["seed"])
    except (TypeError, ValueError):
        raise ValueError(f"seed must be an integer, got {engine_options['seed']!r}") from None
    if name == "noop":
        if options:
            raise ValueError(f"noop takes no options, got {sorted(options)}")
        return None, engine_options
    compressor = (ALIASES.get(name, name), options)
    check_options(compressor, algo=engine_options["algo"], aggregation=engine_options["aggregation"])
    return compressor, engine_options


def _split(spec: SpecLike) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        return split_spec(spec)
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
        return spec[0].strip(), dict(spec[1])
    if isinstance(spec, Spec):
        return spec.name, {**dataclasses.asdict(spec.config), "ef": spec.ef}
    raise TypeError(f"a hook spec is a string or a (name, options) pair, got {spec!r}")


def register(model: torch.nn.parallel.DistributedDataParallel, spec: SpecLike, **options: Any) -> HookState:
    """``make`` and ``model.register_comm_hook`` in one call; returns the state (for checkpoints)."""
    state, hook = make(spec, **options)
    model.register_comm_hook(state, hook)
    return state
