"""``threshold``: send every element with |x| >= tau (a variable-size payload)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.base import Capabilities, CompressorConfig, Key, Measured, Meta, Payload, check_gradient
from gradcomp.compressors.registry import register
from gradcomp.compressors.sparse import SparseCompressor


@dataclasses.dataclass(frozen=True)
class ThresholdConfig(CompressorConfig):
    tau: float = 1e-3
    """Magnitude at or above which an element is sent."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau}")


@register
class Threshold(SparseCompressor):
    """Hard-threshold sparsification (Strom, Interspeech 2015): x_i travels if |x_i| >= tau.

    Wire: m * (value bytes + index bytes) for the m selected elements; m depends on the data and can
    be anything from 0 to n, so the engine gathers with variable sizes. NaN elements are always
    selected (so they reach every rank). Biased: use with error feedback, which lets the small
    elements accumulate until they cross tau.
    When: gradients whose scale is known and stable; otherwise prefer ``topk``, which fixes the size.
    """

    name = "threshold"
    Config = ThresholdConfig
    config: ThresholdConfig

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        return dataclasses.replace(super().declare(config), measures=True)  # as many as pass tau

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        flat = check_gradient(tensor)
        return self.sparse_payload(flat, host.nonzero(self._selected(flat))), Meta.of(tensor)

    def measure(self, tensor: Tensor, key: Key = None) -> Measured:
        return Measured(self._selected(check_gradient(tensor)).sum(), tensor)

    def compress_measured(
        self, measured: Measured, count: int, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        flat = check_gradient(measured.tensor)
        indices = torch.nonzero_static(self._selected(flat), size=count).view(-1)
        return self.sparse_payload(flat, indices), Meta.of(measured.tensor)

    def _selected(self, flat: Tensor) -> Tensor:
        """Where |x| >= tau, as a workspace mask (valid until the next call)."""
        below = self.workspace.take("below", flat.numel(), torch.bool, flat.device)
        magnitudes = self.workspace.take("abs", flat.numel(), flat.dtype, flat.device)
        torch.lt(torch.abs(flat, out=magnitudes), self.config.tau, out=below)
        # "not below" rather than ">=": NaN compares false either way, and must be selected.
        return below.logical_not_()
