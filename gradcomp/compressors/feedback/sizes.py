"""Classic error feedback on a part of a bucket at once, for a sparsifier that compresses by size groups.

When the wrapped compressor batches a part's tensors by size (:class:`~gradcomp.compressors.sizes.BySize`:
top-k), error feedback follows it, group by group: the members' residuals stacked as rows beside
their gradients, the compensated rows formed in one fused add, selected as one, and the residual
rows settled in one pass (the compensated rows, zero where they were sent) and put back per key in
one foreach copy, each member kept as it was where its own step was not finite (rule "one bad step",
decided per row on the device). The residuals stay per key between steps (checkpoints,
``take_residual`` and warm-ups see nothing new); the tensors alone go through the per-tensor step.

Bitwise what the per-tensor steps give: the same add, the same selection, and a residual that is
the compensated gradient with exact zeros where it was sent (what subtracting a payload's values
from themselves leaves). Classic error feedback, with or without DGC's momentum correction
(``momentum``, ``nesterov``, ``mask``: the velocities stacked beside the residuals, per key
between steps); ``clip`` and ``ef=ef21`` compress tensor by tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.base import Measured
from gradcomp.compressors.capabilities import ratio_option
from gradcomp.compressors.segments import Segments
from gradcomp.compressors.sizes import AloneMeta, BySize, SizeGroup

if TYPE_CHECKING:
    from gradcomp.compressors.feedback.residual import Residuals
    from gradcomp.compressors.feedback.wrapper import ErrorFeedback


@dataclasses.dataclass(frozen=True)
class Compensated:
    """A size group's step between its compensated rows and its settling: the members' per-key
    residuals and their rows, the compensated rows, and with momentum correction the per-key
    velocities, their rows and the step's new ones."""

    carried: list[Tensor]
    residual: Tensor
    rows: Tensor
    velocities: list[Tensor]
    velocity: Tensor | None = None
    following: Tensor | None = None


Take = Callable[[str, tuple[int, int]], Tensor]
"""Where a step's rows go: (name, shape) -> an uninitialised buffer."""


def compress_part(
    ef: ErrorFeedback, buffer: Tensor, segments: Segments, divisor: float, ratio: float | None
) -> list[tuple[Any, Any]]:
    """:meth:`ErrorFeedback.compress_part` by size groups (the module's notes)."""
    inner = _inner(ef)
    groups = inner.size_groups(segments)
    states: list[tuple[Any, Any]] = []

    def take(name: str, shape: tuple[int, int]) -> Tensor:
        return ef.workspace.take(name, shape[0] * shape[1], buffer.dtype, buffer.device).view(shape)

    for group in groups.groups:
        step = compensate(ef, buffer, segments, group, divisor, take)
        payload, ctx = inner.encode_group(step.rows, group, ratio, [segments.keys[i] for i in group.members])
        settle(ef, payload, ctx, step)
        states.append((payload, ctx))
    views, options = segments.views(buffer), ratio_option(ratio)
    for index in groups.alone:
        alone, context = ef.compress_divided(views[index], divisor, segments.keys[index], **options)
        states.append((alone, AloneMeta(index, context)))
    return states


def measure_part(
    ef: ErrorFeedback, buffer: Tensor, segments: Segments, divisor: float, ratio: float | None
) -> list[Measured]:
    """:meth:`ErrorFeedback.measure_part` by size groups: each group's compensated rows formed as
    :func:`compress_part` forms them, in buffers kept per part (they are compressed on another
    thread), and measured by the wrapped compressor; the steps wait in ``ef.measuring``; the
    tensors alone measured one by one."""
    inner = _inner(ef)
    groups = inner.size_groups(segments)
    records, steps = [], []
    for group in groups.groups:

        def take(name: str, shape: tuple[int, int], numel: int = group.numel) -> Tensor:
            return ef.part_rows.take(f"{name}.{numel}", segments.keys, shape, buffer.dtype, buffer.device)

        step = compensate(ef, buffer, segments, group, divisor, take)
        steps.append(step)
        records.append(inner.measure_group(step.rows, group, ratio))
    ef.measuring[segments.keys] = steps
    views, options = segments.views(buffer), ratio_option(ratio)
    return records + [ef.measure_divided(views[i], divisor, segments.keys[i], **options) for i in groups.alone]


