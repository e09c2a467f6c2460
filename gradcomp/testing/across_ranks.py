"""The properties that need real ranks: gloo processes averaging through gradcomp's engine, as a
DDP hook does, compared with each other and with the protocol simulated on one process."""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor
from gradcomp.compressors.registry import REGISTRY, register
from gradcomp.compressors.simulate import simulate
from gradcomp.testing.subject import Subject, gaussian

STEPS = 3
SHAPE = (64, 50)


def gradient(rank: int, step: int) -> Tensor:
    """Rank ``rank``'s gradient at ``step``: its own values."""
    return gaussian(*SHAPE, seed=1000 * rank + step).view(-1)


def averaged(rank: int, world: int, spec: str, plugin: type[Compressor] | None) -> dict[str, object]:
    """A rank's averages of :data:`STEPS` buckets through the engine (a rank target). ``plugin``: a
    compressor class to register first (one the checking process knows but no import registers)."""
    from gradcomp.engine import Engine

    if plugin is not None and REGISTRY.get(plugin.name) is not plugin:
        register(plugin)
    engine = Engine(spec)
    results = []
    for step in range(STEPS):
        bucket = gradient(rank, step).clone()
        # as numpy: a tensor would travel back as shared memory the exiting rank takes with it
        results.append(engine.reduce(bucket, ["w"], [torch.Size(SHAPE)], last=True).wait().numpy().copy())
        engine.end_step()
    return {"results": results, "failures": []}


def check(subject: Subject, ranks: int, timeout: float) -> list[tuple[str, str | None]]:
    """The verdict of each property across ``ranks`` gloo ranks: (name, None) or (name, what broke)."""
    from gradcomp.launch import spawn

    plugin = subject.cls if subject.spec is None else None
    spec = subject.spec_text if subject.spec is None else str(subject.spec)
    outcomes = spawn(ranks, averaged, (spec, plugin), timeout=timeout)
    compressors = [subject.make(seed=0, rank=r) for r in range(ranks)]
    same, agrees = None, None
    for step in range(STEPS):
        results = [torch.from_numpy(outcome["results"][step]) for outcome in outcomes]
        for r, result in enumerate(results[1:], 1):
            if same is None and not torch.equal(result, results[0]):
                same = f"step {step + 1}: rank {r}'s average differs from rank 0's"
        expected = simulate(compressors, [gradient(r, step) / ranks for r in range(ranks)], key="w",
                            shapes=[torch.Size(SHAPE)])[0]  # fmt: skip
        error = float((results[0] - expected).norm())
        if agrees is None and not error <= 1e-4 * float(expected.norm()) + 1e-6:
            agrees = f"step {step + 1}: the engine's average is off the simulated protocol's by {error:.3g}"
    return [("the same on every rank", same), ("the engine agrees with the protocol", agrees)]
