"""Scalar quantizers: uniform n-bit (``quantize``), QSGD (``qsgd``) and TernGrad (``terngrad``).

All three send bit-packed integer codes plus a few float32 scales per chunk, and share one codec
(:mod:`gradcomp.compressors.affine`): they differ in the per-chunk offset and step they choose.
Their payloads are not summable (each rank has its own scales), so they aggregate by ``gather``.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors import affine, bitpack, chunks, counter, fusion
from gradcomp.compressors.affine import Affine
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
from gradcomp.compressors.counter import Counters
from gradcomp.compressors.randomness import rank_seed
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
        return Capabilities(Aggregation.GATHER, local=True, piece_multiple=config.chunk, same_shapes=True,
                            unbiased=True, whole_part=True)  # fmt: skip

    def __init__(self, config: CompressorConfig | None = None, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(config, seed=seed, rank=rank)
        # Rounding noise should be independent between ranks, so that it averages out.
        self.counters = Counters(rank_seed(seed, rank))

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

    def encode(self, flat: Tensor, mapping: Affine, key: Key = None, firsts: Tensor | None = None) -> Tensor:
        """uint8 codes of ``flat``; the default is affine rounding, stochastic from the chunks' first
        counters ``firsts`` (``key``'s next draw when not given: :func:`gradcomp.compressors.affine.noise`)."""
        if self.stochastic and firsts is None:
            firsts = self._tensor_counters(flat.numel(), key, flat.device)
        return affine.encode(flat, mapping, self.chunk, firsts, self.workspace)

    def _tensor_counters(self, numel: int, key: Key, device: torch.device) -> Tensor:
        """The first counters of a tensor's chunks at ``key``'s next draw, in one add."""
        first = counter.counter(self.counters.start(key), self.counters.draw(key))
        count = chunks.num_chunks(numel, self.chunk)
        firsts = self.workspace.take("noise.firsts", count, torch.int64, device)
        return torch.add(_chunk_counters(count, affine.words(self.chunk) + 1, device), first, out=firsts)

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
        firsts = self._rows_counters(layout, segments, rows.device) if self.stochastic else None
        codes = self.encode(rows.view(-1), self.affine(scales), None, firsts)
        kept = layout.compact(codes.view(layout.rows, layout.chunk))  # the pads' codes never travel
        scratch = self.workspace.take("pack", kept.numel(), torch.uint8, kept.device)
        return bitpack.pack(kept, self.bits, scratch), scales

    def _rows_counters(self, layout: ChunkRows, segments: Segments, device: torch.device) -> Tensor:
        """The first counters of a part's rows, each chunk's the one its tensor draws alone
        (:meth:`_tensor_counters`), in operators that do not grow with the tensors: the rows' counters
        at draw 0 (kept per layout), moved to each tensor's draw (the hash follows, in the encode).
        What a tensor sends does not depend on the part that holds it (rule "state per tensor")."""
        draws = [self.counters.draw(key) for key in segments.keys]
        starts = [self.counters.start(key) for key in segments.keys]
        at_zero = _row_counters(layout, tuple(segments.offsets), tuple(starts), device)
        firsts = self.workspace.take("noise.firsts", layout.rows, torch.int64, device)
        if all(d == draws[0] for d in draws):  # the usual step: every tensor at the same draw
            torch.add(at_zero, counter.counter(0, draws[0]), out=firsts)
        else:
            per_row = torch.tensor(draws, dtype=torch.int64, device=device)[layout.row_owners(device)]
            torch.add(at_zero, counter.draw_offset(per_row), out=firsts)
        return firsts

    def decode_rows(self, payload: tuple[Tensor, ...], layout: ChunkRows, out: Tensor) -> None:
        packed, scales = payload
        codes = self.workspace.take("codes", layout.numel, torch.uint8, packed.device)
        scratch = self.workspace.take("unpack", layout.numel, torch.uint8, packed.device)
        bitpack.unpack(packed, self.bits, layout.numel, out=codes, scratch=scratch)
        spread = self.workspace.take("codes.rows", layout.rows * layout.chunk, torch.uint8, packed.device)
        layout.expand(codes, spread.view(layout.rows, layout.chunk))
        affine.decode(spread, self.affine(scales), self.chunk, out.view(-1), self.workspace)

    def state_dict(self) -> dict[str, Any]:
        return {"noise": self.counters.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.load_state_dict(state["noise"])


@functools.lru_cache(maxsize=1024)
def _chunk_counters(count: int, stride: int, device: torch.device) -> Tensor:
    """The counters of a tensor's ``count`` chunks relative to its draw's first: ``stride`` apart."""
    return torch.arange(count, dtype=torch.int64, device=device).mul_(counter.signed(counter.GOLDEN * stride))


@functools.lru_cache(maxsize=256)
def _row_counters(layout: ChunkRows, offsets: tuple[int, ...], starts: tuple[int, ...], device: torch.device) -> Tensor:
    """Per row of ``layout``, its chunk's first counter at its tensor's draw 0 (the tensors at
    ``offsets``, their streams at ``starts``): what :func:`_chunk_counters` gives the tensor alone."""
    stride = affine.words(layout.chunk) + 1
    numbers = layout.chunk_numbers(offsets)
    values = [counter.counter(starts[i], 0, n * stride) for i, n in zip(layout.owners, numbers, strict=True)]
    return torch.tensor(values, dtype=torch.int64, device=device)


def finite_float32(values: Tensor) -> Tensor:
    """Round float64 chunk statistics to float32 scales: finite stays finite, Inf and NaN stay."""
    limit, values = torch.finfo(torch.float32).max, values.double()
    return torch.where(torch.isfinite(values), values.clamp(-limit, limit), values).float()


def _min_max(rows: Tensor, low: Tensor, high: Tensor) -> None:
    """Each row's min into ``low`` and max into ``high``, in one pass (exact: no rounding to differ)."""
    low.copy_(rows.amin(dim=1))
    high.copy_(rows.amax(dim=1))


_MIN_MAX = fusion.Kernel(_min_max, "min and max")


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
        full = flat.numel() // self.chunk
        scales = torch.empty(2, chunks.num_chunks(flat.numel(), self.chunk), dtype=torch.float32, device=flat.device)
        if full and _MIN_MAX.run(flat[: full * self.chunk].view(full, self.chunk), scales[0, :full], scales[1, :full]):
            if scales.shape[1] > full:  # a short last chunk
                tail = flat[full * self.chunk :]
                torch.stack([tail.amin(), tail.amax()], out=scales[:, full])
            return scales
        low = chunks.reduce(flat, self.chunk, lambda v: v.amin(dim=1))
        high = chunks.reduce(flat, self.chunk, lambda v: v.amax(dim=1))
        return torch.stack([low, high], out=scales)

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
