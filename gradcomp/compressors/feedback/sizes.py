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

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.capabilities import ratio_option
from gradcomp.compressors.segments import Segments
from gradcomp.compressors.sizes import AloneMeta, BySize

if TYPE_CHECKING:
    from gradcomp.compressors.feedback.residual import Residuals
    from gradcomp.compressors.feedback.wrapper import ErrorFeedback


def compress_part(
    ef: ErrorFeedback, buffer: Tensor, segments: Segments, divisor: float, ratio: float | None
) -> list[tuple[Any, Any]]:
    """:meth:`ErrorFeedback.compress_part` by size groups (the module's notes)."""
    inner, memory = ef.inner, ef.memory
    assert isinstance(inner, BySize)
    groups = inner.size_groups(segments)
    residuals: Residuals = memory  # type: ignore[assignment]
    states: list[tuple[Any, Any]] = []
    views, options = segments.views(buffer), ratio_option(ratio)
    momentum = ef.momentum
    for group in groups.groups:
        carried = [residuals.carried(segments.keys[i], views[i]).view(-1) for i in group.members]
        residual = _stacked(ef, carried, "ef.sizes.residual")
        compensated = inner.stacked(buffer, group, "ef.sizes.compensated")
        velocities: list[Tensor] = []
        velocity = following = compensated  # with momentum: the stacked velocities, and the step's new ones
        if momentum is None:
            torch.addcdiv(residual, compensated, ef._divisor(divisor, buffer), out=compensated)  # as the per-tensor add
        else:  # the per-tensor steps' operators: the share, u = m u + g (Nesterov: g + m u), the fold
            velocities = [momentum.carried(segments.keys[i], views[i]).view(-1) for i in group.members]
            velocity = _stacked(ef, velocities, "ef.sizes.velocity")
            following = ef.workspace.take("ef.sizes.following", velocity.numel(), velocity.dtype, velocity.device)
            following = following.view(velocity.shape)
            compensated.div_(ef._divisor(divisor, buffer))
            torch.add(compensated, velocity, alpha=momentum.momentum, out=following)
            if momentum.nesterov:
                compensated.add_(following, alpha=momentum.momentum)
            else:
                compensated.copy_(following)
            compensated.add_(residual)
        payload, ctx = inner.encode_group(compensated, group, ratio, [segments.keys[i] for i in group.members])
        # a non-finite input always shows in its row's values (payload_shows_non_finite)
        ok = torch.isfinite(payload[0]).all(dim=1)
        sent = inner.sent_rows(payload, ctx)
        compensated.scatter_(1, sent, 0.0)  # what subtracting the values from themselves leaves
        if momentum is not None and momentum.mask:
            following.scatter_(1, sent, 0.0)  # DGC's momentum factor masking
        if not (host.reads_are_free(buffer.device) and host.flag(ok.all())):
            torch.where(ok[:, None], compensated, residual, out=compensated)
            if momentum is not None:
                torch.where(ok[:, None], following, velocity, out=following)
        torch._foreach_copy_(carried, list(compensated.unbind(0)))
        if momentum is not None:
            torch._foreach_copy_(velocities, list(following.unbind(0)))
        states.append((payload, ctx))
    for index in groups.alone:
        alone, context = ef.compress_divided(views[index], divisor, segments.keys[index], **options)
        states.append((alone, AloneMeta(index, context)))
    return states


def _stacked(ef: ErrorFeedback, tensors: list[Tensor], name: str) -> Tensor:
    """Equal-sized flat ``tensors`` as the rows of a workspace matrix (one stacking copy)."""
    rows = ef.workspace.take(name, len(tensors) * tensors[0].numel(), tensors[0].dtype, tensors[0].device)
    return torch.stack(tensors, out=rows.view(len(tensors), tensors[0].numel()))
