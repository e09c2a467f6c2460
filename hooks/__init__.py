"""DDP communication hooks: thin adapters from DDP's ``GradBucket`` to gradcomp's engine.

>>> from gradcomp import hooks
>>> state, hook = hooks.make("topk:ratio=0.01,ef=true")   # any compressor spec
>>> ddp_model.register_comm_hook(state, hook)
>>> state = hooks.register(ddp_model, "powersgd:rank=4")  # the same, in one line
>>> state = hooks.register(ddp_model, "auto")             # measure, then choose per bucket
>>> state = hooks.fsdp(fsdp_model, "quantize:bits=4,ef=true")  # FSDP2: a compressed reduce-scatter

Specs are gradcomp compressor specs (``gradcomp compressors`` lists them), plus ``allreduce`` (the
gradient itself, as DDP's default) and ``noop`` (no communication at all: the compute floor, for
benchmarks; training with it does not average anything), with the engine's options (``algo``,
``aggregation``, ``seed``). ``HookSpec.parse`` checks one without a process group. ``auto`` chooses
among candidates with the cost model (:mod:`gradcomp.hooks.auto`). torch's own hooks, as baselines
spelt ``torch:fp16`` and the like: :mod:`gradcomp.hooks.torch_hooks`. :func:`parse` reads any of
them. FSDP2's compressed reduce-scatter: :mod:`gradcomp.hooks.fsdp2` (``docs/fsdp.md``). See ``docs/hooks.md``.
"""

import dataclasses
from typing import Any

import torch

from gradcomp.engine.spec import HookSpec
from gradcomp.hooks import auto, ddp, fsdp2
from gradcomp.hooks.auto import AutoSpec, AutoState, is_auto_spec
from gradcomp.hooks.ddp import HookState, make
from gradcomp.hooks.torch_hooks import TorchHookSpec, is_torch_spec

__all__ = ["AnySpec", "AutoSpec", "AutoState", "HookSpec", "HookState", "fsdp", "make", "parse", "register"]

fsdp = fsdp2.fsdp

AnySpec = HookSpec | TorchHookSpec | AutoSpec
"""A parsed hook spec of any kind: gradcomp's, torch's (``torch:...``) or ``auto``."""


def parse(spec: "str | AnySpec", seed: int | None = None) -> AnySpec:
    """Any hook spec, checked without a process group (a ValueError names what is wrong and the
    valid choices). ``seed`` applies to gradcomp's and ``auto``'s generators unless the spec sets one."""
    if isinstance(spec, (HookSpec, TorchHookSpec, AutoSpec)):
        return spec
    if is_torch_spec(spec):
        return TorchHookSpec.parse(spec)
    if is_auto_spec(spec):
        parsed = AutoSpec.parse(spec)
        sets_seed = "seed=" in spec.replace(" ", "")
        return parsed if seed is None or sets_seed else dataclasses.replace(parsed, seed=seed)
    return HookSpec.parse(spec) if seed is None else HookSpec.parse(spec, seed=seed)


def register(model: torch.nn.Module, spec: "str | HookSpec | AutoSpec", **options: Any) -> "HookState | AutoState":
    """Attach a gradcomp hook (or ``auto``) to a DDP ``model``, averaging over the group DDP
    communicates on unless ``group`` is given, or gradcomp's reduce-scatter to an FSDP2 model
    (:func:`fsdp`); returns its state (for statistics and checkpoints). ``options`` as :func:`make`'s
    (``auto`` takes ``group``, ``timeout`` and ``seed``; FSDP2 :func:`fsdp`'s)."""
    if fsdp2.is_fsdp(model):
        if isinstance(spec, AutoSpec) or (isinstance(spec, str) and is_auto_spec(spec)):
            raise ValueError("auto chooses among DDP hooks; for FSDP2 name a sharded spec (docs/fsdp.md)")
        return fsdp2.fsdp(model, spec, **options)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"hooks attach to a DistributedDataParallel or FSDP2 model, got {type(model).__name__}")
    if isinstance(spec, AutoSpec) or (isinstance(spec, str) and is_auto_spec(spec)):
        return auto.register(model, spec, **options)
    return ddp.register(model, spec, **options)
