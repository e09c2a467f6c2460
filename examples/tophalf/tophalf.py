"""Top-k with its values in bfloat16: a compressor from outside gradcomp (docs/your-compressor.md)."""

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp.compressors import Aggregation, Capabilities, Compressor, CompressorConfig, Key, Meta, Payload
from gradcomp.compressors.base import check_gradient, flat_out


@dataclasses.dataclass(frozen=True)
class TopHalfConfig(CompressorConfig):
    ratio: float = 0.01
    """The fraction of the elements sent: the largest in magnitude."""

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")


class TopHalf(Compressor):
    """The ratio of largest elements, their values as bfloat16 and their indices as int32: 6 bytes
    per element sent. Biased, a contraction: use it with error feedback (``tophalf:ratio=0.01,ef=true``)."""

    name = "tophalf"
    Config = TopHalfConfig
    config: TopHalfConfig

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        return Capabilities(Aggregation.GATHER)  # sparse payloads of different indices do not add up: gathered

    def compress(self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
                 ) -> tuple[Payload, Meta]:
        flat = check_gradient(tensor)  # floating point only, flat, contiguous
        k = min(flat.numel(), max(1, round(self.config.ratio * flat.numel())))
        indices = flat.abs().topk(k, sorted=False).indices  # NaN counts as the largest: it travels
        return (flat[indices].to(torch.bfloat16), indices.int()), Meta.of(tensor)

    def decompress(self, payload: Payload, ctx: Meta, out: Tensor | None = None) -> Tensor:
        values, indices = payload
        result = flat_out(out, ctx, values.device).zero_()
        result[indices.long()] = values.to(ctx.dtype)
        return result.view(ctx.shape)
