"""Scalar quantizers: uniform n-bit (``quantize``), QSGD (``qsgd``) and TernGrad (``terngrad``).

All three send bit-packed integer codes plus a few float32 scales per chunk, and share one codec
(:mod:`gradcomp.compressors.affine`): they differ in the per-chunk offset and step they choose.
Their payloads are not summable (each rank has its own scales), so they aggregate by ``gather``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors import affine, bitpack, chunks
from gradcomp.compressors.affine import Affine, Noise
from gradcomp.compressors.base import (
    Aggregation,
    Capabilities,
    ChunkedConfig,
    Compressor,
    CompressorConfig,
    Key,
    Meta,
    Payload,
    check_gradient,
    flat_out,
)
from gradcomp.compressors.randomness import Generators, rank_seed
from gradcomp.compressors.registry import register
from gradcomp.compressors.rows import ByRows, ChunkRows
from gradcomp.compressors.segments import Segments

Rounding = Literal["stochastic", "nearest"]


class AffineQuantizer(ByRows, Compressor):
    """Base of the quantizers: codes = round((x - offset) / step) per chunk, bit-packed.

    Payload: ``(packed codes: uint8[ceil(n * bits / 8)], scales: float32[k, chunks])``.
    The codec computes a chunk whose map does not fit float32 in units scaled by a power of two
    (:func:`gradcomp.compressors.affine.prescale`), so every finite chunk keeps the bound.
    Subclasses choose ``bits``, ``chunk``, the scales and how offset and step follow from them.
    """

    config: ChunkedConfig

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        assert isinstance(config, ChunkedConfig)
        # codes and scales: sized by the tensor alone; each chunk coded on its own; stochastic
        # rounding (the subclasses' default) is unbiased
        # a whole part at once, by rows (gradcomp.compressors.rows)
        return Capabilities(
            Aggregation.GATHER, local=True, piece_multiple=config.chunk, same_shapes=True, unbiased=True,
            whole_part=True,
        )

    def __init__(self, config: CompressorConfig | None = None, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(config, seed=seed, rank=rank)
        # Rounding noise should be independent between ranks, so that it averages out.
        self.noise = Generators(rank_seed(seed, rank))

    @property
    @abstractmethod
    def bits(self) -> int:
        """Bits per code on the wire."""

    @property
    def chunk(self) -> int:
        """Elements per scale."""
        return self.config.chunk

    @property
    def stochastic(self) -> bool:
        return True

    @abstractmethod
    def scales(self, flat: Tensor) -> Tensor:
        """The float32 scales that travel, shape (k, chunks)."""

    @abstractmethod
    def affine(self, scales: Tensor) -> Affine:
        """The per-chunk map between codes and values, from the scales that travel."""

    def encode(self, flat: Tensor, mapping: Affine, key: Key = None, noise: Noise | None = None) -> Tensor:
        """uint8 codes of ``flat``; the default is affine rounding, stochastic with ``noise`` (drawn
        from ``key``'s stream when not given)."""
        if self.stochastic and noise is None:
            n = flat.numel()
            words = self.workspace.take("affine.random", -(-n // 8), torch.int64, flat.device)
            stream = self.noise.on(flat.device, key)
            noise = affine.draw(chunks.num_chunks(n, self.chunk), n, stream, flat.device, words)
        return affine.encode(flat, mapping, self.chunk, noise, self.workspace)

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        flat = check_gradient(tensor)
        scales = self.scales(flat)
        codes = self.encode(flat, self.affine(scales), key)
        scratch = self.workspace.take("pack", flat.numel(), torch.uint8, flat.device)
        return (bitpack.pack(codes, self.bits, scratch), scales), Meta.of(tensor)

    def decompress(self, payload: Payload, ctx: Meta, out: Tensor | None = None) -> Tensor:
        packed, scales = payload
        result = flat_out(out, ctx, packed.device)
        codes = self.workspace.take("codes", ctx.numel, torch.uint8, packed.device)
        scratch = self.workspace.take("unpack", ctx.numel, torch.uint8, packed.device)
        bitpack.unpack(packed, self.bits, ctx.numel, out=codes, scratch=scratch)
        affine.decode(codes, self.affine(scales), self.chunk, result, self.workspace)
        return result.view(ctx.shape)

    def row_scales(self, rows: Tensor, layout: ChunkRows) -> Tensor:
        """:meth:`scales` of a part's layout (``ByRows``): every row a chunk, pads as ``pad`` says."""
        return self.scales(rows.view(-1))

    def encode_rows(self, rows: Tensor, layout: ChunkRows, segments: Segments) -> tuple[Tensor, ...]:
        scales = self.row_scales(rows, layout)
        noise = self._rows_noise(layout, segments, rows.device) if self.stochastic else None
        codes = self.encode(rows.view(-1), self.affine(scales), None, noise)
        kept = layout.compact(codes.view(layout.rows, layout.chunk))  # the pads' codes never travel
        scratch = self.workspace.take("pack", kept.numel(), torch.uint8, kept.device)
        return bitpack.pack(kept, self.bits, scratch), scales

    def _rows_noise(self, layout: ChunkRows, segments: Segments, device: torch.device) -> Noise:
        """Stochastic rounding's noise for a part's rows, each tensor's drawn from its own stream as
        :meth:`encode` draws it (two operators per tensor): the codes are then bitwise the tensors'
        own, whatever part of whichever bucket holds them (rule "state per tensor")."""
        chunk = self.chunk
        sizes = [math.prod(s) for s in segments.shapes]
        counts = [chunks.num_chunks(n, chunk) for n in sizes]
        words = [-(-n // 8) for n in sizes]
        offsets = self.workspace.take("rows.offsets", sum(counts), torch.float64, device)
        staged = self.workspace.take("rows.words", sum(words), torch.int64, device)
        for key, n, count, start, first in zip(segments.keys, sizes, counts, _starts(counts), _starts(words),
                                               strict=True):  # fmt: skip
            affine.draw(count, n, self.noise.on(device, key), device, staged[first:], offsets[start:])
        staging = Segments(tuple(8 * w for w in _starts(words)), segments.shapes, segments.keys)
        bytes_layout = ChunkRows.of(staging, chunk)  # the tensors' bytes, each from its first word
        noise = self.workspace.take("rows.noise", layout.rows * chunk, torch.uint8, device).view(layout.rows, chunk)
        bytes_layout.gather(staged.view(torch.uint8), noise, "zero")
        return Noise(offsets.index_select(0, _row_order(layout, tuple(counts), device)), noise.view(-1))

    def decode_rows(self, payload: tuple[Tensor, ...], layout: ChunkRows, out: Tensor) -> None:
        packed, scales = payload
        codes = self.workspace.take("codes", layout.numel, torch.uint8, packed.device)
        scratch = self.workspace.take("unpack", layout.numel, torch.uint8, packed.device)
        bitpack.unpack(packed, self.bits, layout.numel, out=codes, scratch=scratch)
        spread = self.workspace.take("codes.rows", layout.rows * layout.chunk, torch.uint8, packed.device)
        layout.expand(codes, spread.view(layout.rows, layout.chunk))
        affine.decode(spread, self.affine(scales), self.chunk, out.view(-1), self.workspace)

    def state_dict(self) -> dict[str, Any]:
        return {"noise": self.noise.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noise.load_state_dict(state["noise"])


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


@functools.lru_cache(maxsize=256)
def _row_order(layout: ChunkRows, counts: tuple[int, ...], device: torch.device) -> Tensor:
    """Per row of ``layout``, the index of its chunk among the tensors' chunks in tensor order (each
    tensor's chunks one after another, as its noise is drawn)."""
    first = _starts(list(counts))
    full = [first[owner] + j for owner, j in _full_rows(layout)]
    tails = [first[owner] + counts[owner] - 1 for owner in layout.owners[layout.full_rows :]]
    return torch.tensor(full + tails, dtype=torch.int64, device=device)


def _full_rows(layout: ChunkRows) -> list[tuple[int, int]]:
    """(tensor, chunk of the tensor) of each full row."""
    rows: list[tuple[int, int]] = []
    seen = -1
    for owner in layout.owners[: layout.full_rows]:
        seen = seen + 1 if rows and rows[-1][0] == owner else 0
        rows.append((owner, seen))
    return rows


def finite_float32(values: Tensor) -> Tensor:
    """Round float64 chunk statistics to float32 scales: finite stays finite, Inf and NaN stay."""
    limit, values = torch.finfo(torch.float32).max, values.double()
    return torch.where(torch.isfinite(values), values.clamp(-limit, limit), values).float()


@dataclasses.dataclass(frozen=True)
class QuantizeConfig(ChunkedConfig):
    """``chunk``: elements per (min, max) pair, 8 bytes each."""

    bits: int = 4
    """Bits per element, 1..8."""
    rounding: Rounding = "stochastic"
    """``stochastic`` (unbiased) or ``nearest`` (biased, lower variance)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {self.bits}")
        if self.rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {self.rounding!r}")


@register
class Quantize(AffineQuantizer):
    """Uniform n-bit quantization with a per-chunk min-max scale.

    Each chunk's range [min, max] is cut into 2**bits - 1 equal steps; a value travels as the index
    of a neighbouring level, rounded stochastically (unbiased) or to the nearest (biased).

    Wire: ``ceil(n * bits / 8)`` bytes of codes + 8 bytes (float32 min and max) per chunk.
    Error: at most one step (nearest: half a step) per element, step = (max - min) / (2**bits - 1).
    When: a general-purpose 4- or 8-bit compressor; with error feedback from 2 bits (at 1 bit: sign).
    """

    name = "quantize"
    Config = QuantizeConfig
    config: QuantizeConfig
    pad = "first"  # a part's tail rows padded with a value of the chunk: its min and max stay

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        assert isinstance(config, QuantizeConfig)
        problem = None
        if config.bits == 1:
            problem = (
                "1-bit min-max quantization sends each value as its chunk's min or max, an error larger than "
                "the value (measured on Gaussian gradients: |C(x) - x| = 2.4 |x| stochastic, 1.8 |x| nearest), "
                "so error feedback's residual grows without bound; at 1 bit take sign:ef=true, or bits=2"
            )
        unbiased = config.rounding == "stochastic"
        return dataclasses.replace(super().declare(config), unbiased=unbiased, feedback_problem=problem)

    @property
    def bits(self) -> int:
        return self.config.bits

    @property
    def stochastic(self) -> bool:
        return self.config.rounding == "stochastic"

    def scales(self, flat: Tensor) -> Tensor:
        # min and max travel, not the step: both are exact input values, and the step, derived in
        # float64 on both sides, exists even where float32 cannot hold it (1 bit over a range past 3.4e38)
        low = chunks.reduce(flat, self.chunk, lambda v: v.amin(dim=1))
        high = chunks.reduce(flat, self.chunk, lambda v: v.amax(dim=1))
        return torch.stack([low, high]).float()

    def affine(self, scales: Tensor) -> Affine:
        levels = 2**self.bits - 1
        low, high = scales.double()
        return Affine(base=scales[0], step=(high - low) / levels, levels=levels)


class SymmetricQuantizer(AffineQuantizer):
    """Levels symmetric around zero: x ~ scale * l / s for integer l in -s..s, scale per chunk.

    One float32 scale per chunk travels; the codes are ``l + s`` in ``0..2s``. Always stochastic,
    hence unbiased.
    """

    @property
    @abstractmethod
    def half_levels(self) -> int:
        """s: the number of levels on each side of zero."""

    def affine(self, scales: Tensor) -> Affine:
        s = self.half_levels
        return Affine(base=None, step=scales[0].double() / s, levels=2 * s, zero=s)


@dataclasses.dataclass(frozen=True)
class QSGDConfig(ChunkedConfig):
    chunk: int = 512
    """Elements per norm (QSGD's bucket size d); variance grows with sqrt(chunk) / s."""
    bits: int = 4
    """Bits per element, 2..8: one for the sign, the rest for s = 2**(bits-1) - 1 levels."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.bits <= 8:
            raise ValueError(f"qsgd bits must be in 2..8 (one is the sign), got {self.bits}")


@register
class QSGD(SymmetricQuantizer):
    """QSGD (Alistarh et al., NeurIPS 2017): norm-scaled stochastic levels.

    Per chunk, x_i travels as ||x||_2 * sign(x_i) * l_i / s with l_i the stochastic rounding of
    s * |x_i| / ||x||_2. Unbiased; variance at most min(d / s**2, sqrt(d) / s) * ||x||**2 per chunk.
    A norm past the input dtype's largest value (float16: 65504) travels as that value, so that the
    top level decodes to a finite number, and a chunk whose norm float32 cannot compute (outside
    [2**-62, 2**62]) sends its max |x|: the levels are then finer, and still unbiased.

    Wire: ``ceil(n * bits / 8)`` bytes + 4 bytes (the float32 norm) per chunk.
    When: unbiased compression without error feedback, with a convergence guarantee.
    """

    name = "qsgd"
    Config = QSGDConfig
    config: QSGDConfig

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        assert isinstance(config, QSGDConfig)
        declared = super().declare(config)
        # min(d / s**2, sqrt(d) / s) < 1 exactly when d < s**2
        if config.chunk < (s := 2 ** (config.bits - 1) - 1) ** 2:
            return declared
        bound = min(config.chunk / s**2, config.chunk**0.5 / s)
        problem = (
            f"its variance bound min(d / s^2, sqrt(d) / s) is {bound:.3g} of |x|^2 (chunk d={config.chunk}, "
            f"s={s} levels): no contraction, and error feedback's residual grows without bound (measured at "
            f"bits=4, chunk=512); unbiased, qsgd needs no error feedback, or take chunk < {s**2}"
        )
        return dataclasses.replace(declared, feedback_problem=problem)

    @property
    def bits(self) -> int:
        return self.config.bits

    @property
    def half_levels(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def scales(self, flat: Tensor) -> Tensor:
        norms = chunks.reduce(flat, self.chunk, lambda v: torch.linalg.vector_norm(v, dim=1)).float()
        # float32 squares overflow past |x| ~ 1e19 and turn subnormal below ~1e-19: such chunks (and
        # zero or non-finite ones, which look the same) send their max |x| instead, which is at most
        # the norm and at least every |x|: the levels are finer, and as unbiased. Chosen on the
        # device per chunk (an exact float64 norm of them would need a host read, or a slow pass
        # over every chunk: docs/benchmarks.md).
        usual = (norms >= 2.0**-62) & (norms <= 2.0**62)
        if host.unless(usual.all()):  # the CPU reads to skip the max |x| pass where no chunk needs it
            norms = torch.where(usual, norms, chunks.amax_abs(flat, self.chunk).float())
        # A norm past the input dtype's range would decode (the top level is the norm) to Inf: it
        # travels capped there, which keeps every level unbiased for values the dtype holds.
        limit = min(torch.finfo(flat.dtype).max, torch.finfo(torch.float32).max)
        norms = torch.where(torch.isfinite(norms), norms.clamp(max=limit), norms)
        return norms.view(1, -1)


@dataclasses.dataclass(frozen=True)
class TernGradConfig(ChunkedConfig):
    """``chunk``: elements per max-abs scale (TernGrad scales per layer; per chunk bounds the variance)."""


@register
class TernGrad(SymmetricQuantizer):
    """TernGrad (Wen et al., NeurIPS 2017): ternary levels {-1, 0, +1} times the chunk's max |x|.

    x_i travels as max|x| * sign(x_i) * b_i with b_i ~ Bernoulli(|x_i| / max|x|). Unbiased.

    Wire: ``ceil(n * 2 / 8)`` bytes (2-bit codes) + 4 bytes (the float32 max) per chunk.
    When: the cheapest unbiased quantizer; pair with small chunks, its variance grows with max|x|.
    """

    name = "terngrad"
    Config = TernGradConfig
    config: TernGradConfig

    @property
    def bits(self) -> int:
        return 2

    @property
    def half_levels(self) -> int:
        return 1

    def scales(self, flat: Tensor) -> Tensor:
        return chunks.amax_abs(flat, self.chunk).float().view(1, -1)
