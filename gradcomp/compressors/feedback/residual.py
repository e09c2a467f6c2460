"""Classic error feedback's memory (``ef=true``): the residual, what compression left behind.

For every key, with g the gradient's share and e the residual (zero at first)::

    c     = g + e                     # the compensated gradient, what gets compressed
    e_new = c - contribution(c)       # what this rank's payload failed to carry

so that ``g + e == contribution + e_new`` holds exactly up to float rounding, and nothing a
compressor drops is lost, only delayed (Seide et al. 2014; Karimireddy et al., ICML 2019).
Memory: one tensor per key the size of the gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.base import Compressor, Key, Payload
from gradcomp.compressors.feedback.memory import FeedbackContext, entries, keyed, state_for
from gradcomp.compressors.feedback.rows import ResidualRows
from gradcomp.compressors.finite import finite, keep_if, payload_finite
from gradcomp.workspace import Workspace


class Residuals:
    """Classic error feedback's residual e per key (:class:`~.memory.Memory`)."""

    def __init__(self) -> None:
        self.residuals: dict[Key, Tensor] = {}
        """The residual e per key: what compression left behind, sent with the key's next step (a
        key of a part compressed by rows is held in :attr:`by_rows` meanwhile: :meth:`released`)."""
        self.by_rows = ResidualRows()
        """The residuals of the parts compressed by rows (:mod:`gradcomp.compressors.feedback.rows`)."""

    def released(self) -> dict[Key, Tensor]:
        """:attr:`residuals`, every key in it (those held by rows brought back out)."""
        self.by_rows.release_all(self.residuals)
        return self.residuals

    def carried(self, key: Key, like: Tensor) -> Tensor:
        if key in self.by_rows.holder:
            self.by_rows.release(self.residuals, self.by_rows.holder[key])
        return state_for(self.residuals, key, like, "residual")

    def fold(self, share: Tensor, carried: Tensor) -> None:
        share.add_(carried)

    def settle(
        self, inner: Compressor, payload: Payload, ctx: FeedbackContext, workspace: Workspace
    ) -> tuple[Tensor, Tensor | None]:
        """e = c - contribution(payload), with no allocation: fused in c's buffer, which becomes the
        residual's (and the old residual's the free one), or through a scratch buffer into the
        residual's.

        A non-finite step (a NaN or Inf gradient, an overflowing cast, a peer's NaN in PowerSGD's
        factors) leaves the residual as it was: the step itself carries the NaN (so that GradScaler
        skips it), and the next step starts clean (rule "one bad step", ``docs/architecture.md``).
        On an accelerator the test and the commit run on the device (``torch.where``: a branch would
        read the test, a synchronization inside backward); on the CPU, where reading it is free, a
        branch saves the commit's pass (:func:`gradcomp.compressors.finite.keep_if`). Cost: a payload
        that shows every bad step is checked there (a few elements); the others cost a reduction
        pass, and the contribution a decompression and a subtract unless ``inner`` fuses them
        (``subtract_contribution``: PowerSGD in one pass, the sparsifiers at their k elements)."""
        residual = self.residuals[ctx.key]
        ok = payload_finite(payload) if inner.capabilities.payload_shows_non_finite else None
        if inner.subtract_contribution(payload, ctx.inner, ctx.compensated):
            ok = finite(ctx.compensated) if ok is None else ok
            if keep_if(ok, ctx.compensated, residual) is ctx.compensated:  # the buffers swap roles
                self.residuals[ctx.key] = ctx.compensated
                return ok, residual
            return ok, None
        contribution = workspace.take("feedback", residual.numel(), residual.dtype, residual.device)
        contribution = contribution.view_as(residual)
        inner.contribution(payload, ctx.inner, out=contribution)
        # By the input policy a non-finite input gives a non-finite contribution: one check covers both.
        ok = finite(contribution) if ok is None else ok
        if not host.reads_are_free(residual.device):
            torch.where(ok, torch.sub(ctx.compensated, contribution, out=contribution), residual, out=residual)
        elif host.flag(ok):
            torch.sub(ctx.compensated, contribution, out=residual)
        return ok, None

    def handed_on(self, aggregate: Tensor, key: Key) -> Tensor:
        return aggregate  # the aggregate itself: what was sent is the average

    def take(self, key: Key) -> Tensor | None:
        """The residual, exactly: what compression left behind, sent later by whoever takes it, as
        the next steps here would have sent it."""
        if key in self.by_rows.holder:
            self.by_rows.release(self.residuals, self.by_rows.holder[key])
        return self.residuals.pop(key, None)

    def tensors(self) -> list[Tensor]:
        return [*self.residuals.values(), *self.by_rows.tensors()]

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": entries(self.released(), "residual")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.residuals = keyed(state["residuals"], "residual")
        self.by_rows = ResidualRows()
