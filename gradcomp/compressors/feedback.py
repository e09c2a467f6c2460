"""Error feedback: remember what compression dropped and add it back to the next gradient.

For every key, with g the new gradient and e the residual (zero at first)::

    c     = g + e                     # the compensated gradient, what gets compressed
    e_new = c - contribution(c)       # what this rank's payload failed to carry

so that ``g + e == contribution + e_new`` holds exactly up to float rounding, and nothing a
compressor drops is lost, only delayed (Seide et al. 2014; Karimireddy et al., ICML 2019).

What training with it needs besides (Lin et al., "Deep Gradient Compression", ICLR 2018; Richtarik
et al., "EF21", NeurIPS 2021), as options of the same spec (:class:`Feedback`):

- ``momentum=m`` (DGC's momentum correction): the velocity is accumulated locally, before
  compression, ``u = m u + g; c = e + u`` (``nesterov=true``: ``c = e + g + m u``), for an optimizer
  without momentum of its own; ``mask=true`` clears ``u`` where a sparsifier sent (DGC's momentum
  factor masking: off by default, as it cost top-k 1% up to 5 points on one of our tasks). With
  nothing dropped and no masking, this is exactly momentum SGD on the averaged gradient (every
  rank keeps its own ``u``; their average is the global one).
- ``clip=C``: each tensor's share ``g / p`` is clipped to the L2 norm ``C / sqrt(p)`` before it is
  accumulated (DGC's local gradient clipping: independent shares of p ranks add up to about
  ``sqrt(p)`` times one).
- ``ef=ef21`` (EF21): each rank keeps an estimate h of its own share and sends ``C(g - h)``; every
  rank keeps the same global estimate ``G = sum of the h``, adds the aggregate to it and hands ``G``
  on. Compression errors never accumulate in a residual (h tracks g), at the price of a state of the
  gradient's size on every rank (G) besides h.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.base import (
    Compressor,
    CompressorConfig,
    Key,
    Payload,
    check_gradient,
    commit,
    finite,
    keep_if,
    payload_finite,
)
from gradcomp.compressors.keys import plain
from gradcomp.options import convert, format_value

Variant = Literal["classic", "ef21"]
FEEDBACK_OPTIONS = ("ef", "momentum", "nesterov", "mask", "clip")
"""Options every compressor spec accepts besides its own (``make_compressor`` wraps it then)."""


@dataclasses.dataclass(frozen=True)
class Feedback:
    """The error-feedback options of a spec: ``ef=true`` (classic) or ``ef=ef21``, and DGC's
    momentum correction, momentum factor masking and local clipping (the module's notes)."""

    variant: Variant | None = None
    """None: no error feedback; ``classic`` (``ef=true``) or ``ef21`` (``ef=ef21``)."""
    momentum: float = 0.0
    """Momentum correction's m, in [0, 1); needs ``ef=true``. 0: off."""
    nesterov: bool = False
    """Nesterov's form of the momentum correction; needs ``momentum``."""
    mask: bool = False
    """Momentum factor masking: clear the velocity where a sparsifier sent (topk, randomk, threshold)."""
    clip: float = 0.0
    """Clip each tensor's share g / p to the L2 norm clip / sqrt(p) before it is accumulated; 0: off."""

    def __post_init__(self) -> None:
        if self.variant not in (None, "classic", "ef21"):
            raise ValueError(f"ef must be true, false or ef21, got {self.variant!r}")
        if not (math.isfinite(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.momentum and self.variant != "classic":
            raise ValueError("momentum correction accumulates into error feedback's residual: it needs ef=true")
        if self.nesterov and not self.momentum:
            raise ValueError("nesterov needs momentum")
        if not (math.isfinite(self.clip) and self.clip >= 0.0):
            raise ValueError(f"clip must be a finite number >= 0, got {self.clip}")
        if self.clip and self.variant is None:
            raise ValueError("clip bounds what error feedback accumulates: it needs ef=true or ef=ef21")

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> Feedback:
        """From a spec's options (strings or typed values); ValueError names what is wrong."""
        values = dict(options)
        ef = values.pop("ef", False)
        try:
            variant: Variant | None = "ef21" if ef == "ef21" else ("classic" if convert("ef", ef, bool) else None)
        except ValueError:
            raise ValueError(f"option 'ef' must be true, false or ef21; got {ef!r}") from None
        if "mask" in values and not float(convert("momentum", values.get("momentum", 0.0), float)):
            raise ValueError("mask applies to the momentum correction: it needs momentum")
        hints = {"momentum": float, "nesterov": bool, "mask": bool, "clip": float}
        if str(values.get("momentum", "")).strip().lower() == "true":
            raise ValueError(
                "momentum=true takes a training run's own momentum (on its command line); "
                "everywhere else give the number: momentum=0.9"
            )
        return cls(variant, **{key: convert(key, value, hints[key]) for key, value in values.items()})

    def words(self) -> list[str]:
        """The options as a spec writes them, defaults left out: ``["ef=true", "momentum=0.9"]``."""
        if self.variant is None:
            return []
        words = ["ef=true" if self.variant == "classic" else "ef=ef21"]
        defaults = Feedback(self.variant)
        for name in ("momentum", "nesterov", "mask", "clip"):
            if getattr(self, name) != getattr(defaults, name):
                words.append(f"{name}={format_value(getattr(self, name))}")
        return words

    def options(self) -> dict[str, Any]:
        """The options as a ``(name, options)`` spec pair carries them."""
        return dict(word.split("=", 1) for word in self.words())


@dataclasses.dataclass
class FeedbackContext:
    key: Key
    inner: Any
    compensated: Tensor
    round: int = 0


class ErrorFeedback(Compressor):
    """Wraps any compressor with a residual per key. Build it with ``ef=true`` in a spec (or
    ``ef=ef21``, with ``momentum``, ``nesterov``, ``mask`` and ``clip``: :class:`Feedback`).

    Same aggregation, rounds and payload as the wrapped compressor; the residual is updated from
    this rank's own final payload, before it travels (``Compressor.contribution``).

    Memory: two buffers per key the size of the gradient (the residual, and the compensated
    gradient, which the payload may alias while in flight), and a scratch buffer per thread the size
    of the largest; momentum correction two more per key (the velocity, and its next value until the
    step proves finite), EF21 one more (the global estimate). Compute: the add (fused with the
    engine's division by the world size, :meth:`compress_divided`), then one decompression of the
    local payload, the subtract, a finiteness check and, on an accelerator, the masked commit (a pass each); momentum
    and clipping add a pass or two each. Compressors that fuse the subtraction
    (``Compressor.subtract_contribution``) skip the decompression and the subtract: PowerSGD in one
    pass; the sparsifiers and random-k touch only their k elements, and since their payload shows
    every non-finite input (``Compressor.payload_shows_non_finite``) the check reads only the payload.
    A non-finite step leaves the residual (and velocity, and estimates) as they were (:meth:`_update`),
    decided on the device on an accelerator: nothing is read on the host there.
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
        self.aggregation = inner.aggregation
        self.rounds = inner.rounds
        self.residuals: dict[Key, Tensor] = {}
        """Classic error feedback's residual e per key: what compression left behind."""
        self.shares: dict[Key, Tensor] = {}
        """EF21's h per key: this rank's estimate of its share (what it sends is C(g - h))."""
        self.velocities: dict[Key, Tensor] = {}
        """Momentum correction's u per key."""
        self.estimates: dict[Key, Tensor] = {}
        """EF21's global estimate G per key: the same on every rank."""
        self._compensated: dict[Key, Tensor] = {}
        self._next_velocities: dict[Key, Tensor] = {}
        self._divisors: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}

    def __repr__(self) -> str:
        return ",".join([repr(self.inner), *self.feedback.words()])

    @property
    def same_shapes(self) -> bool:
        return self.inner.same_shapes

    @property
    def unbiased(self) -> bool:
        return False

    @property
    def codec(self) -> Compressor:
        return self.inner.codec

    @property
    def has_feedback(self) -> bool:
        return True

    def set_ratio(self, ratio: float) -> None:
        self.inner.set_ratio(ratio)

    def rescale(self, ratio: Tensor) -> None:
        """Residuals, velocities and EF21's estimates follow the gradients' new scale: one
        multi-tensor multiply (exact: a loss scale changes by powers of two)."""
        state = [*self.residuals.values(), *self.shares.values(), *self.velocities.values(), *self.estimates.values()]
        if state:
            torch._foreach_mul_(state, ratio.to(device=state[0].device))
        self.inner.rescale(ratio)

    def carried(self, key: Key, like: Tensor) -> Tensor:
        """What ``key`` carries from step to step (zeros the first time), checked against the new
        gradient: the residual e (classic, added to it) or the share estimate h (EF21, subtracted)."""
        if self.feedback.variant == "ef21":
            return self._state(self.shares, key, like, "share estimate")
        return self._state(self.residuals, key, like, "residual")

    def _state(self, states: dict[Key, Tensor], key: Key, like: Tensor, what: str) -> Tensor:
        state = states.get(key)
        if state is None:
            state = states[key] = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        elif state.shape != like.shape or state.dtype != like.dtype or state.device != like.device:
            raise ValueError(
                f"error feedback key {key!r} held a {state.dtype} {what} of shape {tuple(state.shape)} on "
                f"{state.device}, now gets {like.dtype} of shape {tuple(like.shape)} on {like.device}: "
                "give every tensor its own key"
            )
        return state

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, FeedbackContext]:
        check_gradient(tensor)
        residual = self.carried(key, tensor)
        compensated = self._compensated_buffer(key, residual)
        if self._plain:
            torch.add(tensor, residual, out=compensated)
        else:
            self._accumulate(tensor, 1.0, key, residual, compensated)
        return self._compress_compensated(compensated, key, shapes)

    def compress_divided(
        self, tensor: Tensor, divisor: float, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, FeedbackContext]:
        return self._compress_compensated(self._compensate(tensor, divisor, key), key, shapes)

    def _compensate(self, tensor: Tensor, divisor: float, key: Key) -> Tensor:
        """The compensated gradient ``tensor / divisor + residual`` (through the options), in its buffer."""
        check_gradient(tensor)
        residual = self.carried(key, tensor)
        compensated = self._compensated_buffer(key, residual)
        if self._plain:  # residual + tensor / divisor in one pass (bitwise what dividing, then adding, gives)
            torch.addcdiv(residual, tensor, self._divisor(divisor, tensor), out=compensated)
        else:
            self._accumulate(tensor, divisor, key, residual, compensated)
        return compensated

    @property
    def measures(self) -> bool:
        return self.inner.measures

    def measure_divided(self, tensor: Tensor, divisor: float, key: Key = None) -> Tensor:
        """The compensated gradient is formed here (as :meth:`compress_divided` forms it) and kept
        for :meth:`compress_measured`; the wrapped compressor counts it."""
        return self.inner.measure(self._compensate(tensor, divisor, key), key)

    def compress_measured(
        self, tensor: Tensor, count: int, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, FeedbackContext]:
        compensated = self._compensated[key]
        payload, inner_ctx = self.inner.compress_measured(compensated, count, key, shapes)
        return self._feedback(payload, inner_ctx, compensated, key)

    def payload_length(self, count: int, key: Key = None) -> int:
        return self.inner.payload_length(count, key)

    def state_keys(self) -> list[Key]:
        states = (self.residuals, self.shares, self.velocities, self.estimates)
        return list(dict.fromkeys(key for held in states for key in held))

    def take_residual(self, key: Key) -> Tensor | None:
        """What ``key`` has not sent yet, handed over; every state of ``key`` forgotten (a tensor that
        comes back starts afresh, as on its first step).

        - Classic: the residual, exactly (it is what compression left behind: sent later by whoever
          takes it, as the next steps here would have sent it).
        - EF21: None. Its state is no unsent gradient: h estimates this rank's share and G (the same
          on every rank) the sum of the h, and the output of each step is G, whatever the gradient
          was. A method that sends the gradient itself needs no estimate; adding h to the next
          gradient would send this rank's share about twice. h and G are dropped together, on every
          rank alike (the caller's decision is every rank's), so G stays the sum of the h.
        - Momentum correction's velocity: dropped. The gradients it accumulated were sent already
          (``c = e + u``, every step: what the compression dropped of them is in the residual); what
          it would still add to later steps is momentum, which the new method does not apply.
        """
        residual = self.residuals.pop(key, None)
        for states in (self.shares, self.velocities, self.estimates, self._compensated, self._next_velocities):
            states.pop(key, None)
        return residual

    def dense_share(self, tensor: Tensor, divisor: float, key: Key = None) -> None:
        """What this rank adds to an uncompressed sum (a warm-up step), in place: its share
        ``tensor / divisor``, clipped and momentum-corrected as a compressed step would be, plus
        the residual, which then is zero (everything travels). EF21 has no dense steps."""
        if self.feedback.variant == "ef21":
            raise ValueError("ef=ef21 keeps estimates that an uncompressed step would bypass: no warm-up with it")
        check_gradient(tensor)
        residual = self.carried(key, tensor)
        compensated = self._compensated_buffer(key, residual)
        self._accumulate(tensor, divisor, key, residual, compensated)
        tensor.copy_(compensated)
        ok = finite(compensated)  # else the step carries the NaN, and the state stays as it was
        residual.copy_(torch.where(ok, 0.0, residual))  # a warm-up step: its allocation is no steady state
        self._commit_velocity(key, None, ok)

    @property
    def _plain(self) -> bool:
        """Classic error feedback alone: the fused path of the original algorithm."""
        return self.feedback.variant == "classic" and not self.feedback.momentum and not self.feedback.clip

    def _accumulate(self, tensor: Tensor, divisor: float, key: Key, state: Tensor, out: Tensor) -> None:
        """Into ``out``: the share ``tensor / divisor``, clipped, through the momentum correction,
        plus the residual (classic) or minus the estimate (EF21). A new velocity waits in
        ``_next_velocities`` until :meth:`_update` sees a finite step."""
        feedback = self.feedback
        torch.div(tensor, self._divisor(divisor, tensor), out=out)
        if feedback.clip:
            limit = feedback.clip / math.sqrt(divisor)
            norm = torch.linalg.vector_norm(out)
            out.mul_((limit / norm).clamp(max=1.0))  # a zero norm divides to Inf, clamped to 1
        if feedback.momentum:
            velocity = self._state(self.velocities, key, tensor, "velocity")
            following = self._next_velocities.get(key)
            if following is None or following.shape != velocity.shape:
                following = self._next_velocities[key] = torch.empty_like(velocity)
            torch.add(out, velocity, alpha=feedback.momentum, out=following)  # u = m u + g
            if feedback.nesterov:
                out.add_(following, alpha=feedback.momentum)  # g + m u
            else:
                out.copy_(following)
        if feedback.variant == "ef21":
            out.sub_(state)
        else:
            out.add_(state)

    def _commit_velocity(self, key: Key, sent: Tensor | None, ok: Tensor) -> None:
        """Where the step was finite (``ok``, on the device), its velocity replaces the last one,
        cleared where ``sent`` says (momentum factor masking)."""
        if not self.feedback.momentum:
            return
        following = self._next_velocities[key]
        if sent is not None and self.feedback.mask:
            following.view(-1)[sent] = 0
        velocity = self.velocities[key]
        if keep_if(ok, following, velocity) is following:  # the buffers swap roles
            self.velocities[key], self._next_velocities[key] = following, velocity

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
        return self._feedback(payload, inner_ctx, compensated, key)

    def _feedback(
        self, payload: Payload, inner_ctx: Any, compensated: Tensor, key: Key
    ) -> tuple[Payload, FeedbackContext]:
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
        """e = c - contribution(payload), with no allocation: fused in c's buffer, or through a
        scratch buffer into the residual's. EF21: h = h + contribution(payload).

        A non-finite step (a NaN or Inf gradient, an overflowing cast, a peer's NaN in PowerSGD's
        factors) leaves the residual as it was: the step itself carries the NaN (so that GradScaler
        skips it), and the next step starts clean (rule "one bad step", ``docs/architecture.md``).
        On an accelerator the test and the commit run on the device (``torch.where``: a branch would
        read the test, a synchronization inside backward); on the CPU, where reading it is free, a
        branch saves the commit's pass (:func:`gradcomp.compressors.base.keep_if`).
        """
        if self.feedback.variant == "ef21":
            self._update_estimate(payload, ctx)
            return
        residual = self.residuals[ctx.key]
        sent = self.inner.sent_indices(payload, ctx.inner) if self.feedback.momentum else None
        # A compressor whose payload shows every bad step is checked there (a few elements);
        # the others through the contribution or the new residual (a reduction pass).
        ok = payload_finite(payload) if self.inner.payload_shows_non_finite else None
        if self.inner.subtract_contribution(payload, ctx.inner, ctx.compensated):
            ok = finite(ctx.compensated) if ok is None else ok
            if keep_if(ok, ctx.compensated, residual) is ctx.compensated:  # the buffers swap roles
                self.residuals[ctx.key], self._compensated[ctx.key] = ctx.compensated, residual
        else:
            contribution = self.workspace.take("feedback", residual.numel(), residual.dtype, residual.device)
            contribution = contribution.view_as(residual)
            self.inner.contribution(payload, ctx.inner, out=contribution)
            # By the input policy a non-finite input gives a non-finite contribution: one check covers both.
            ok = finite(contribution) if ok is None else ok
            if not host.reads_are_free(residual.device):
                torch.where(ok, torch.sub(ctx.compensated, contribution, out=contribution), residual, out=residual)
            elif host.flag(ok):
                torch.sub(ctx.compensated, contribution, out=residual)
        self._commit_velocity(ctx.key, sent, ok)

    def _update_estimate(self, payload: Payload, ctx: FeedbackContext) -> None:
        """EF21: this rank's estimate moves by what its payload carries (when finite)."""
        estimate = self.shares[ctx.key]
        contribution = self.workspace.take("feedback", estimate.numel(), estimate.dtype, estimate.device)
        contribution = contribution.view_as(estimate)
        self.inner.contribution(payload, ctx.inner, out=contribution)
        commit(finite(contribution), contribution.add_(estimate), estimate)

    def decompress(self, payload: Payload, ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self._estimated(self.inner.decompress(payload, ctx.inner, out=out), ctx.key)

    def decompress_sum(self, payloads: Sequence[Payload], ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self._estimated(self.inner.decompress_sum(payloads, ctx.inner, out=out), ctx.key)

    def _estimated(self, aggregate: Tensor, key: Key) -> Tensor:
        """EF21 hands on the global estimate, moved by the aggregate (kept when that is finite);
        classic error feedback, the aggregate itself."""
        if self.feedback.variant != "ef21":
            return aggregate
        estimate = self._state(self.estimates, key, aggregate, "estimate")
        aggregate.add_(estimate)
        commit(finite(aggregate), aggregate, estimate)
        return aggregate

    def contribution(self, payload: Payload, ctx: FeedbackContext, out: Tensor | None = None) -> Tensor:
        return self.inner.contribution(payload, ctx.inner, out=out)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "inner": self.inner.state_dict(),
            "residuals": [{"key": plain(key), "residual": residual} for key, residual in self.residuals.items()],
        }
        if self.feedback.momentum:
            state["velocities"] = [{"key": plain(key), "velocity": u} for key, u in self.velocities.items()]
        if self.feedback.variant == "ef21":
            state["shares"] = [{"key": plain(key), "share": h} for key, h in self.shares.items()]
            state["estimates"] = [{"key": plain(key), "estimate": g} for key, g in self.estimates.items()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.residuals = {entry["key"]: entry["residual"] for entry in state["residuals"]}
        self.shares = {entry["key"]: entry["share"] for entry in state.get("shares", [])}
        if self.feedback.variant == "ef21" and "shares" not in state:  # saved when residuals held EF21's h
            self.shares, self.residuals = self.residuals, {}
        self.velocities = {entry["key"]: entry["velocity"] for entry in state.get("velocities", [])}
        self.estimates = {entry["key"]: entry["estimate"] for entry in state.get("estimates", [])}
        self._compensated.clear()
        self._next_velocities.clear()
