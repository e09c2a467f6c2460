"""Lossless and casting compressors: ``none``, ``fp16``, ``bf16``. All aggregate by ``sum``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

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
    flat_out,
)
from gradcomp.compressors.registry import register
from gradcomp.compressors.rows import ByRows, ChunkRows
from gradcomp.compressors.segments import Segments


@dataclasses.dataclass(frozen=True)
class NoOptions(CompressorConfig):
    """Compressors without options."""


@register
class Identity(Compressor):
    """The gradient itself travels. Exact: the reference every other compressor is held to.

    Wire: the input's bytes (4 per float32 element). The payload aliases the input (no copy).
    """

    name = "none"
    Config = NoOptions

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        return Capabilities(Aggregation.SUM, elementwise=True, local=True, unbiased=True)

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        return (check_gradient(tensor),), Meta.of(tensor)

    def decompress(self, payload: Payload, ctx: Meta, out: Tensor | None = None) -> Tensor:
        (flat,) = payload
        if out is None:
            return flat.view(ctx.shape)
        result = flat_out(out, ctx, flat.device)
        if result.data_ptr() != flat.data_ptr():
            result.copy_(flat)
        return result.view(ctx.shape)


class Cast(ByRows, Compressor):
    """Base of the casts: the payload is the gradient in a narrower floating type, summable.

    The engine hands a cast runs of a bucket's elements (element-wise and stateless: no tensors to
    keep apart). Under error feedback, whose residuals are per tensor, a part's tensors go by rows
    (:class:`~gradcomp.compressors.rows.ByRows`, rows of :attr:`chunk` elements, the pads left out
    of the payload): one cast and one residual update for the part, bitwise each tensor's own."""

    Config = NoOptions
    wire_dtype: ClassVar[torch.dtype]
    chunk: ClassVar[int] = 256
    """Elements per row when a part goes by rows: a row is the unit a short tensor pads to."""

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        return Capabilities(Aggregation.SUM, elementwise=True, local=True, whole_part=True)

    def compress_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[tuple[Payload, Any]]:
        if all(key is None for key in segments.keys):  # the plan's keyless runs: each run cast whole
            return Compressor.compress_part(self, buffer, segments, divisor, ratio=ratio)
        return super().compress_part(buffer, segments, divisor, ratio=ratio)

    def encode_rows(self, rows: Tensor, layout: ChunkRows, segments: Segments) -> tuple[Tensor, ...]:
        wire = self.workspace.take("rows.wire", rows.numel(), self.wire_dtype, rows.device).view(rows.shape)
        return (layout.compact(wire.copy_(rows)),)  # the pads never travel

    def decode_rows(self, payload: tuple[Tensor, ...], layout: ChunkRows, out: Tensor) -> None:
        (wire,) = payload
        if torch.finfo(out.dtype).max < torch.finfo(wire.dtype).max:  # saturate as decompress does
            flat = self.workspace.take("rows.values", wire.numel(), out.dtype, wire.device)
            wire = self.decompress((wire,), Meta(wire.shape, out.dtype, wire.numel()), out=flat)
        layout.expand(wire, out)  # the conversion in the copy

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        return (check_gradient(tensor).to(self.wire_dtype),), Meta.of(tensor)

    def decompress(self, payload: Payload, ctx: Meta, out: Tensor | None = None) -> Tensor:
        (wire,) = payload
        limit = torch.finfo(ctx.dtype).max
        if limit < torch.finfo(wire.dtype).max:
            # bf16's coarser rounding lifts float16's largest values past its range (65504 -> 65536):
            # saturate them rather than turn finite gradients into Inf. Inf stays Inf.
            wide = wire.float()  # bf16 itself cannot hold 65504
            wire = torch.where(wide.isinf(), wide, wide.clamp(-limit, limit))
        if out is None:
            return wire.to(ctx.dtype).view(ctx.shape)
        return flat_out(out, ctx, wire.device).copy_(wire).view(ctx.shape)


@register
class Fp16(Cast):
    """IEEE half precision, summed in half precision, as torch's ``fp16_compress_hook``.

    Wire: 2 bytes per element. Error: relative 2**-11 for |x| in [6.1e-5, 65504]; smaller values
    lose precision (subnormals) and larger ones overflow to Inf, so the engine divides by the world
    size *before* the cast and the sum (rule "divide before sum"). Deterministic, biased only by rounding.
    When: always worth trying first on a slow link: 2x fewer bytes for one memory pass.
    """

    name = "fp16"
    wire_dtype = torch.float16


@register
class Bf16(Cast):
    """bfloat16: float32's exponent range with 8 bits of mantissa; also on CPU/gloo.

    Wire: 2 bytes per element. Error: relative 2**-8; float32's range, so sums of many ranks are
    safe (only values within 2**-9 of float32's largest, |x| >= 3.3961e38, round to Inf). On float16
    gradients, results saturate at +-65504 (bf16 rounds 65504 up to 65536). Works on CPU/gloo, where
    torch's ``bf16_compress_hook`` refuses.
    When: like fp16 when gradients have a wide dynamic range.
    """

    name = "bf16"
    wire_dtype = torch.bfloat16
