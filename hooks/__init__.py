"""DDP communication hooks: thin adapters from DDP's ``GradBucket`` to gradcomp's engine.

>>> from gradcomp import hooks
>>> state, hook = hooks.make("topk:ratio=0.01,ef=true")   # any compressor spec
>>> ddp_model.register_comm_hook(state, hook)
>>> state = hooks.register(ddp_model, "powersgd:rank=4")  # the same, in one line
>>> state = hooks.register(ddp_model, "auto")             # measure, then choose per bucket
>>> state = hooks.fsdp(fsdp_model, "quantize:bits=4,ef=true")  # FSDP2: a compressed reduce-scatter
>>> state = hooks.hsdp(node_sharded, "quantize:bits=4,ef=true")  # HSDP: compressed across nodes

Specs are gradcomp compressor specs (``gradcomp compressors`` lists them), plus ``allreduce`` (the
gradient itself, as DDP's default) and ``noop`` (no communication at all: the compute floor, for
benchmarks; training with it does not average anything), with the engine's options (``algo``,
``aggregation``, ``seed``, ...). ``auto`` chooses among candidates with the cost model
(:mod:`gradcomp.hooks.auto`). torch's own hooks, as baselines spelt ``torch:fp16`` and the like:
:mod:`gradcomp.hooks.torch_hooks`. :func:`parse` checks any of them without a process group (a
wrong one is a one-line ValueError with the closest valid name or option and all of them);
``HookSpec.parse`` parses the engine's own (not ``auto``, not ``torch:...``). FSDP2's compressed
reduce-scatter: :mod:`gradcomp.hooks.fsdp2` (``docs/fsdp.md``); HSDP's compressed all-reduce across
nodes: :mod:`gradcomp.hooks.hybrid`. Every state they return is a
:class:`~gradcomp.state.TrainingHookState` (statistics, traces, checkpoints, the error). See
``docs/hooks.md``.
"""

import importlib
import sys
import typing
from typing import Any

import torch

from gradcomp import launch
from gradcomp.engine.sharded import ShardSpec
from gradcomp.engine.spec import HookSpec
from gradcomp.hooks import ddp, torch_hooks
from gradcomp.hooks.auto_spec import AutoSpec, is_auto_spec
from gradcomp.hooks.compressed_adamw import CompressedAdamW, CompressedAdamWState
from gradcomp.hooks.compressed_adamw_spec import CompressedAdamWSpec
from gradcomp.hooks.ddp import HookState, make
from gradcomp.hooks.torch_fsdp_spec import TorchFSDPSpec
from gradcomp.hooks.torch_hooks import TorchHookSpec, TorchHookState, is_torch_spec
from gradcomp.state import TrainingHookState

if typing.TYPE_CHECKING:
    from gradcomp.hooks.auto import AutoState
    from gradcomp.hooks.hybrid import HSDPState
    from gradcomp.hooks.torch_fsdp import TorchFSDPState

__all__ = [
    "AnyShardedSpec",
    "AnySpec",
    "AutoSpec",
    "AutoState",
    "CompressedAdamW",
    "CompressedAdamWSpec",
    "CompressedAdamWState",
    "HSDPState",
    "HookSpec",
    "HookState",
    "ShardSpec",
    "TorchFSDPSpec",
    "TorchFSDPState",
    "TrainingHookState",
    "fsdp",
    "hsdp",
    "make",
    "parse",
    "parse_hybrid",
    "parse_sharded",
    "register",
]

LAZY = {
    "fsdp": ("gradcomp.hooks.fsdp2", "fsdp"),
    "hsdp": ("gradcomp.hooks.hybrid", "hsdp"),
    "HSDPState": ("gradcomp.hooks.hybrid", "HSDPState"),
    "TorchFSDPState": ("gradcomp.hooks.torch_fsdp", "TorchFSDPState"),
    "AutoState": ("gradcomp.hooks.auto", "AutoState"),
}
"""Names imported on first use: FSDP2's hooks import FSDP2 itself (0.6 s here), ``auto`` its cost
model; a DDP script that imports the hooks needs neither."""


def __getattr__(name: str) -> Any:
    if name in LAZY:
        module, attribute = LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


launch.preload(__name__)  # ranks started from this process find the hooks imported (gradcomp.launch.preload)

AnySpec = HookSpec | TorchHookSpec | AutoSpec
"""A parsed hook spec of any kind: gradcomp's, torch's (``torch:...``) or ``auto``."""
AnyShardedSpec = ShardSpec | TorchFSDPSpec
"""A parsed spec of a sharded (FSDP2) run: gradcomp's reduce-scatter, or FSDP2's own (``torch:...``)."""


def parse(spec: "str | AnySpec", seed: int | None = None) -> AnySpec:
    """Any spec a DDP hook takes, checked without a process group: gradcomp's (:class:`HookSpec`),
    ``auto`` (:class:`AutoSpec`) or torch's own (``torch:fp16``, :class:`TorchHookSpec`). The one
    function to check a spec a user gives (``parse_sharded`` and ``parse_hybrid`` for FSDP2 and HSDP):
    a wrong one is a ValueError of one line naming what is wrong, the closest valid name or option
    ("did you mean"), and every valid one, the hooks' own and the engine's options included.
    ``seed`` applies to gradcomp's and ``auto``'s generators unless the spec sets one."""
    if isinstance(spec, (HookSpec, TorchHookSpec, AutoSpec)):
        return spec
    if is_torch_spec(spec):
        return TorchHookSpec.parse(spec)
    if is_auto_spec(spec):
        return AutoSpec.parse(spec) if seed is None else AutoSpec.parse(spec, seed=seed)
    return HookSpec.parse(spec) if seed is None else HookSpec.parse(spec, seed=seed)


