"""``fp8``: 8-bit floating point (e4m3 or e5m2) with a per-chunk scale."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors import chunks, fusion
from gradcomp.compressors.affine import inverse_or_zero
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
from gradcomp.compressors.registry import register
from gradcomp.compressors.rows import ByRows, ChunkRows
from gradcomp.compressors.segments import Segments
from gradcomp.workspace import Workspace

Format = Literal["e4m3", "e5m2"]
DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class Fp8Config(ChunkedConfig):
    """``chunk``: elements per float32 scale."""

    format: Format = "e4m3"
    """``e4m3`` (3 mantissa bits, more precise) or ``e5m2`` (2 mantissa bits, wider range)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format not in DTYPES:
            raise ValueError(f"format must be one of {', '.join(DTYPES)}, got {self.format!r}")


@register
class Fp8(ByRows, Compressor):
    """Each chunk is scaled so that its max |x| maps to the format's largest value, then cast.

    Wire: 1 byte per element + 4 bytes (the float32 max |x|) per chunk. Error: relative 2**-4 (e4m3)
    or 2**-3 (e5m2) of each value, down to the format's smallest subnormal times the scale (values
    far below the chunk's max flush toward zero), at every float32 magnitude: chunks whose scale
    float32 cannot hold are computed in units scaled by a power of two (:func:`prescale`).
    Deterministic (round to nearest even), biased.
    Aggregates by ``gather``: scales differ between ranks.
    When: between fp16 (2 bytes) and 4-bit quantization, with a floating error profile that keeps
    small gradients relatively accurate.
    """

    name = "fp8"
    Config = Fp8Config
    config: Fp8Config

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        assert isinstance(config, Fp8Config)
        # codes and peaks: sized by the tensor alone; each chunk scaled and cast on its own
        # deterministic codes: a whole part at once (gradcomp.compressors.rows)
        return Capabilities(Aggregation.GATHER, local=True, piece_multiple=config.chunk, same_shapes=True,
                            whole_part=True)  # fmt: skip

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        flat = check_gradient(tensor)
        chunk = self.config.chunk
        peaks = chunks.amax_abs(flat, chunk).float()
        dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        pre = prescale(peaks)
        inverse = inverse_or_zero(scales(peaks, self.config.format) * pre).to(dtype)
        # Non-finite peaks (NaN/Inf inputs) reach the decoder through ``peaks``.
        codes = torch.empty(flat.numel(), dtype=DTYPES[self.config.format], device=flat.device)
        count = flat.numel() // chunk
        done = 0
        if count and _ENCODE.may_run(flat.device):  # the whole chunks in one fused loop: bitwise the same
            body = count * chunk
            if _ENCODE.run(flat[:body].view(count, chunk), codes[:body].view(count, chunk), pre[:count],
                           inverse[:count]):  # fmt: skip
                done = body
        if done < flat.numel():
            first = done // chunk
            _scale_eagerly(flat[done:], codes[done:], chunk, pre[first:], inverse[first:], self.workspace)
        return (codes.view(torch.uint8), peaks), Meta.of(tensor)

    def decompress(self, payload: Payload, ctx: Meta, out: Tensor | None = None) -> Tensor:
        codes, peaks = payload
        result = flat_out(out, ctx, codes.device)
        flat = result.view(-1)
        dtype = torch.float64 if result.dtype == torch.float64 else torch.float32
        # as_half returns e4m3 values times 2**-8: fold the factor into the scale.
        factor = 256.0 if self.config.format == "e4m3" else 1.0
        pre = prescale(peaks)
        multipliers = (scales(peaks, self.config.format) * pre * factor).to(dtype)
        chunk = self.config.chunk
        count = ctx.numel // chunk
        done = 0
        if count and _DECODE.may_run(codes.device):  # the whole chunks in one fused loop: bitwise the same
            body = count * chunk
            unscale = (1 / pre[:count]).to(dtype)
            if _DECODE.run(codes[:body].view(count, chunk), flat[:body].view(count, chunk), multipliers[:count],
                           unscale, e4m3=self.config.format == "e4m3"):  # fmt: skip
                done = body
        if done < ctx.numel:
            self._decode_eagerly(codes[done:], flat[done:], pre[done // chunk :], multipliers[done // chunk :])
        return result.view(ctx.shape)

    def _decode_eagerly(self, codes: Tensor, out: Tensor, pre: Tensor, multipliers: Tensor) -> None:
        """:meth:`decompress` of ``codes`` into the flat ``out`` in operators of their own."""
        dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
        exact = out if out.dtype == dtype else None
        values = exact if exact is not None else self.workspace.take("values", out.numel(), dtype, codes.device)
        values.copy_(as_half(codes, self.config.format, self.workspace))
        unscale = (1 / pre).to(dtype) if host.unless((pre == 1).all()) else None
        for view, rows in chunks.parts(values, self.config.chunk):
            view.mul_(multipliers[rows, None])
            if unscale is not None:
                view.mul_(unscale[rows, None])
        if exact is None:
            out.copy_(values)

    @property
    def chunk(self) -> int:
        return self.config.chunk

    def encode_rows(self, rows: Tensor, layout: ChunkRows, segments: Segments) -> tuple[Tensor, ...]:
        (codes, peaks), _ = self.compress(rows.view(-1))  # every row a whole chunk
        return layout.compact(codes.view(layout.rows, layout.chunk)), peaks  # the pads' codes never travel

    def decode_rows(self, payload: tuple[Tensor, ...], layout: ChunkRows, out: Tensor) -> None:
        codes, peaks = payload
        spread = self.workspace.take("codes.rows", layout.rows * layout.chunk, torch.uint8, codes.device)
        layout.expand(codes, spread.view(layout.rows, layout.chunk))
        flat = out.view(-1)
        self.decompress((spread, peaks), Meta(flat.shape, flat.dtype, flat.numel()), out=flat)

    def state_dict(self) -> dict[str, Any]:
        return {}


def scales(peaks: Tensor, format: str) -> Tensor:
    """Per chunk, the value of the format's unit: max |x| / the format's largest value, in float64."""
    return peaks.double() / torch.finfo(DTYPES[format]).max


def prescale(peaks: Tensor) -> Tensor:
    """Per chunk, the power of two the scaling is computed in units of (float64): 2**64 where max |x|
    is below 2**-60 (its unit, max |x| / 448 or / 57344, would fall below float32's smallest
    normal: its reciprocal overflows, or it loses precision), else exactly 1. Decided on the device
    (rule "host reads", ``docs/architecture.md``); scaling by a power of two is exact."""
    peaks = peaks.double()
    return torch.where((peaks > 0) & (peaks < 2.0**-60), 2.0**64, 1.0)


def as_half(codes: Tensor, format: str, workspace: Workspace) -> Tensor:
    """fp8 bytes as float16, by moving bits (torch's own e4m3 -> float cast is several times slower
    on CPU: ``docs/benchmarks.md``, "Why the kernels look as they do").

    e5m2 is the top byte of a float16. e4m3 (bias 7) placed at float16's bits 7..14 (bias 15) reads
    as its value times 2**-8, subnormals included; NaN codes (0x7F, 0xFF) read as finite numbers,
    which is harmless because a NaN input makes the chunk's scale NaN.
    """
    wide = workspace.take("half", codes.numel(), torch.int16, codes.device)
    wide.copy_(codes)
    if format == "e5m2":
        wide.bitwise_left_shift_(8)
    else:
        sign = workspace.take("sign", codes.numel(), torch.int16, codes.device)
        torch.bitwise_and(wide, 0x80, out=sign).bitwise_left_shift_(8)
        wide.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign)
    return wide.view(torch.float16)


def _scale_eagerly(flat: Tensor, codes: Tensor, chunk: int, pre: Tensor, inverse: Tensor, workspace: Workspace) -> None:
    """``flat`` scaled per chunk (by ``pre`` then ``inverse``) and cast into the fp8 ``codes``, in
    operators of their own (the CPU skips the prescale where no chunk needs it)."""
    dtype = inverse.dtype
    multiplier = pre.to(dtype) if host.unless((pre == 1).all()) else None
    scaled = workspace.take("scaled", flat.numel(), dtype, flat.device)
    for (view, rows), (target, _) in zip(chunks.parts(flat, chunk), chunks.parts(scaled, chunk), strict=True):
        source = view if multiplier is None else torch.mul(view, multiplier[rows, None], out=target)
        torch.mul(source, inverse[rows, None], out=target)
    codes.copy_(scaled)


def _encode_fused(rows: Tensor, codes: Tensor, pre: Tensor, inverse: Tensor) -> None:
    """:func:`_scale_eagerly`'s arithmetic for whole chunks: ``rows`` (chunks, chunk) into the fp8
    ``codes`` of that shape; ``pre`` float64 and ``inverse`` in the working dtype, per chunk (times
    a prescale of 1 where none is needed: exact)."""
    dtype = inverse.dtype
    codes.copy_(rows.to(dtype) * pre.to(dtype)[:, None] * inverse[:, None])


def _decode_fused(codes: Tensor, out: Tensor, multipliers: Tensor, unscale: Tensor, *, e4m3: bool) -> None:
    """:meth:`Fp8._decode_eagerly`'s arithmetic for whole chunks: the uint8 ``codes`` (chunks, chunk)
    as float16 by moving bits (:func:`as_half`), times each chunk's multiplier and unscale, into ``out``."""
    wide = codes.to(torch.int16)
    wide = ((wide & 0x7F) << 7) | ((wide & 0x80) << 8) if e4m3 else wide << 8
    values = wide.view(torch.float16).to(multipliers.dtype) * multipliers[:, None]
    out.copy_(values * unscale[:, None])


_ENCODE = fusion.Kernel(_encode_fused, "fp8 encode")
_DECODE = fusion.Kernel(_decode_fused, "fp8 decode")
