"""What the benchmark reads of a hooked model's per-step records (``state.steps()``): the bytes one
rank sent, the engine's phases and host reads (the only place in ``gradcomp bench ddp``/``fsdp``
that reads them, so a change of their layout changes here alone); and what the hook's kernels cost
alone, outside the step."""

from __future__ import annotations

import itertools
import statistics
import time

import torch
from torch import Tensor, nn

from gradcomp import hooks
from gradcomp.bench.timing import synchronize
from gradcomp.compressors import Aggregation, Compressor, Segments, make_compressor
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


def kernels_alone(variant: str, model: nn.Module, rank: int, world: int, seed: int, repeats: int = 3) -> float | None:
    """gradcomp's fixed hooks: ms of the hook's compressor kernels alone on this rank's last
    gradients, outside the step, handed to it as the engine hands a bucket's part (one call:
    ``compress_part``, a keyless run for an element-wise, stateless compressor, else one segment
    per tensor): compress divided by the world size, the later rounds, and decompressing as the step
    does (every rank's payloads for ``gather`` compressors, the sum for ``sum`` ones). The gradients
    form one part, where DDP's buckets would make a few: a compressor whose kernels do not grow with
    a part's tensors pays its fixed costs once here, once per bucket in the step. The median of
    ``repeats`` runs after one untimed; None for the others."""
    if is_torch_spec(variant) or is_auto_spec(variant) or variant == "noop":
        return None
    spec = hooks.parse(variant)
    if not isinstance(spec, HookSpec) or spec.compressor is None:
        return None
    compressor = make_compressor(spec.compressor, seed=seed, rank=rank)
    gradients = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in gradients])
    if compressor.capabilities.elementwise:
        segments = Segments((0,), (flat.shape,), (None,))
    else:
        offsets = tuple(itertools.accumulate((g.numel() for g in gradients[:-1]), initial=0))
        segments = Segments(
            offsets, tuple(g.shape for g in gradients), tuple(("alone", i) for i in range(len(gradients)))
        )
    runs = [_part_seconds(compressor, flat, segments, world) for _ in range(repeats + 1)]
    return statistics.median(runs[1:]) * 1e3


def _part_seconds(compressor: Compressor, flat: Tensor, segments: Segments, world: int) -> float:
    """One timed run of the part ``flat`` (``segments``) through ``compressor``, as a step of ``world``
    ranks runs it; the copy the compression may overwrite is made outside the clock."""
    scratch, out = flat.clone(), torch.empty_like(flat)
    synchronize(flat.device)
    start = time.perf_counter()
    sent = compressor.compress_part(scratch, segments, float(world))
    for _ in range(1, compressor.capabilities.rounds):
        sent = [compressor.next_round(payload, ctx) for payload, ctx in sent]
    payloads, contexts = [p for p, _ in sent], [c for _, c in sent]
    if compressor.capabilities.aggregation is Aggregation.SUM:
        compressor.decompress_part(payloads, contexts, out, segments)
    else:
        compressor.decompress_sum_part([[p] * world for p in payloads], contexts, out, segments)
    synchronize(flat.device)
    return time.perf_counter() - start
