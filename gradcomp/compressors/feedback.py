"""Error feedback: remember what compression dropped and add it back to the next gradient.

For every key, with g the new gradient and e the residual (zero at first)::

    c     = g + e                     # the compensated gradient, what gets compressed
    e_new = c - contribution(c)       # what this rank's payload failed to carry

so that ``g + e == contribution + e_new`` holds exactly up to float rounding, and nothing a
compressor drops is lost, only delayed (Seide et al. 2014; Karimireddy et al., ICML 2019).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import (
    Compressor,
    CompressorConfig,
    Key,
    Payload,
    all_finite,
    check_gradient,
    payload_finite,
)


@dataclasses.dataclass
class FeedbackContext:
    key: Key
    inner: Any
    compensated: Tensor
    round: int = 0


class ErrorFeedback(Compressor):
    """Wraps any compressor with a residual per key. Build it with ``ef=true`` in a spec.

    Same aggregation, rounds and payload as the wrapped compressor; the residual is updated from
    this rank's own final payload, before it travels (``Compressor.contribution``).

    Memory: two buffers per key the size of the gradient (the residual, and the compensated
    gradient, which the payload may alias while in flight), and a scratch buffer per thread the size
    of the largest. Compute: the add (fused with the engine's division by the world size,
    :meth:`compress_divided`), then one decompression of the local payload, the subtract and a
    finiteness check (a pass each). Compressors that fuse the subtraction
    (``Compressor.subtract_contribution``) skip the decompression: PowerSGD in one pass; the
    sparsifiers and random-k touch only their k elements, and since their payload shows every
    non-finite input (``Compressor.payload_shows_non_finite``) the check reads only the payload.
    A non-finite step leaves the residual as it was (:meth:`_update`).
    Keys: every distinct tensor needs its own key (its identity across steps, e.g. its parameter
    names); the same key with a new shape is an error, not a silent reset.
    """

    Config = CompressorConfig

    def __init__(self, inner: Compressor) -> None:
        if isinstance(inner, ErrorFeedback):
            raise ValueError("this compressor already has error feedback")
        super().__init__(inner.config, seed=inner.seed, rank=inner.rank)
        self.inner = inner
        self.name = inner.name
        self.aggregation = inner.aggregation
        self.rounds = inner.rounds
        self.residuals: dict[Key, Tensor] = {}
        self._compensated: dict[Key, Tensor] = {}
        self._divisors: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}

    def __repr__(self) -> str:
        return f"{self.inner!r},ef=true"

    @property
    def unbiased(self) -> bool:
        return False

    @property
    def codec(self) -> Compressor:
        return self.inner.codec

    @property
    def has_feedback(self) -> bool:
        return True

    def residual(self, key: Key, like: Tensor) -> Tensor:
        """The residual of ``key`` (zeros the first time), checked against the new gradient."""
        residual = self.residuals.get(key)
        if residual is None:
            residual = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
            self.residuals[key] = residual
        elif residual.shape != like.shape or residual.dtype != like.dtype or residual.device != like.device:
            raise ValueError(
                f"error feedback key {key!r} held a {residual.dtype} residual of shape {tuple(residual.shape)} on "
                f"{residual.device}, now gets {like.dtype} of shape {tuple(like.shape)} on {like.device}: "
                "give every tensor its own key"
            )
        return residual

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, FeedbackContext]:
        check_gradient(tensor)
        residual = self.residual(key, tensor)
        compensated = self._compensated_buffer(key, residual)
        torch.add(tensor, residual, out=compensated)
        return self._compress_compensated(compensated, key, shapes)

    def compress_divided(
        self, tensor: Tensor, divisor: float, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, FeedbackContext]:
        # residual + tensor / divisor in one pass (bitwise what dividing, then adding, gives)
        check_gradient(tensor)
        residual = self.residual(key, tensor)
        compensated = self._compensated_buffer(key, residual)
        torch.addcdiv(residual, tensor, self._divisor(divisor, tensor), out=compensated)
        return self._compress_compensated(compensated, key, shapes)

    def _compensated_buffer(self, key: Key, residual: Tensor) -> Tensor:
        compensated = self._compensated.get(key)
        if compensated is None or compensated.shape != residual.shape:
            compensated = self._compensated[key] = torch.empty_like(residual)
        return compensated

    def _divisor(self, divisor: float, like: Tensor) -> Tensor:
        """``divisor`` as a 0-dimensional tensor of ``like``'s dtype, kept between calls."""
        cached = self._divisors.get((divisor, like.dtype, like.device))
        if cached is None:
            cached = self._divisors[(divisor, like.dtype, like.device)] = torch.tensor(
                divisor, dtype=like.dtype, device=like.device
            )
        return cached

    def _compress_compensated(
        self, compensated: Tensor, key: Key, shapes: Sequence[torch.Size] | None
    ) -> tuple[Payload, FeedbackContext]:
        payload, inner_ctx = self.inner.compress(compensated, key, shapes)
        ctx = FeedbackContext(key, inner_ctx, compensated)
        if self.rounds == 1:
            self._update(payload, ctx)
        return payload, ctx

    def next_round(self, payload: Payload, ctx: FeedbackContext) -> tuple[Payload, FeedbackContext]:
        payload, ctx.inner = self.inner.next_round(payload, ctx.inner)
        ctx.round += 1
        if ctx.round == self.rounds - 1:
            self._update(payload, ctx)
        return payload, ctx

    def _update(self, payload: Payload, ctx: FeedbackContext) -> None:
        """e = c - contribution(payload), with no allocation: fused in c's buffer, which then
        becomes the residual (the two buffers swap roles), or through a scratch buffer into the
        residual's own.

        A non-finite step (a NaN or Inf gradient, an overflowing cast, a peer's NaN in PowerSGD's
        factors) leaves the residual as it was: the step itself carries the NaN (so that GradScaler
        skips it), and the next step starts clean (rule "one bad step", ``docs/architecture.md``).
        """
        residual = self.residuals[ctx.key]
        # A compressor whose payload shows every bad step is checked there (a few elements);
        # the others through the contribution or the new residual (a reduction pass).
        cheap_check = self.inner.payload_shows_non_finite
        if cheap_check and not payload_finite(payload):
            return
        if self.inner.subtract_contribution(payload, ctx.inner, ctx.compensated):
            if cheap_check or all_finite(ctx.compensated):
                self.residuals[ctx.key], self._compensated[ctx.key] = ctx.compensated, residual
            return
        contribution = self.workspace.take("feedback", residual.numel(), residual.dtype, residual.device)
        self.inner.contribution(payload, ctx.inner, out=contribution.view_as(residual))
        # By the input policy a non-finite input gives a non-finite contribution: one check covers both.
        if cheap_check or all_finite(contribution):
            torch.sub(ctx.compensated, contribution.view_as(residual), out=residual)

    def decompress(self, payload: Payload, ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self.inner.decompress(payload, ctx.inner, out=out)

    def decompress_sum(self, payloads: Sequence[Payload], ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self.inner.decompress_sum(payloads, ctx.inner, out=out)

    def contribution(self, payload: Payload, ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self.inner.contribution(payload, ctx.inner, out=out)

    def state_dict(self) -> dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "residuals": [{"key": key, "residual": residual} for key, residual in self.residuals.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.residuals = {entry["key"]: entry["residual"] for entry in state["residuals"]}
        self._compensated.clear()
