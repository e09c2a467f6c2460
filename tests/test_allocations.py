"""What a steady-state step allocates, on the accelerator's paths (``host.as_accelerator``): the same
sizes at every step (so that a caching allocator, CUDA's, serves each from its cache, with no device
allocation: ``tests/test_cuda.py`` checks that on a GPU), and nothing larger than the payload (no
temporary of the gradient's size). Counted on the CPU by a dispatch mode that records every tensor an
operator returns in fresh storage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradcomp import host
from gradcomp.compressors import Aggregation, Compressor, make_compressor
from tests.test_cuda import FIXED

SHAPE = torch.Size([1024, 1024])


class Allocations(TorchDispatchMode):
    """The byte sizes of the tensors operators return in storage none of their inputs had."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        held = {a.untyped_storage().data_ptr() for a in inputs}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in held:
                self.sizes.append(tensor.untyped_storage().nbytes())
        return out


def stepper(spec: str) -> tuple[Callable[[], None], list[Compressor]]:
    """One step of two ranks as the engine runs it: each compresses its gradient divided by 2 (into
    the bucket's memory), every round summed, rank 0 decompresses into its bucket."""
    ranks = [make_compressor(spec, rank=r) for r in range(2)]
    generator = torch.Generator().manual_seed(0)
    buckets = [torch.empty(SHAPE.numel()) for _ in range(2)]
    gradients = [torch.randn(SHAPE.numel(), generator=generator) for _ in range(2)]

    def step() -> None:
        states = []
        for compressor, bucket, gradient in zip(ranks, buckets, gradients, strict=True):
            bucket.copy_(gradient)
            states.append(compressor.compress_divided(bucket.view(SHAPE), 2, "w", [SHAPE]))
        for _ in range(1, ranks[0].capabilities.rounds):
            summed = tuple(a + b for a, b in zip(states[0][0], states[1][0], strict=True))
            states = [c.next_round(summed, ctx) for c, (_, ctx) in zip(ranks, states, strict=True)]
        if ranks[0].capabilities.aggregation is Aggregation.SUM:
            summed = tuple(a + b for a, b in zip(states[0][0], states[1][0], strict=True))
            ranks[0].decompress(summed, states[0][1], out=buckets[0].view(SHAPE))
        else:
            ranks[0].decompress_sum([payload for payload, _ in states], states[0][1], out=buckets[0].view(SHAPE))

    return step, ranks


@pytest.mark.parametrize("spec", [s for s in FIXED if not s.startswith("powersgd")] + ["powersgd:rank=4,ef=true"])
def test_steady_steps_allocate_the_same_small_buffers(spec: str) -> None:
    step, ranks = stepper(spec)
    with host.as_accelerator():
        for _ in range(3):  # state, workspaces and warm starts settle
            step()
        counted = []
        for _ in range(2):
            with Allocations() as allocations:
                step()
            counted.append(sorted(allocations.sizes))
    assert counted[0] == counted[1], "a steady step allocates other sizes than the one before"
    payload = ranks[0].compress(torch.randn(SHAPE), "other")[0]
    # the payload (and the harness's sums of summed ones), or small: a sixteenth of the gradient at most
    bound = max(ranks[0].wire_bytes(payload), SHAPE.numel() * 4 // 16)
    assert max(counted[0], default=0) <= bound, f"a buffer of {max(counted[0])} bytes a step, over {bound}"
