"""DGC's momentum correction (``momentum=m``; Lin et al., "Deep Gradient Compression", ICLR 2018).

The velocity is accumulated locally, before compression, ``u = m u + g; c = e + u``
(``nesterov=true``: ``c = e + g + m u``), for an optimizer without momentum of its own;
``mask=true`` clears ``u`` where a sparsifier sent (DGC's momentum factor masking: off by default,
as it cost top-k 1% up to 5 points on one of our tasks). With nothing dropped and no masking, this
is exactly momentum SGD on the averaged gradient (every rank keeps its own ``u``; their average is
the global one). Memory: two tensors per key the size of the gradient (the velocity, and its next
value until the step proves finite); compute: a pass or two per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Key
from gradcomp.compressors.feedback.memory import buffer_for, entries, keyed, state_for
from gradcomp.compressors.feedback.rows import ResidualRows
from gradcomp.compressors.finite import keep_if
from gradcomp.compressors.rows import ChunkRows
from gradcomp.compressors.segments import Segments


class MomentumCorrection:
    """The velocity u per key, corrected into each share and committed once the step is finite."""

    def __init__(self, momentum: float, nesterov: bool = False, mask: bool = False) -> None:
        self.momentum, self.nesterov, self.mask = momentum, nesterov, mask
        self._velocities: dict[Key, Tensor] = {}
        self._following: dict[Key, Tensor] = {}  # per key, the step's new u until the step proves finite
        self.by_rows = ResidualRows()
        """The velocities of the parts compressed by rows (:mod:`gradcomp.compressors.feedback.rows`)."""

    @property
    def velocities(self) -> dict[Key, Tensor]:
        """The velocity u per key (those held by rows brought back out)."""
        self.by_rows.release_all(self._velocities)
        return self._velocities

    def rows(self, segments: Segments, layout: ChunkRows, like: Tensor) -> Tensor:
        """A part's velocity rows (:meth:`ResidualRows.rows`), from the per-key velocities at first."""
        return self.by_rows.rows(self._velocities, segments, layout, like)

    def carried(self, key: Key, like: Tensor) -> Tensor:
        """``key``'s velocity as a tensor of its own (zeros the first time), shaped as ``like``."""
        if key in self.by_rows.holder:
            self.by_rows.release(self._velocities, self.by_rows.holder[key])
        return state_for(self._velocities, key, like, "velocity")

    def correct(self, share: Tensor, key: Key, like: Tensor) -> None:
        """``share`` becomes what the step accumulates (``u = m u + g``, or Nesterov's ``g + m u``),
        in place; the new u waits until :meth:`commit`."""
        velocity = self.carried(key, like)
        following = buffer_for(self._following, key, velocity)
        torch.add(share, velocity, alpha=self.momentum, out=following)  # u = m u + g
        if self.nesterov:
            share.add_(following, alpha=self.momentum)  # g + m u
        else:
            share.copy_(following)

    def commit(self, key: Key, sent: Tensor | None, ok: Tensor) -> None:
        """Where the step was finite (``ok``, on the device), its velocity replaces the last one,
        cleared where ``sent`` says (momentum factor masking)."""
        following = self._following[key]
        if sent is not None and self.mask:
            following.view(-1)[sent] = 0
        velocity = self._velocities[key]
        if keep_if(ok, following, velocity) is following:  # the buffers swap roles
            self._velocities[key], self._following[key] = following, velocity

    def take(self, key: Key) -> None:
        """Forget ``key``'s velocity. The gradients it accumulated were sent already (``c = e + u``,
        every step: what the compression dropped of them is in the residual); what it would still
        add to later steps is momentum, which whoever takes the key over does not apply."""
        if key in self.by_rows.holder:
            self.by_rows.release(self._velocities, self.by_rows.holder[key])
        self._velocities.pop(key, None)
        self._following.pop(key, None)

    def tensors(self) -> list[Tensor]:
        return [*self._velocities.values(), *self.by_rows.tensors()]

    def state_dict(self) -> dict[str, Any]:
        return {"velocities": entries(self.velocities, "velocity")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._velocities = keyed(state.get("velocities", []), "velocity")
        self._following.clear()
        self.by_rows = ResidualRows()
