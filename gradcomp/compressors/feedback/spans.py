"""Classic error feedback on a part of a bucket at once, for a compressor that takes the part as one
flat tensor of its tensors' shapes, in several rounds (PowerSGD: ``compress_span``).

The part's residuals live as one flat buffer in the part's order (:class:`~.rows.ResidualRows` in rows
of one element: each tensor's residual is its span), the compensated gradient is formed for the whole
part in one fused add (:func:`~.rows.compensate`, momentum correction included), compressed as the
wrapped compressor compresses a part, and settled once the last round's payload is known: the
contribution subtracted in place (PowerSGD's ``subtract_contribution``: one ``baddbmm`` per shape),
each tensor's residual kept as it was where its own step was not finite (rule "one bad step",
decided per tensor on the device). The residuals stay per key between such steps, as by rows.

Bitwise what the per-tensor steps give where the wrapped compressor's part is bitwise its tensors'
(PowerSGD at rank >= 2). Classic error feedback with or without DGC's momentum correction; ``clip``
and ``ef=ef21`` compress tensor by tensor.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.feedback import rows as by_rows
from gradcomp.compressors.feedback.memory import FeedbackContext
from gradcomp.compressors.feedback.residual import Residuals
from gradcomp.compressors.finite import finite
from gradcomp.compressors.rows import ChunkRows
from gradcomp.compressors.segments import Segments, end_to_end

if TYPE_CHECKING:
    from gradcomp.compressors.feedback.wrapper import ErrorFeedback


@dataclasses.dataclass
class SpanContext(FeedbackContext):
    """A part's step inside error feedback: the wrapped compressor's context of the part, the
    compensated span (``compensated``) and the state it came from (``step``)."""

    step: by_rows.Compensated | None = None


def compress_part(ef: ErrorFeedback, buffer: Tensor, segments: Segments, divisor: float) -> list[tuple[Any, Any]]:
    """:meth:`ErrorFeedback.compress_part` for a part that lies end to end (the caller checks):
    residual + g / p for the whole part in rows of one element, round one of the wrapped compressor's
    part; the step settles at the last round (:func:`settle`)."""

    def take(name: str, layout: ChunkRows) -> Tensor:  # kept per part: the step settles on another thread
        return ef.part_rows.take(name, segments.keys, layout.shape, buffer.dtype, buffer.device)

    start, stop = end_to_end(segments)  # type: ignore[misc]  # takes() checked it
    step = by_rows.compensate(ef, buffer, segments, divisor, take, chunk=1, elements=buffer[start:stop].view(-1, 1))
    flat = step.rows.view(-1)
    payload, inner = ef.inner.compress_span(flat, segments, max(divisor, 1.0))  # type: ignore[attr-defined]
    return [(payload, SpanContext(segments.keys, inner, flat, step=step))]


def settle(ef: ErrorFeedback, payload: tuple[Tensor, ...], ctx: SpanContext) -> None:
    """The residual (and velocity) of every tensor of the part moved by this rank's last payload:
    e = c - contribution in the compensated span, kept per tensor where its step was finite."""
    step = ctx.step
    assert step is not None
    handled = ef.inner.subtract_contribution(payload, ctx.inner, ctx.compensated)
    assert handled, "a compressor that compresses spans subtracts its contribution in place"
    compensated, residual, velocity, following = step.rows, step.residual, step.velocity, step.following
    keys = step.segments.keys
    if host.reads_are_free(compensated.device) and host.flag(finite(compensated)):
        # every tensor's step was finite (one pass, read on the CPU): the new rows become the
        # state, and the old ones the next step's scratch, as the per-tensor steps swap buffers
        ef.part_rows.put("ef.rows", keys, ef.memory.by_rows.swap(keys, compensated))  # type: ignore[attr-defined]
        if ef.momentum is not None and following is not None:
            ef.part_rows.put("ef.rows.following", keys, ef.momentum.by_rows.swap(keys, following))
        return
    # a tensor whose step was not finite keeps its residual and velocity (rule "one bad step"),
    # decided per tensor on the device
    ok = by_rows.finite_per_tensor(compensated, step.layout, len(step.segments))
    torch.where(ok[:, None], compensated, residual, out=residual)
    if velocity is not None and following is not None:
        torch.where(ok[:, None], following, velocity, out=velocity)


def takes(ef: ErrorFeedback, segments: Segments) -> bool:
    """Whether ``ef`` compresses this part by spans: classic error feedback (momentum correction
    included, not clipping) around a compressor of spans, the part's tensors end to end."""
    classic = isinstance(ef.memory, Residuals) and ef.clipping is None
    return classic and hasattr(ef.inner, "compress_span") and end_to_end(segments) is not None
