"""EF21's memory (``ef=ef21``; Richtarik et al., "EF21", NeurIPS 2021): estimates, not residuals.

Each rank keeps an estimate h of its own share and sends ``C(g - h)``, then moves h by what its
payload carries; every rank keeps the same global estimate ``G = sum of the h``, adds the aggregate
to it and hands ``G`` on. Compression errors never accumulate in a residual (h tracks g), at the
price of a state of the gradient's size on every rank (G) besides h. Not with a warm-up's
uncompressed steps (they would bypass the estimates), nor two-phase aggregation (it aggregates twice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from gradcomp.compressors.base import Compressor, Key, Payload
from gradcomp.compressors.feedback.memory import FeedbackContext, entries, keyed, state_for
from gradcomp.compressors.finite import commit, finite
from gradcomp.workspace import Workspace


class Estimates:
    """EF21's estimates per key (:class:`~.memory.Memory`)."""

    def __init__(self) -> None:
        self.shares: dict[Key, Tensor] = {}
        """h per key: this rank's estimate of its share (what it sends is C(g - h))."""
        self.estimates: dict[Key, Tensor] = {}
        """G per key: the global estimate, the same on every rank."""

    def carried(self, key: Key, like: Tensor) -> Tensor:
        return state_for(self.shares, key, like, "share estimate")

    def fold(self, share: Tensor, carried: Tensor) -> None:
        share.sub_(carried)

    def settle(
        self, inner: Compressor, payload: Payload, ctx: FeedbackContext, workspace: Workspace
    ) -> tuple[Tensor, Tensor | None]:
        """h = h + contribution(payload), kept where it is finite (a scratch buffer, a decompression
        of the local payload, a check and the masked commit: a pass each)."""
        estimate = self.shares[ctx.key]
        contribution = workspace.take("feedback", estimate.numel(), estimate.dtype, estimate.device)
        contribution = contribution.view_as(estimate)
        inner.contribution(payload, ctx.inner, out=contribution)
        ok = finite(contribution)
        commit(ok, contribution.add_(estimate), estimate)
        return ok, None

    def handed_on(self, aggregate: Tensor, key: Key) -> Tensor:
        """The global estimate, moved by the aggregate (kept when that is finite), in ``aggregate``."""
        estimate = state_for(self.estimates, key, aggregate, "estimate")
        aggregate.add_(estimate)
        commit(finite(aggregate), aggregate, estimate)
        return aggregate

    def take(self, key: Key) -> Tensor | None:
        """None: h and G are no unsent gradient. h estimates this rank's share and G (the same on
        every rank) the sum of the h, and the output of each step is G, whatever the gradient was. A
        method that sends the gradient itself needs no estimate; adding h to the next gradient would
        send this rank's share about twice. Both are dropped, on every rank alike (the caller's
        decision is every rank's), so G stays the sum of the h."""
        self.shares.pop(key, None)
        self.estimates.pop(key, None)
        return None

    def tensors(self) -> list[Tensor]:
        return [*self.shares.values(), *self.estimates.values()]

    def state_dict(self) -> dict[str, Any]:
        # "residuals", empty, as classic error feedback writes it: one layout for every checkpoint
        return {
            "residuals": [],
            "shares": entries(self.shares, "share"),
            "estimates": entries(self.estimates, "estimate"),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "shares" in state:
            self.shares = keyed(state["shares"], "share")
        else:  # saved when the residuals held EF21's h
            self.shares = keyed(state["residuals"], "residual")
        self.estimates = keyed(state.get("estimates", []), "estimate")
