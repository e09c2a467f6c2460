"""DGC's local gradient clipping (``clip=C``; Lin et al., "Deep Gradient Compression", ICLR 2018)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Clipping:
    """Each tensor's share ``g / p`` clipped to the L2 norm ``C / sqrt(p)`` before error feedback
    accumulates it: independent shares of p ranks add up to about ``sqrt(p)`` times one, so the
    average stays within about C. Cost: a norm's reduction pass and a multiply. Per tensor, so a
    tensor sent in pieces would be clipped piece by piece (``Capabilities.local`` is False with it)."""

    norm: float
    """C: the bound on the norm of the averaged gradient of each tensor."""

    def apply(self, share: Tensor, ranks: float) -> None:
        """Clip ``share``, one of ``ranks`` ranks' shares, in place."""
        limit = self.norm / math.sqrt(ranks)
        norm = torch.linalg.vector_norm(share)
        share.mul_((limit / norm).clamp(max=1.0))  # a zero norm divides to Inf, clamped to 1