def compress_measured_part(
    ef: ErrorFeedback, measured: Sequence[Measured], counts: Sequence[int], segments: Segments
) -> list[tuple[Any, Any]]:
    """:meth:`ErrorFeedback.compress_measured_part` by size groups: each group's payload from its
    record, settled as :func:`compress_part` settles it; the tensors alone one by one."""
    inner = _inner(ef)
    groups = inner.size_groups(segments)
    steps = ef.measuring.pop(segments.keys)
    grouped = len(groups.groups)
    states: list[tuple[Any, Any]] = []
    for record, group, step in zip(measured[:grouped], groups.groups, steps, strict=True):
        payload, ctx = inner.compress_measured_group(record, group, [segments.keys[i] for i in group.members])
        settle(ef, payload, ctx, step)
        states.append((payload, ctx))
    for record, count, index in zip(measured[grouped:], counts[grouped:], groups.alone, strict=True):
        payload, context = ef.compress_measured(record, count, segments.keys[index])
        states.append((payload, AloneMeta(index, context)))
    return states


def compensate(ef: ErrorFeedback, buffer: Tensor, segments: Segments, group: SizeGroup, divisor: float,
               take: Take) -> Compensated:  # fmt: skip
    """The group's compensated rows (in ``take``'s buffers), with the state they came from."""
    residuals: Residuals = ef.memory  # type: ignore[assignment]
    views, momentum = segments.views(buffer), ef.momentum
    shape = (len(group.members), group.numel)
    carried = [residuals.carried(segments.keys[i], views[i]).view(-1) for i in group.members]
    residual = torch.stack(carried, out=take("ef.sizes.residual", shape))
    compensated = torch.stack(group.rows(buffer), out=take("ef.sizes.compensated", shape))
    if momentum is None:
        torch.addcdiv(residual, compensated, ef._divisor(divisor, buffer), out=compensated)  # as the per-tensor add
        return Compensated(carried, residual, compensated, [])
    # the per-tensor steps' operators: the share, u = m u + g (Nesterov: g + m u), the fold
    velocities = [momentum.carried(segments.keys[i], views[i]).view(-1) for i in group.members]
    velocity = torch.stack(velocities, out=take("ef.sizes.velocity", shape))
    following = take("ef.sizes.following", shape)
    compensated.div_(ef._divisor(divisor, buffer))
    torch.add(compensated, velocity, alpha=momentum.momentum, out=following)
    if momentum.nesterov:
        compensated.add_(following, alpha=momentum.momentum)
    else:
        compensated.copy_(following)
    compensated.add_(residual)
    return Compensated(carried, residual, compensated, velocities, velocity, following)


def settle(ef: ErrorFeedback, payload: Any, ctx: Any, step: Compensated) -> None:
    """The members' residuals (and velocities) moved by this rank's ``payload`` of the group, each
    kept as it was where its own step was not finite, and put back per key."""
    inner, momentum = _inner(ef), ef.momentum
    compensated, residual, velocity, following = step.rows, step.residual, step.velocity, step.following
    # a non-finite input always shows in its row's values (payload_shows_non_finite)
    ok = torch.isfinite(payload[0]).all(dim=1)
    sent = inner.sent_rows(payload, ctx)
    compensated.scatter_(1, sent, 0.0)  # what subtracting the values from themselves leaves
    if following is not None and momentum is not None and momentum.mask:
        following.scatter_(1, sent, 0.0)  # DGC's momentum factor masking
    if not (host.reads_are_free(compensated.device) and host.flag(ok.all())):
        torch.where(ok[:, None], compensated, residual, out=compensated)
        if velocity is not None and following is not None:
            torch.where(ok[:, None], following, velocity, out=following)
    torch._foreach_copy_(step.carried, list(compensated.unbind(0)))
    if following is not None:
        torch._foreach_copy_(step.velocities, list(following.unbind(0)))


def _inner(ef: ErrorFeedback) -> BySize:
    inner = ef.inner
    assert isinstance(inner, BySize)
    return inner
