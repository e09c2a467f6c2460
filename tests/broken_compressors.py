"""Compressors that break the contract on purpose, one property each: the conformance kit
(gradcomp.testing.check_compressor) must fail every one, naming the property. Module-level classes,
so that ranks import them by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import (
    Aggregation,
    Capabilities,
    Compressor,
    CompressorConfig,
    Key,
    Meta,
    Payload,
    check_gradient,
)
from gradcomp.compressors.randomk import RandomK
from gradcomp.compressors.sign import Sign
from gradcomp.compressors.topk import TopK


class CountsElements(Sign):
    """Its ``wire_bytes`` counts elements, not bytes (the float32 scales are four bytes each)."""

    name = "counts_elements"

    @staticmethod
    def wire_bytes(payload: Payload) -> int:
        return sum(t.numel() for t in payload)


class ShiftedDecode(TopK):
    """Decompresses every value one element late."""

    name = "shifted_decode"

    def decompress(self, payload: Payload, ctx: Any, out: Tensor | None = None) -> Tensor:
        result = super().decompress(payload, ctx, out)
        return result.copy_(result.view(-1).roll(1).view_as(result))


@dataclasses.dataclass(frozen=True)
class KeepsConfig(CompressorConfig):
    ratio: float = 0.05


class IndicesAtHome(Compressor):
    """Top-k whose values travel and whose indices stay in the context: a peer's payload cannot be
    decoded by anyone else."""

    name = "indices_at_home"
    Config = KeepsConfig

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        return Capabilities(Aggregation.GATHER)

    def compress(self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
                 ) -> tuple[Payload, Any]:  # fmt: skip
        flat = check_gradient(tensor)
        k = max(1, int(flat.numel() * self.config.ratio)) if flat.numel() else 0
        indices = flat.abs().topk(k).indices
        return (flat[indices].clone(),), (Meta.of(tensor), indices)

    def decompress(self, payload: Payload, ctx: Any, out: Tensor | None = None) -> Tensor:
        meta, indices = ctx
        result = torch.zeros(meta.numel, dtype=meta.dtype) if out is None else out.view(-1).zero_()
        result[indices] = payload[0].to(meta.dtype)
        return result.view(meta.shape)


class GlobalRandom(RandomK):
    """Random-k drawing its indices from torch's global generator: ranks pick different elements and
    add up values of different places."""

    name = "global_random"

    def compress(self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
                 ) -> tuple[Payload, Any]:  # fmt: skip
        flat = check_gradient(tensor)
        k = max(1, int(flat.numel() * self.config.ratio)) if flat.numel() else 0
        indices = torch.randperm(flat.numel())[:k]
        return (flat[indices].clone(),), (Meta.of(tensor), indices)

    def decompress(self, payload: Payload, ctx: Any, out: Tensor | None = None) -> Tensor:
        return IndicesAtHome.decompress(self, payload, ctx, out)  # type: ignore[arg-type]


class OwnRankFirst(Sign):
    """Sums the gathered payloads starting from its own: floating-point sums in another order on
    every rank, so ranks drift apart."""

    name = "own_rank_first"

    def decompress_sum(self, payloads: Sequence[Payload], ctx: Any, out: Tensor | None = None) -> Tensor:
        rotated = [*payloads[self.rank :], *payloads[: self.rank]]
        return super().decompress_sum(rotated, ctx, out)


class ForgetsItsGenerator(RandomK):
    """Random-k whose checkpoint leaves out its generator: a resumed run draws other indices."""

    name = "forgets_its_generator"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class DropsNaN(TopK):
    """Replaces NaN and Inf by zeros before it compresses: GradScaler never sees an overflow."""

    name = "drops_nan"

    def compress(self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
                 ) -> tuple[Payload, Any]:  # fmt: skip
        return super().compress(torch.nan_to_num(check_gradient(tensor), 0.0, 0.0, 0.0).view_as(tensor), key, shapes)
