"""DDP communication hooks: thin adapters from DDP's ``GradBucket`` to gradcomp's engine.

>>> from gradcomp import hooks
>>> state, hook = hooks.make("topk:ratio=0.01,ef=true")   # any compressor spec
>>> ddp_model.register_comm_hook(state, hook)
>>> state = hooks.register(ddp_model, "powersgd:rank=4")  # the same, in one line
>>> state = hooks.register(ddp_model, "auto")             # measure, then choose per bucket

Specs are gradcomp compressor specs (``gradcomp compressors`` lists them), plus ``allreduce`` (the
gradient itself, as DDP's default) and ``noop`` (no communication at all: the compute floor, for
benchmarks; training with it does not average anything), with the engine's options (``algo``,
``aggregation``, ``seed``). ``HookSpec.parse`` checks one without a process group. ``auto`` chooses
among candidates with the cost model (:mod:`gradcomp.hooks.auto`). torch's own hooks, as baselines
spelt ``torch:fp16`` and the like: :mod:`gradcomp.hooks.torch_hooks`. :func:`parse` reads any of
them. See ``docs/hooks.md``.
"""

import dataclasses
from typing import Any

import torch

from gradcomp.engine.spec import HookSpec
from gradcomp.hooks import auto, ddp
from gradcomp.hooks.auto import AutoSpec, AutoState, is_auto_spec
from gradcomp.hooks.ddp import HookState, make
from gradcomp.hooks.torch_hooks import TorchHookSpec, is_torch_spec

__all__ = ["AnySpec", "AutoSpec", "AutoState", "HookSpec", "HookState", "make", "parse", "register"]

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


def register(
    model: torch.nn.parallel.DistributedDataParallel, spec: "str | HookSpec | AutoSpec", **options: Any
) -> "HookState | AutoState":
    """Attach a gradcomp hook (or ``auto``) to ``model``, averaging over the group DDP communicates
    on unless ``group`` is given; returns its state (for statistics and checkpoints). ``options``
    as :func:`make`'s (``auto`` takes ``group``, ``timeout`` and ``seed``)."""
    if isinstance(spec, AutoSpec) or (isinstance(spec, str) and is_auto_spec(spec)):
        return auto.register(model, spec, **options)
    return ddp.register(model, spec, **options)
