"""What the benchmark reads of a hooked model's per-step records (``state.steps()``): the bytes one
rank sent, the engine's phases and host reads (the only place in ``gradcomp bench ddp``/``fsdp``
that reads them, so a change of their layout changes here alone); and what the hook's kernels cost
alone, outside the step."""

from __future__ import annotations

import statistics

from torch import nn

from gradcomp import hooks
from gradcomp.compressors import Aggregation, make_compressor
from gradcomp.cost.kernels import time_tensor
from gradcomp.engine.spec import HookSpec
from gradcomp.hooks.auto_spec import is_auto_spec
from gradcomp.hooks.torch_hooks import is_torch_spec
from gradcomp.state import TrainingHookState

PHASES = ("compress", "decompress", "communicate", "tail")
"""The engine's phases that ``gradcomp bench ddp`` reports per step, in its second table."""


def wire(state: TrainingHookState, timed: int) -> float:
    """Bytes one rank sends per step, the mean over the last ``timed`` steps: measured by gradcomp where
    it moves the bytes, else what the backend's ring sends (:attr:`gradcomp.engine.stats.StepStats.wire_bytes`)."""
    recorded = state.steps()[-timed:] if timed else []
    return statistics.fmean(s.wire_bytes for s in recorded) if recorded else 0.0


def phases(state: TrainingHookState, timed: int) -> dict[str, float] | None:
    """gradcomp's hooks: the medians over the last ``timed`` steps of each phase's ms per step (None for
    torch's own, which the engine does not time, and for noop)."""
    if not isinstance(state, (hooks.HookState, hooks.AutoState)):
        return None
    recorded = [s.phases() for s in state.steps()[-timed:]] if timed else []
    if not recorded:
        return None
    return {name: statistics.median(_timed(p[name]) for p in recorded) * 1e3 for name in PHASES}


def host_reads(state: TrainingHookState, timed: int) -> float | None:
    """gradcomp's hooks: the median over the last ``timed`` steps of the host reads per step (each a
    device synchronization on a GPU: :mod:`gradcomp.host`); None for torch's own, which are not observed."""
    recorded = [s.host_reads for s in state.steps()[-timed:]] if timed else []
    counted = [r for r in recorded if r is not None]
    return statistics.median(counted) if counted and len(counted) == len(recorded) else None


def _timed(seconds: float | None) -> float:
    assert seconds is not None, "gradcomp's hooks time every phase"
    return seconds


def kernels_alone(variant: str, model: nn.Module, rank: int, world: int, seed: int) -> float | None:
    """gradcomp's fixed hooks: ms of the hook's compressor kernels alone on this rank's last
    gradients, outside the step (compress, its later rounds, and decompressing as the step does:
    every rank's payloads for ``gather`` compressors, the sum for ``sum`` ones), each tensor on its
    own (the engine compresses element-wise casts a bucket at once); None for the others."""
    if is_torch_spec(variant) or is_auto_spec(variant) or variant == "noop":
        return None
    spec = hooks.parse(variant)
    if not isinstance(spec, HookSpec) or spec.compressor is None:
        return None
    compressor = make_compressor(spec.compressor, seed=seed, rank=rank)
    payloads = world if compressor.capabilities.aggregation is Aggregation.GATHER else 1
    total = 0.0
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    for index, gradient in enumerate(g.detach().clone() for g in gradients):
        for sample in time_tensor(compressor, gradient, ("alone", index), peers=(payloads,)):
            if sample.phase != "decompress" or sample.payloads == payloads:
                total += sample.seconds
    return total * 1e3
