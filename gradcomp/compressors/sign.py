"""``sign``: one bit per element with a per-chunk scale (scaled signSGD, as in EF-signSGD)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors import chunks, fusion
from gradcomp.compressors.affine import Affine
from gradcomp.compressors.base import Capabilities, ChunkedConfig, CompressorConfig, Key
from gradcomp.compressors.quantize import AffineQuantizer, finite_float32
from gradcomp.compressors.registry import register
from gradcomp.compressors.rows import ChunkRows


@dataclasses.dataclass(frozen=True)
class SignConfig(ChunkedConfig):
    """``chunk``: elements per scale. EF-signSGD uses one scale per tensor; chunks track magnitudes locally."""


@register
class Sign(AffineQuantizer):
    """x_i travels as its sign; the chunk decompresses to mean(|x|) * sign(x_i) (zero counts as +).

    Wire: ``ceil(n / 8)`` bytes + 4 bytes (the float32 mean |x|) per chunk: 32x smaller than fp32.
    Biased: use it with error feedback (Karimireddy et al., ICML 2019), which makes it converge
    like SGD; the scale keeps the update's l1 norm equal to the gradient's, chunk by chunk.
    When: the slowest links, with ``ef=true``.
    """

    name = "sign"
    Config = SignConfig
    config: SignConfig

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        # deterministic (the sign): biased, and a whole part at once (gradcomp.compressors.rows)
        return dataclasses.replace(super().declare(config), unbiased=False, whole_part=True)

    @property
    def bits(self) -> int:
        return 1

    @property
    def stochastic(self) -> bool:
        return False

    def scales(self, flat: Tensor) -> Tensor:
        magnitudes = self.workspace.take("abs", flat.numel(), flat.dtype, flat.device)
        torch.abs(flat, out=magnitudes)
        if host.reads_are_free(flat.device):
            means = chunks.reduce(magnitudes, self.chunk, lambda v: v.mean(dim=1, dtype=torch.float32))
            if host.flag(torch.isfinite(means).all()):
                return means.view(1, -1)
        # Summed in float64: a float32 sum overflows past |x| ~ 3.4e38 / chunk, and only a read (free
        # on the CPU, above) tells that from a real Inf. The float64 pass costs more (docs/benchmarks.md).
        means = finite_float32(chunks.reduce(magnitudes, self.chunk, lambda v: v.mean(dim=1, dtype=torch.float64)))
        return means.view(1, -1)

    def row_scales(self, rows: Tensor, layout: ChunkRows) -> Tensor:
        """Each row's mean |x| over its tensor's elements: a tail row's pads are zeros, its sum
        divided by its own length. Fused where :mod:`~gradcomp.compressors.fusion` compiles: one pass
        instead of two, its sums in another order (the scales within 2 * 1023 float32 roundings of the
        eager ones, a few in practice: tested; every rank decodes the scales that travel, so the
        ranks still agree)."""
        lengths = layout.lengths(rows.device)
        if _MEAN_ABS.may_run(rows.device):
            fused = _fused_means(rows, lengths)
            if fused is not None:
                return fused.view(1, -1)
        magnitudes = self.workspace.take("abs", rows.numel(), rows.dtype, rows.device).view(rows.shape)
        torch.abs(rows, out=magnitudes)
        if host.reads_are_free(rows.device):
            means = magnitudes.sum(dim=1, dtype=torch.float32) / lengths.float()
            if host.flag(torch.isfinite(means).all()):
                return means.view(1, -1)
        return finite_float32(magnitudes.sum(dim=1, dtype=torch.float64) / lengths).view(1, -1)

    def affine(self, scales: Tensor) -> Affine:
        # code 0 -> +scale, code 1 -> -scale
        # in float64: -2 * scale overflows float32 past 1.7e38
        scale = scales[0].double()
        return Affine(base=scale, step=-2 * scale, levels=1)

    def encode(self, flat: Tensor, mapping: Affine, key: Key = None, firsts: Tensor | None = None) -> Tensor:
        full = flat.numel() // self.chunk * self.chunk
        if full and _NEGATIVE.may_run(flat.device):
            codes = self.workspace.take("negative.codes", flat.numel(), torch.uint8, flat.device)
            if _NEGATIVE.run(flat[:full].view(-1, self.chunk), codes[:full].view(-1, self.chunk)):
                torch.lt(flat[full:], 0, out=codes[full:])
                return codes
        negative = self.workspace.take("negative", flat.numel(), torch.bool, flat.device)
        torch.lt(flat, 0, out=negative)
        return negative.view(torch.uint8)


def _fused_means(rows: Tensor, lengths: Tensor) -> Tensor | None:
    """:meth:`Sign.row_scales` by the fused kernel (float32 sums where the CPU reads that they are
    finite, float64 else, as the eager path), or None where it does not run."""
    if host.reads_are_free(rows.device):
        means = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        if not _MEAN_ABS.run(rows, lengths, means):
            return None
        if host.flag(torch.isfinite(means).all()):
            return means
    wide = torch.empty(rows.shape[0], dtype=torch.float64, device=rows.device)
    return finite_float32(wide) if _MEAN_ABS.run(rows, lengths, wide) else None


def _mean_abs(rows: Tensor, lengths: Tensor, out: Tensor) -> None:
    """Each row's sum of |x|, in ``out``'s dtype, over its length."""
    out.copy_(rows.abs().sum(dim=1, dtype=out.dtype) / lengths.to(out.dtype))


_MEAN_ABS = fusion.Kernel(_mean_abs, "sign scales")


def _negative(rows: Tensor, codes: Tensor) -> None:
    """1 where ``rows`` is negative, else 0 (a NaN and -0.0 count as positive, as ``torch.lt``)."""
    codes.copy_(torch.where(rows < 0, 1, 0).to(torch.uint8))  # a bool's conversion compiles ten times slower


_NEGATIVE = fusion.Kernel(_negative, "sign codes")
