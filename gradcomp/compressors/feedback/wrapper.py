"""The compressor that ``ef=true`` (or ``ef=ef21``) builds: a wrapper composing error feedback's
pieces around any compressor, with keyed state, checkpointable."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import (
    Capabilities,
    Compressor,
    CompressorConfig,
    Key,
    Measured,
    Payload,
    check_gradient,
)
from gradcomp.compressors.capabilities import ratio_option
from gradcomp.compressors.feedback import rows as by_rows
from gradcomp.compressors.feedback import sizes as by_size
from gradcomp.compressors.feedback import spans as by_span
from gradcomp.compressors.feedback.clipping import Clipping
from gradcomp.compressors.feedback.ef21 import Estimates
from gradcomp.compressors.feedback.memory import FeedbackContext, Memory, buffer_for
from gradcomp.compressors.feedback.momentum import MomentumCorrection
from gradcomp.compressors.feedback.options import Feedback
from gradcomp.compressors.feedback.residual import Residuals
from gradcomp.compressors.finite import finite
from gradcomp.compressors.rows import ByRows, PartBuffers, RowsMeta
from gradcomp.compressors.segments import Segments
from gradcomp.compressors.sizes import AloneMeta, BySize, GroupMeta, decode_parts, sum_into


class ErrorFeedback(Compressor):
    """Wraps any compressor with error feedback. Build it with ``ef=true`` in a spec (or
    ``ef=ef21``, with ``momentum``, ``nesterov``, ``mask`` and ``clip``: :class:`Feedback`).

    Same aggregation, rounds and payload as the wrapped compressor (its record is the inner one's,
    changed by :meth:`Feedback.applied_to`). A step forms the compensated gradient (the share
    ``g / p``, :attr:`clipping`, :attr:`momentum`, then :attr:`memory`'s fold), has the wrapped
    compressor compress it, and settles the memory from this rank's own final payload, before it
    travels (``Compressor.contribution``); a non-finite step leaves every state as it was,
    decided on the device on an accelerator (nothing is read on the host there).

    Memory: the pieces' (a residual, or EF21's two estimates; momentum's two more per key), and a
    buffer per key for the compensated gradient, which the payload may alias while in flight, and a
    scratch buffer per thread the size of the largest. Compute: the add (fused with the engine's
    division by the world size, :meth:`compress_divided`, for classic error feedback alone), then
    the memory's settling (:meth:`Residuals.settle`); momentum and clipping add a pass or two each.
    Keys: every distinct tensor needs its own key (its identity across steps, e.g. its parameter
    names); the same key with a new shape is an error, not a silent reset.
    """

    Config = CompressorConfig

    def __init__(self, inner: Compressor, feedback: Feedback | None = None) -> None:
        if isinstance(inner, ErrorFeedback):
            raise ValueError("this compressor already has error feedback")
        feedback = Feedback("classic") if feedback is None else feedback
        if feedback.variant is None:
            raise ValueError("ErrorFeedback needs a variant: Feedback('classic') or Feedback('ef21')")
        super().__init__(inner.config, seed=inner.seed, rank=inner.rank)
        self.inner = inner
        self.feedback = feedback
        self.name = inner.name
        self.memory: Memory = Estimates() if feedback.variant == "ef21" else Residuals()
        """What is carried per key: classic's residual, or EF21's estimates."""
        self.momentum: MomentumCorrection | None = None
        """DGC's momentum correction (``momentum=m``), or None."""
        if feedback.momentum:
            self.momentum = MomentumCorrection(feedback.momentum, feedback.nesterov, feedback.mask)
        self.clipping = Clipping(feedback.clip) if feedback.clip else None
        """DGC's local clipping (``clip=C``), or None."""
        # classic error feedback alone: the original algorithm's add, fused with the division
        self._fused = isinstance(self.memory, Residuals) and self.momentum is None and self.clipping is None
        self._compensated: dict[Key, Tensor] = {}  # per key, the buffer its compensated gradient is formed in
        self._divisors: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}
        self.measuring: dict[tuple[Key, ...], Any] = {}
        """Per part measured, its step until it is compressed (:mod:`.rows`, :mod:`.sizes`)."""
        self.part_rows = PartBuffers()
        """The rows of a part's step that ends on another thread (measured on backward's thread and
        compressed on the executor's, or a span settled at its last round), kept per part."""

    def __repr__(self) -> str:
        return ",".join([repr(self.inner), *self.feedback.words()])

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        raise TypeError("error feedback declares what it wraps, changed: ask an instance (capabilities) or a Spec")

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        return self.feedback.applied_to(self.inner.capabilities)

    @property
    def codec(self) -> Compressor:
        return self.inner.codec

    @property
    def has_feedback(self) -> bool:
        return True

    # -- the state, by name (for tests, the conformance kit and whoever inspects a run) -------------

    @property
    def residuals(self) -> Mapping[Key, Tensor]:
        """Classic error feedback's residual e per key (empty under EF21)."""
        return self.memory.released() if isinstance(self.memory, Residuals) else {}

    @property
    def shares(self) -> Mapping[Key, Tensor]:
        """EF21's h per key: this rank's estimate of its share (empty under classic error feedback)."""
        return self.memory.shares if isinstance(self.memory, Estimates) else {}

    @property
    def estimates(self) -> Mapping[Key, Tensor]:
        """EF21's global estimate G per key, the same on every rank (empty under classic)."""
        return self.memory.estimates if isinstance(self.memory, Estimates) else {}

    @property
    def velocities(self) -> Mapping[Key, Tensor]:
        """Momentum correction's velocity u per key (empty without it)."""
        return self.momentum.velocities if self.momentum else {}

    # -- compressing ----------------------------------------------------------------------------------

    def compress(
        self,
        tensor: Tensor,
        key: Key = None,
        shapes: Sequence[torch.Size] | None = None,
        *,
        ratio: float | None = None,
    ) -> tuple[Payload, FeedbackContext]:
        """``ratio``: a warm-up's keep-ratio, for a ratio-based inner compressor (passed on)."""
        return self._compressed(self._compensate(tensor, None, key), key, shapes, ratio)

    def compress_divided(
        self,
        tensor: Tensor,
        divisor: float,
        key: Key = None,
        shapes: Sequence[torch.Size] | None = None,
        *,
        ratio: float | None = None,
    ) -> tuple[Payload, FeedbackContext]:
        return self._compressed(self._compensate(tensor, divisor, key), key, shapes, ratio)

    def measure_divided(
        self, tensor: Tensor, divisor: float, key: Key = None, *, ratio: float | None = None
    ) -> Measured:
        """The compensated gradient formed (as :meth:`compress_divided` forms it) and counted by the
        wrapped compressor: the record carries it to :meth:`compress_measured`."""
        return self.inner.measure(self._compensate(tensor, divisor, key), key, **ratio_option(ratio))

    def compress_measured(
        self, measured: Measured, count: int, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, FeedbackContext]:
        payload, inner_ctx = self.inner.compress_measured(measured, count, key, shapes)
        return self._stepped(payload, inner_ctx, measured.tensor, key)

    def payload_length(self, count: int, measured: Measured) -> int:
        return self.inner.payload_length(count, measured)

    def next_round(self, payload: Payload, ctx: FeedbackContext) -> tuple[Payload, FeedbackContext]:
        payload, ctx.inner = self.inner.next_round(payload, ctx.inner)
        ctx.round += 1
        if ctx.round == self.capabilities.rounds - 1:
            self._settle(payload, ctx)
        return payload, ctx

    def _compensate(self, tensor: Tensor, divisor: float | None, key: Key) -> Tensor:
        """The compensated gradient of ``tensor / divisor`` (``divisor`` None: of ``tensor``), in the
        key's buffer: the share, clipped and momentum-corrected, folded with the memory's state."""
        check_gradient(tensor)
        carried = self.memory.carried(key, tensor)
        compensated = buffer_for(self._compensated, key, carried)
        if not self._fused:
            self._share(tensor, 1.0 if divisor is None else divisor, key, compensated)
            self.memory.fold(compensated, carried)
        elif divisor is None:
            torch.add(tensor, carried, out=compensated)
        else:  # residual + tensor / divisor in one pass (bitwise what dividing, then adding, gives)
            torch.addcdiv(carried, tensor, self._divisor(divisor, tensor), out=compensated)
        return compensated

    def _share(self, tensor: Tensor, divisor: float, key: Key, out: Tensor) -> None:
        """Into ``out``: this rank's share ``tensor / divisor``, clipped, through the momentum
        correction (whose new velocity waits until :meth:`_settle` sees a finite step)."""
        torch.div(tensor, self._divisor(divisor, tensor), out=out)
        if self.clipping is not None:
            self.clipping.apply(out, divisor)
        if self.momentum is not None:
            self.momentum.correct(out, key, tensor)

    def _divisor(self, divisor: float, like: Tensor) -> Tensor:
        """``divisor`` as a 0-dimensional tensor of ``like``'s dtype, kept between calls."""
        cached = self._divisors.get((divisor, like.dtype, like.device))
        if cached is None:
            cached = self._divisors[(divisor, like.dtype, like.device)] = torch.tensor(
                divisor, dtype=like.dtype, device=like.device
            )
        return cached

    def _compressed(
        self, compensated: Tensor, key: Key, shapes: Sequence[torch.Size] | None, ratio: float | None
    ) -> tuple[Payload, FeedbackContext]:
        payload, inner_ctx = self.inner.compress(compensated, key, shapes, **ratio_option(ratio))
        return self._stepped(payload, inner_ctx, compensated, key)

    def _stepped(
        self, payload: Payload, inner_ctx: Any, compensated: Tensor, key: Key
    ) -> tuple[Payload, FeedbackContext]:
        """The step's context; settled at once when this is the last round's payload."""
        ctx = FeedbackContext(key, inner_ctx, compensated)
        if self.capabilities.rounds == 1:
            self._settle(payload, ctx)
        return payload, ctx

    def _settle(self, payload: Payload, ctx: FeedbackContext) -> None:
        """The memory, then the velocity, moved by this rank's final payload, where it is finite."""
        if isinstance(ctx, by_span.SpanContext):
            by_span.settle(self, payload, ctx)
            return
        sent = self.inner.sent_indices(payload, ctx.inner) if self.momentum else None
        ok, free = self.memory.settle(self.inner, payload, ctx, self.workspace)
        if free is not None:  # the compensated buffer became the state: the old state's is free
            self._compensated[ctx.key] = free
        if self.momentum is not None:
            self.momentum.commit(ctx.key, sent, ok)

    # -- a part of a bucket at once ----------------------------------------------------------------------

    @property
    def _by_rows(self) -> bool:
        """Whether a part is compressed by rows (:mod:`gradcomp.compressors.feedback.rows`): what
        the record says (classic error feedback, momentum correction included, around a compressor that
        compresses by rows)."""
        return self.capabilities.whole_part and isinstance(self.inner, ByRows)

    @property
    def _by_size(self) -> bool:
        """Whether a part is compressed by size groups (:mod:`gradcomp.compressors.feedback.sizes`):
        classic error feedback, momentum correction included (not clipping: a norm per tensor),
        around a compressor that batches some of its sizes."""
        classic = isinstance(self.memory, Residuals) and self.clipping is None
        return classic and isinstance(self.inner, BySize) and self.inner.largest_batched > 0

    def compress_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[tuple[Payload, Any]]:
        if self._by_rows:
            return by_rows.compress_part(self, buffer, segments, divisor)
        if self._by_size:
            return by_size.compress_part(self, buffer, segments, divisor, ratio)
        if by_span.takes(self, segments):
            return by_span.compress_part(self, buffer, segments, divisor)
        return super().compress_part(buffer, segments, divisor, ratio=ratio)

    def measure_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[Measured]:
        if self._by_rows:
            return by_rows.measure_part(self, buffer, segments, divisor)
        if self._by_size:
            return by_size.measure_part(self, buffer, segments, divisor, ratio)
        return super().measure_part(buffer, segments, divisor, ratio=ratio)

    def compress_measured_part(
        self, measured: Sequence[Measured], counts: Sequence[int], segments: Segments
    ) -> list[tuple[Payload, Any]]:
        if self._by_rows:
            return by_rows.compress_measured_part(self, measured, counts, segments)
        if self._by_size:
            return by_size.compress_measured_part(self, measured, counts, segments)
        return super().compress_measured_part(measured, counts, segments)

    def decompress_part(self, payloads: Sequence[Payload], contexts: Sequence[Any], buffer: Tensor,
                        segments: Segments) -> None:  # fmt: skip
        if contexts and isinstance(contexts[0], RowsMeta):  # classic error feedback hands the aggregate on
            self.inner.decompress_part(payloads, contexts, buffer, segments)
        elif contexts and isinstance(contexts[0], by_span.SpanContext):
            self.inner.decompress_part(payloads, [contexts[0].inner], buffer, segments)
        elif contexts and isinstance(contexts[0], (GroupMeta, AloneMeta)):
            assert isinstance(self.inner, BySize)
            decode_parts(payloads, contexts, buffer, segments, self.inner, self.decompress)
        else:
            super().decompress_part(payloads, contexts, buffer, segments)

    def decompress_sum_part(self, gathered: Sequence[Sequence[Payload]], contexts: Sequence[Any], buffer: Tensor,
                            segments: Segments) -> None:  # fmt: skip
        # classic error feedback hands the aggregate on: the wrapped compressor's part, as it is
        if contexts and isinstance(contexts[0], RowsMeta):
            self.inner.decompress_sum_part(gathered, contexts, buffer, segments)
        elif contexts and isinstance(contexts[0], (GroupMeta, AloneMeta)):
            assert isinstance(self.inner, BySize)
            sum_into(gathered, contexts, buffer, segments, self.inner, self.decompress_sum)
        else:
            super().decompress_sum_part(gathered, contexts, buffer, segments)

    # -- decompressing --------------------------------------------------------------------------------

    def decompress(self, payload: Payload, ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self.memory.handed_on(self.inner.decompress(payload, ctx.inner, out=out), ctx.key)

    def decompress_sum(self, payloads: Sequence[Payload], ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self.memory.handed_on(self.inner.decompress_sum(payloads, ctx.inner, out=out), ctx.key)

    def contribution(self, payload: Payload, ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self.inner.contribution(payload, ctx.inner, out=out)

    # -- outside the step -------------------------------------------------------------------------------

    def dense_share(self, tensor: Tensor, divisor: float, key: Key = None) -> None:
        """What this rank adds to an uncompressed sum (a warm-up step), in place: its share
        ``tensor / divisor``, clipped and momentum-corrected as a compressed step would be, plus
        the residual, which then is zero (everything travels). EF21 has no dense steps."""
        if not isinstance(self.memory, Residuals):
            raise ValueError("ef=ef21 keeps estimates that an uncompressed step would bypass: no warm-up with it")
        check_gradient(tensor)
        residual = self.memory.carried(key, tensor)
        compensated = buffer_for(self._compensated, key, residual)
        self._share(tensor, divisor, key, compensated)
        self.memory.fold(compensated, residual)
        tensor.copy_(compensated)
        ok = finite(compensated)  # else the step carries the NaN, and the state stays as it was
        residual.copy_(torch.where(ok, 0.0, residual))  # a warm-up step: its allocation is no steady state
        if self.momentum is not None:
            self.momentum.commit(key, None, ok)

    def state_keys(self) -> list[Key]:
        states = (self.residuals, self.shares, self.velocities, self.estimates)
        return list(dict.fromkeys(key for held in states for key in held))

    def take_residual(self, key: Key) -> Tensor | None:
        """What ``key`` has not sent yet, handed over; every state of ``key`` forgotten (a tensor that
        comes back starts afresh, as on its first step): the memory's (classic: the residual, exactly;
        EF21: None, :meth:`Estimates.take` says why) and the velocity, dropped
        (:meth:`MomentumCorrection.take`)."""
        taken = self.memory.take(key)
        if self.momentum is not None:
            self.momentum.take(key)
        self._compensated.pop(key, None)
        return taken

    def rescale(self, ratio: Tensor) -> None:
        """Residuals, velocities and EF21's estimates follow the gradients' new scale: one
        multi-tensor multiply (exact: a loss scale changes by powers of two)."""
        state = [*self.memory.tensors(), *(self.momentum.tensors() if self.momentum else [])]
        if state:
            torch._foreach_mul_(state, ratio.to(device=state[0].device))
        self.inner.rescale(ratio)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"inner": self.inner.state_dict(), **self.memory.state_dict()}
        if self.momentum is not None:
            state.update(self.momentum.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.memory.load_state_dict(state)
        if self.momentum is not None:
            self.momentum.load_state_dict(state)
        self._compensated.clear()
