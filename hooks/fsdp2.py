"""FSDP2 hooks: gradcomp's compressed reduce-scatter in place of FSDP2's own.

>>> from torch.distributed.fsdp import fully_shard
>>> for layer in model.layers:
...     fully_shard(layer)
>>> fully_shard(model)
>>> state = gradcomp.hooks.fsdp(model, "quantize:bits=4,ef=true")   # or hooks.register(model, ...)

FSDP2 reduce-scatters each module's gradients once per backward: every rank hands over a flat input
of p equal shards (each parameter's gradient padded and cut into p row blocks, shard j for rank j)
and takes back its own shard of the average. :func:`fsdp` installs, on every FSDP module holding
parameters, a reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that sends the shards
compressed through a :class:`~gradcomp.engine.sharded.ShardedEngine`, keyed by the module's name,
so that error feedback follows each module's shards from step to step. FSDP2's op is kept exactly:
``AVG`` divides by the shard group's size, ``SUM`` by nothing (FSDP then divides before and after, as
it does for fp16), a pre-multiplied sum (``set_gradient_divide_factor``) by its factor, which gloo
cannot do itself. Mixed precision applies as it does without gradcomp: the input comes in
``MixedPrecisionPolicy.reduce_dtype`` and gradcomp sums peers' shards in float32, rounding once.

With ``param_bits`` it also installs a parameter all-gather (``set_custom_all_gather``) that
gathers every rank's shard rounded to the nearest of 2^bits levels (DeepSpeed ZeRO++'s qwZ).

The calls complete before they return (FSDP2 on the CPU waits for its own collectives, too); on a
GPU they run on FSDP2's streams. Specs are :class:`~gradcomp.engine.sharded.ShardSpec` texts (see
``docs/fsdp.md``); FSDP2's own reduction as a baseline: :mod:`gradcomp.hooks.torch_fsdp`.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradcomp.collectives.groups import as_timeout
from gradcomp.compressors import fusion
from gradcomp.engine.columns import dense_columns
from gradcomp.engine.sharded import ShardedEngine, ShardSpec, ShardSpecLike
from gradcomp.engine.transport import all_gather_single
from gradcomp.hooks.ddp import HookState

try:  # FSDP2's custom reduce-scatter (torch's own protocol; absent from older releases)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = AllGather = ReduceScatter = DTensor = None  # type: ignore[assignment,misc]


def available() -> bool:
    """Whether this torch has FSDP2 with a custom reduce-scatter."""
    return FSDPModule is not None and hasattr(FSDPModule, "set_custom_reduce_scatter")


class CompressedReduceScatter(ReduceScatter if ReduceScatter is not None else object):  # type: ignore[misc]
    """FSDP2's ``ReduceScatter`` for one FSDP module, through the hook's engine (``key``: the module's
    name). ``noop`` (no engine) keeps each rank's own shard, divided: the compute floor. With the
    spec's per-tensor policy (``min_numel``, ``vectors``) the columns of the parameters it picks travel
    uncompressed (:mod:`gradcomp.engine.columns`)."""

    def __init__(self, state: HookState, key: str, module: Any = None) -> None:
        self.state, self.key = state, key
        self.shards: list[tuple[torch.Size, int]] = [] if module is None else parameter_shards(module)
        """Per parameter of the module, in FSDP2's order: its shape and the elements of its shard."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any, async_op: bool = False
    ) -> None:
        try:
            world = group.size()
            if world != self.state.world:
                raise ValueError(
                    f"FSDP reduce-scatters over {world} ranks, the hook was made for {self.state.world}: "
                    "make it after fully_shard, with the shard group FSDP uses"
                )
            divisor = divisor_of(op, world)
            engine = self.state.engine
            if engine is None:
                torch.div(input_tensor.view(world, -1)[group.rank()], divisor, out=output_tensor)
            else:
                assert isinstance(engine, ShardedEngine)
                if self.state.loss_scale is not None and engine.calls.starts_step(self.key):
                    self.state.follow_scale()
                assert isinstance(self.state.spec, ShardSpec)
                dense = dense_columns(self.state.spec.hook, self.shards, output_tensor.numel()) if self.shards else None
                engine.reduce_scatter(output_tensor, input_tensor, divisor, self.key, dense or ())
        except Exception as error:
            self.state.error = self.state.error or error  # the first is the cause; later ones its consequences
            raise


class QuantizedAllGather(AllGather if AllGather is not None else object):  # type: ignore[misc]
    """FSDP2's ``AllGather`` of parameters through the engine's parameter codec (``param_bits``:
    ZeRO++'s qwZ). Parameters FSDP2 gathers as raw bytes (mixed dtypes) travel exactly."""

    def __init__(self, state: HookState) -> None:
        self.state = state

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        try:
            engine = self.state.engine
            assert isinstance(engine, ShardedEngine)
            if input_tensor.is_floating_point():
                engine.all_gather(output_tensor, input_tensor)
            else:
                all_gather_single(output_tensor, input_tensor, group=group)
        except Exception as error:
            self.state.error = self.state.error or error
            raise


