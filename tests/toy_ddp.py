"""A toy DDP setup for the hook tests, run inside ranks: a small seeded model, seeded batches per
rank, and SGD training under DDP's default all-reduce, torch's fp16 hook or a gradcomp hook."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks
from gradcomp.engine.spec import HookSpecLike

Batch = tuple[torch.Tensor, torch.Tensor]
TORCH_FP16 = "torch-fp16"  # torch's own fp16_compress_hook, as a hook argument
BUCKET_CAP_MB = 0.005  # small buckets: several per step


def toy_model(seed: int = 0) -> nn.Module:
    """An MLP 32-64-64-10, with the same initial weights on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def toy_batches(rank: int, steps: int) -> list[Batch]:
    """``steps`` batches of 16 samples for the toy model, different on every rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
            for _ in range(steps)]  # fmt: skip


def wrap(
    net: nn.Module,
    hook: HookSpecLike | None,
    *,
    bucket_cap_mb: float | None = BUCKET_CAP_MB,
    ddp_options: dict[str, Any] | None = None,
    **hook_options: Any,
) -> tuple[DistributedDataParallel, hooks.HookState | None]:
    """``net`` in DDP (``bucket_cap_mb`` None: DDP's default) with ``hook``: None for DDP's default
    all-reduce, :data:`TORCH_FP16`, or a gradcomp hook spec registered with ``hook_options``."""
    options = dict(ddp_options or {})
    if bucket_cap_mb is not None:
        options["bucket_cap_mb"] = bucket_cap_mb
    ddp = DistributedDataParallel(net, **options)
    state = None
    if hook == TORCH_FP16:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook is not None:
        state = hooks.register(ddp, hook, **hook_options)
    return ddp, state


def sgd_steps(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, batches: Sequence[Batch]) -> None:
    """One optimizer step per batch, on the cross-entropy loss."""
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()


def train(
    rank: int, hook: HookSpecLike | None, steps: int, *, bucket_cap_mb: float = BUCKET_CAP_MB, **hook_options: Any
) -> tuple[list[torch.Tensor], hooks.HookState | None]:
    """The toy model's parameters after ``steps`` steps of SGD (lr 0.1) with ``hook``, and its state."""
    ddp, state = wrap(toy_model(), hook, bucket_cap_mb=bucket_cap_mb, **hook_options)
    sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), toy_batches(rank, steps))
    return [p.detach().clone() for p in ddp.parameters()], state


def gradients(
    rank: int, hook: HookSpecLike | None, **hook_options: Any
) -> tuple[list[torch.Tensor], hooks.HookState | None]:
    """The toy model's averaged gradients after one backward with ``hook``, and its state."""
    ddp, state = wrap(toy_model(), hook, **hook_options)
    x, y = toy_batches(rank, 1)[0]
    nn.functional.cross_entropy(ddp(x), y).backward()
    return [p.grad.clone() for p in ddp.parameters()], state
