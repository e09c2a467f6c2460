"""One bad step never poisons state (rule "one bad step", ``docs/architecture.md``): whether a step
was finite, decided on the device, and state kept only where it was.

On an accelerator nothing here reads a tensor on the host: a caller tests with :func:`finite` (or
:func:`payload_finite`) and commits with a masked ``torch.where`` (:func:`keep_if`, :func:`commit`);
on the CPU, where a read is free and a masked pass is not, they read the test (counted, through
:mod:`gradcomp.host`) and skip the pass (rule "host reads").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.base import Payload


def payload_finite(payload: Payload) -> Tensor:
    """Whether every floating tensor of ``payload`` is finite (integer parts, such as indices, are),
    as a 0-d bool tensor on the payload's device: :func:`finite` of each, combined there."""
    floating = [finite(t) for t in payload if t.is_floating_point()]
    if not floating:
        return torch.ones((), dtype=torch.bool, device=payload[0].device if payload else None)
    for other in floating[1:]:
        floating[0] = floating[0] & other
    return floating[0]


def keep_if(ok: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """A state after a step: ``new`` where the step was finite (``ok``, a 0-d bool tensor), else
    ``old``. On an accelerator written into ``old`` with ``torch.where`` (no host read) and
    ``old`` returned; on the CPU, where a read is free, whichever buffer holds it is returned, by
    one read and no pass (rule "host reads", ``docs/architecture.md``). The caller keeps the
    returned buffer as the state, and the other as scratch."""
    if host.reads_are_free(old.device):
        return new if host.flag(ok) else old
    torch.where(ok, new, old, out=old)
    return old


def commit(ok: Tensor, new: Tensor, state: Tensor) -> None:
    """``state`` becomes ``new`` where the step was finite (``ok``): :func:`keep_if` for a state
    that must stay in its buffer (one copy or masked pass)."""
    if host.reads_are_free(state.device):
        if host.flag(ok):
            state.copy_(new)
    else:
        torch.where(ok, new, state, out=state)


def finite(tensor: Tensor) -> Tensor:
    """Whether every element is finite, as a 0-d bool tensor on the tensor's device: nothing is read
    on the host, so a caller commits with ``torch.where(ok, new, old)`` instead of branching (rule
    "host reads", ``docs/architecture.md``). One reduction pass: the min and max are both finite
    exactly when every element is (a NaN propagates into both, an Inf into one), and unlike a sum
    they cannot overflow."""
    if not tensor.numel():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


def refuse_non_finite(state: Any, what: str) -> None:
    """Refuse a loaded ``state`` (a checkpoint's nested dicts and lists) that holds a NaN or Inf in
    any floating tensor, naming its key: what a state carries between steps (error feedback's
    residuals, velocities and estimates, PowerSGD's memories, a synchronizer's global parameters)
    is kept as it was by a non-finite step (rule "one bad step"), so a non-finite value loaded into
    it would never be replaced and would make every later step non-finite. At load time, not in the
    step: a reduction pass per tensor (:func:`finite`), one host read per device."""
    floating = [(path, t) for path, t in _tensors(state, "") if t.is_floating_point() or t.is_complex()]
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for path, tensor in floating:
        real = torch.view_as_real(tensor) if tensor.is_complex() else tensor  # aminmax takes no complex
        by_device.setdefault(tensor.device, []).append((path, real))
    for held in by_device.values():
        checks = host.values(torch.stack([finite(tensor) for _, tensor in held]))
        bad = next((path for (path, _), ok in zip(held, checks, strict=True) if not ok), None)
        if bad is not None:
            raise ValueError(
                f"{what} holds a non-finite value (NaN or Inf) at {bad}: it would make every later step "
                "non-finite (a non-finite step leaves the state as it was); load a checkpoint saved before "
                "the run diverged, or leave this state out and start it afresh"
            )


def _tensors(state: Any, path: str) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of ``state`` with its key (``compressor.residual[0].residual``), depth first."""
    if isinstance(state, Tensor):
        yield path or "its top level", state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from _tensors(value, f"{path}[{index}]")