def divisor_of(op: Any, world: int) -> float:
    """What FSDP2's reduce op divides the sum by: ``AVG`` the world size, ``SUM`` 1, a pre-multiplied
    sum (``ReduceOp.PREMUL_SUM(1 / factor)``) its factor (a whole factor exactly, as FSDP computed
    it). Any other op is refused: gradients are averaged, never maxed."""
    if op == dist.ReduceOp.AVG:
        return float(world)
    if op == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, float) or not factor > 0:
            raise ValueError(f"a pre-multiplied sum needs a positive factor, got {factor!r}")
        divisor = 1 / factor
        return float(round(divisor)) if math.isclose(divisor, round(divisor), rel_tol=1e-12) else divisor
    if op == dist.ReduceOp.SUM:
        return 1.0
    raise ValueError(f"gradients are reduced by SUM, AVG or a pre-multiplied sum; FSDP asked for {op}")


def fsdp(
    model: nn.Module,
    spec: ShardSpecLike,
    *,
    group: dist.ProcessGroup | None = None,
    algo: str | None = None,
    seed: int | None = None,
    timeout: datetime.timedelta | float | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> HookState:
    """Install gradcomp's reduce-scatter on every FSDP2 module of ``model`` that holds parameters
    (call it after ``fully_shard``, on every rank); returns the hook's state (statistics and
    checkpoints, as a DDP hook's). A bad spec fails here, before any rank communicates.

    Args:
        model: the root of an FSDP2 model (the module ``fully_shard`` was last applied to, or any
            module holding FSDP2 modules).
        spec: a sharded spec (:class:`~gradcomp.engine.sharded.ShardSpec`): ``none`` (the backend's
            reduce-scatter: FSDP2's own), ``noop``, any compressor that works on a flat shard
            (``quantize:bits=4,ef=true``), with ``algo`` (native or ring), ``seed``, ``local_size``
            (two hops, that many ranks per node) and ``param_bits`` (a quantized parameter
            all-gather, ZeRO++'s qwZ; off by default).
        group: the ranks that share the shards; default: the group of the parameters' shard mesh
            dimension (FSDP2's own).
        algo, seed: defaults for the spec's ``algo`` and ``seed`` where its text sets none.
        timeout: what any collective of the hook may take before it fails, naming the peer;
            default: ``group``'s own.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision run: error feedback's residuals
            then follow its loss scale, rescaled at a step's first reduce-scatter when it changed
            (:meth:`~gradcomp.hooks.ddp.HookState.follow`).
    """
    timeout = as_timeout(timeout)  # a number of seconds, or refused here
    if not available():
        raise RuntimeError(
            f"torch {torch.__version__} has no FSDP2 custom reduce-scatter (FSDPModule.set_custom_reduce_scatter)"
        )
    given = {"algo": algo, "seed": seed}
    parsed = ShardSpec.parse(spec, **{key: value for key, value in given.items() if value is not None})
    modules = sharded_modules(model)
    if group is None:
        group = shard_group(modules[0][1])
    engine = None if parsed.noop else ShardedEngine(parsed, group=group, timeout=timeout)
    state = HookState(parsed, engine, dist.get_world_size(group))
    if scaler is not None:
        state.follow(scaler)
    for name, module in modules:
        policy = module if parsed.hook.keeps_some_dense else None  # the module's parameters, for the policy
        module.set_custom_reduce_scatter(CompressedReduceScatter(state, name, policy))
        if parsed.param_bits:
            module.set_custom_all_gather(QuantizedAllGather(state))
    parameter = next(model.parameters(), None)
    if parsed.compressor is not None and parameter is not None:  # its fused kernels, before the first step
        fusion.precompile(parsed.compressor, parameter.dtype, parameter.device)
    return state


register = fsdp


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` is (or holds) an FSDP2 module."""
    return available() and any(isinstance(m, FSDPModule) for m in model.modules())


def sharded_modules(model: nn.Module) -> list[tuple[str, Any]]:
    """``(name, module)`` of every FSDP2 module of ``model`` that holds parameters (FSDP2 reduce-
    scatters only those), names as ``model.named_modules()`` gives them (the root's is "")."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups
    ]
    if not found:
        raise ValueError("the model holds no FSDP2 module with parameters: apply fully_shard to it first")
    return found


def parameter_shards(module: Any) -> list[tuple[torch.Size, int]]:
    """Per trainable parameter of an FSDP2 module (frozen ones have no gradient to reduce), in the
    order FSDP2 lays out its reduce-scatter input: the parameter's shape and the elements of its
    (padded) shard, the columns it holds in every row."""
    (group,) = module._get_fsdp_state()._fsdp_param_groups  # one mesh per module
    trainable = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
    return [(p._orig_size, p.padded_sharded_param_size.numel()) for p in trainable]


def shard_group(module: nn.Module) -> dist.ProcessGroup:
    """The process group an FSDP2 module shards its parameters over: that of its mesh's shard dimension."""
    parameter = next(module.parameters())
    if not isinstance(parameter, DTensor):
        raise ValueError("an FSDP2 module's parameters are DTensors; this one's are not (fully_shard it first)")
    dims = [i for i, placement in enumerate(parameter.placements) if placement.is_shard()]
    if not dims:
        raise ValueError(f"the parameters are not sharded (placements {parameter.placements})")
    return parameter.device_mesh.get_group(dims[-1])