def parse_sharded(spec: "str | HookSpec | AnyShardedSpec", seed: int | None = None) -> AnyShardedSpec:
    """Any spec of a sharded run, checked without a process group: a sharded gradcomp spec
    (:class:`ShardSpec`) or FSDP2's own reduction (``torch:reduce_scatter``, ``torch:bf16``, ``torch:fp16``).
    ``seed`` applies to gradcomp's generators unless the spec sets one."""
    if isinstance(spec, (ShardSpec, TorchFSDPSpec)):
        return spec
    if isinstance(spec, str) and is_torch_spec(spec):
        return TorchFSDPSpec.parse(spec)
    if is_auto_spec(spec):
        raise ValueError("auto chooses among DDP hooks; a sharded run names a sharded spec (docs/fsdp.md)")
    return ShardSpec.parse(spec) if seed is None else ShardSpec.parse(spec, seed=seed)


def parse_hybrid(spec: "str | HookSpec | TorchFSDPSpec", seed: int | None = None) -> "HookSpec | TorchFSDPSpec":
    """Any spec of an HSDP run, checked without a process group: gradcomp's all-reduce across nodes
    (a hook spec that works on a flat shard: :func:`gradcomp.hooks.hybrid.parse`) or FSDP2's own
    HSDP (``torch:reduce_scatter``, ``torch:bf16``, ``torch:fp16``: the 2-D mesh, uncompressed).
    ``seed`` applies to gradcomp's generators unless the spec sets one."""
    from gradcomp.hooks import hybrid

    if isinstance(spec, TorchFSDPSpec):
        return spec
    if isinstance(spec, str) and is_torch_spec(spec):
        return TorchFSDPSpec.parse(spec)
    return hybrid.parse(spec) if seed is None else hybrid.parse(spec, seed=seed)


@typing.overload
def register(
    model: torch.nn.parallel.DistributedDataParallel,
    spec: "str | HookSpec | AutoSpec | TorchHookSpec | HookState",
    **options: Any,
) -> "HookState | AutoState | TorchHookState": ...


@typing.overload
def register(
    model: torch.nn.Module, spec: "str | HookSpec | AnyShardedSpec", **options: Any
) -> "HookState | TorchFSDPState": ...


def register(
    model: torch.nn.Module,
    spec: "str | HookSpec | AutoSpec | TorchHookSpec | AnyShardedSpec | HookState",
    **options: Any,
) -> "HookState | AutoState | TorchHookState | TorchFSDPState":
    """Attach a gradcomp hook (or ``auto``, torch's own ``torch:...`` hooks recorded, or a state
    :func:`make` returned before the process group existed) to a DDP ``model``, averaging over the group DDP
    communicates on unless ``group`` is given, or gradcomp's reduce-scatter to an FSDP2 model
    (:func:`fsdp`, or FSDP2's own for ``torch:reduce_scatter`` and the like); returns its state (for
    statistics and checkpoints). ``options`` as :func:`make`'s (``auto`` takes ``group``, ``timeout``
    and ``seed``; FSDP2 :func:`fsdp`'s)."""
    if _is_fsdp(model):
        from gradcomp.hooks import fsdp2, torch_fsdp

        if isinstance(spec, HookState):
            raise TypeError("a state made by hooks.make is a DDP hook's; give an FSDP2 model a sharded spec")
        if isinstance(spec, AutoSpec):
            raise ValueError("auto chooses among DDP hooks; a sharded run names a sharded spec (docs/fsdp.md)")
        if isinstance(spec, TorchHookSpec):
            raise TypeError(f"{spec} is a DDP hook of torch's; an FSDP2 model takes torch:reduce_scatter and the like")
        parsed = parse_sharded(spec)
        if isinstance(parsed, TorchFSDPSpec):
            return torch_fsdp.register(model, parsed)
        return fsdp2.fsdp(model, parsed, **options)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"hooks attach to a DistributedDataParallel or FSDP2 model, got {type(model).__name__}")
    if isinstance(spec, (ShardSpec, TorchFSDPSpec)):
        raise TypeError(f"{spec} is a spec of sharded training; this model is DDP's")
    ddp.check_no_hook(model)  # one hook per DDP model, whatever its kind: said before any is built
    if isinstance(spec, AutoSpec) or (isinstance(spec, str) and is_auto_spec(spec)):
        from gradcomp.hooks import auto

        return auto.register(model, spec, **options)
    if isinstance(spec, TorchHookSpec) or (isinstance(spec, str) and is_torch_spec(spec)):
        return torch_hooks.register(model, spec, **options)  # torch's own, recorded (as FSDP2's are above)
    return ddp.register(model, spec, **options)


def _is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds an FSDP2 module. Its classes come from ``torch.distributed.fsdp``:
    where that was never imported, none was made, and it is not imported to ask."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from gradcomp.hooks import fsdp2

    return fsdp2.is_fsdp(model)
