"""Bit-packing of b-bit codes (b in 1..8) into a dense uint8 stream of exactly ceil(n*b/8) bytes.

Layout (planar): the first ``m = 8 * (n // 8)`` codes are the body. A b-bit code is split into
power-of-two-wide parts (3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1); each part of width w fills one plane
of ``m * w / 8`` bytes, whose byte j holds the part of codes j, j + L, j + 2L, ... (L = m * w / 8),
the first in the lowest bits. The planes together hold ``(n // 8) * b`` bytes; the last n % 8 codes
follow as one little-endian bit string, so the total is exactly ceil(n * b / 8) bytes.

Planar rather than interleaved, because every step is then a shift or a mask over *contiguous*
slices, where interleaving within each byte needs strided reads and writes, an order of magnitude
slower (measured: ``docs/benchmarks.md``, "Why the kernels look as they do").
"""

from __future__ import annotations

import torch
from torch import Tensor

_PARTS: dict[int, tuple[int, ...]] = {
    1: (1,),
    2: (2,),
    3: (2, 1),
    4: (4,),
    5: (4, 1),
    6: (4, 2),
    7: (4, 2, 1),
    8: (8,),
}


def packed_size(numel: int, bits: int) -> int:
    """Bytes of ``numel`` packed ``bits``-bit codes."""
    return (numel * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if bits not in _PARTS:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def pack(codes: Tensor, bits: int, scratch: Tensor | None = None) -> Tensor:
    """Pack a 1-D uint8 tensor of codes below 2**bits into ``packed_size(n, bits)`` bytes.

    A few kernels per part whatever the width (a broadcast shift and a sum over the codes sharing a
    byte), not one per code in a byte: launches are what small tensors and GPUs pay for. The result is
    always a new tensor: it travels while the caller reuses ``codes``, which is left unchanged.
    ``scratch`` (n contiguous bytes) spares the allocation of the shifted codes.
    """
    _check_bits(bits)
    n = codes.numel()
    body = (n // 8) * 8
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    start = shift = 0
    for width in _PARTS[bits]:
        per_byte = 8 // width
        length = body // per_byte
        plane = out[start : start + length]
        if width == 8:  # whole bytes: the codes are the plane
            plane.copy_(codes[:body])
            start += length
            continue
        if per_byte == 2:  # width 4, always the lowest part: a shift and an or beat a reduction here
            torch.bitwise_left_shift(codes[length:body], 4, out=plane)  # uint8 drops the bits above 4
            low = codes[:length]
            if bits > 4:
                low = torch.bitwise_and(low, 15, out=_buffer(scratch, length, codes.device))
            plane.bitwise_or_(low)
            start += length
            shift += width
            continue
        shifted = _buffer(scratch, body, codes.device).view(per_byte, length)
        part = codes[:body].view(per_byte, length)
        if width < bits:  # isolate this part's bits first
            torch.bitwise_right_shift(part, shift, out=shifted)
            if shift + width < bits:
                shifted.bitwise_and_((1 << width) - 1)
            shifted.bitwise_left_shift_(_offsets(width, codes.device))
        else:
            torch.bitwise_left_shift(part, _offsets(width, codes.device), out=shifted)
        # the parts sharing a byte hold disjoint bits: their sum is their bitwise or
        torch.sum(shifted, dim=0, dtype=torch.uint8, out=plane)
        start += length
        shift += width
    if n > body:
        out[start:] = _pack_tail(codes[body:], bits)
    return out


def unpack(packed: Tensor, bits: int, numel: int, out: Tensor | None = None, scratch: Tensor | None = None) -> Tensor:
    """Inverse of :func:`pack`: ``numel`` uint8 codes, written into ``out`` (contiguous) when given.

    ``scratch`` (numel bytes) spares allocations when codes have several parts (3, 5, 6, 7 bits).
    """
    _check_bits(bits)
    if packed.numel() != packed_size(numel, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {numel} codes of {bits} bits")
    codes = torch.empty(numel, dtype=torch.uint8, device=packed.device) if out is None else out
    body = (numel // 8) * 8
    start = shift = 0
    for width in _PARTS[bits]:
        per_byte = 8 // width
        length = body // per_byte
        plane = packed[start : start + length].expand(per_byte, length)
        target = codes[:body].view(per_byte, length)
        if shift == 0:
            torch.bitwise_right_shift(plane, _offsets(width, packed.device), out=target)
            if width < 8:
                target.bitwise_and_((1 << width) - 1)
        else:
            piece = _buffer(scratch, body, packed.device).view(per_byte, length)
            torch.bitwise_right_shift(plane, _offsets(width, packed.device), out=piece)
            target.bitwise_or_(piece.bitwise_and_((1 << width) - 1).bitwise_left_shift_(shift))
        start += length
        shift += width
    if numel > body:
        codes[body:] = _unpack_tail(packed[start:], bits, numel - body)
    return codes


def _buffer(scratch: Tensor | None, size: int, device: torch.device) -> Tensor:
    """The first ``size`` bytes of ``scratch``, or new ones without it."""
    return torch.empty(size, dtype=torch.uint8, device=device) if scratch is None else scratch[:size]


_OFFSETS: dict[tuple[int, torch.device], Tensor] = {}


def _offsets(width: int, device: torch.device) -> Tensor:
    """The bit offsets of the codes sharing a byte, as a column (0, w, 2w, ...): made once per device."""
    key = (width, device)
    offsets = _OFFSETS.get(key)
    if offsets is None:
        offsets = _OFFSETS[key] = torch.arange(0, 8, width, dtype=torch.uint8, device=device).view(-1, 1)
    return offsets


def _pack_tail(codes: Tensor, bits: int) -> Tensor:
    """Pack fewer than 8 codes as one little-endian bit string (at most 56 bits)."""
    shifts = torch.arange(codes.numel(), device=codes.device, dtype=torch.int64) * bits
    word = (codes.to(torch.int64) << shifts).sum()
    byte_shifts = torch.arange(packed_size(codes.numel(), bits), device=codes.device, dtype=torch.int64) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8)


def _unpack_tail(tail: Tensor, bits: int, count: int) -> Tensor:
    byte_shifts = torch.arange(tail.numel(), device=tail.device, dtype=torch.int64) * 8
    word = (tail.to(torch.int64) << byte_shifts).sum()
    shifts = torch.arange(count, device=tail.device, dtype=torch.int64) * bits
    return ((word >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
