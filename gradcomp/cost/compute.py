"""A model's compute, measured: forward, backward (when each gradient is ready) and the optimizer.

The step model (:mod:`gradcomp.cost.step`) needs to know when backward hands each gradient over,
since that is when its bucket can start travelling. :func:`measure` times a few training steps of
the model in this process, without any communication, recording the moment each parameter's
gradient is accumulated (``register_post_accumulate_grad_hook``); the median of each is kept.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from gradcomp.cost.step import Workload, ascending


def measure(
    model: nn.Module, loss: Callable[[nn.Module], Tensor], optimizer: torch.optim.Optimizer, steps: int = 5
) -> Workload:
    """Time ``steps`` training steps (after one warm-up) of ``model``, whose loss ``loss(model)``
    computes; ``optimizer`` steps its parameters. Parameters without a gradient are left out."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    parameters = [p for p in model.parameters() if p.requires_grad]
    stamps: dict[int, float] = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda _, i=i: stamps.__setitem__(i, time.perf_counter()))
        for i, p in enumerate(parameters)
    ]
    forward, backward, optimize, offsets = [], [], [], []
    try:
        for step in range(steps + 1):
            optimizer.zero_grad(set_to_none=False)
            stamps.clear()
            start = time.perf_counter()
            value = loss(model)
            middle = time.perf_counter()
            value.backward()
            end = time.perf_counter()
            optimizer.step()
            stop = time.perf_counter()
            if step:  # the first one warms up
                forward.append(middle - start)
                backward.append(end - middle)
                optimize.append(stop - end)
                offsets.append({i: (t - middle) / (end - middle) for i, t in stamps.items()})
    finally:
        for handle in handles:
            handle.remove()
    seen = [i for i in range(len(parameters)) if all(i in o for o in offsets)]
    if not seen:
        raise ValueError("no parameter received a gradient: nothing would be communicated")
    ready = {i: statistics.median(o[i] for o in offsets) for i in seen}
    order = sorted(seen, key=lambda i: (ready[i], -i))
    return Workload(
        tuple(tuple(parameters[i].shape) for i in order),
        ascending([ready[i] for i in order]),
        statistics.median(forward),
        statistics.median(backward),
        statistics.median(optimize),
        element_size=parameters[0].element_size(),
    )
