"""Bit-packing of b-bit codes (b in 1..8) into a dense uint8 stream of exactly ceil(n*b/8) bytes.

Layout: a b-bit code is split into power-of-two-wide parts (3 = 2+1, 5 = 4+1, 6 = 4+2, 7 = 4+2+1).
The first 8 * (n // 8) codes are packed part by part into contiguous *planes*, 8/w codes of width w
per byte (a plane of width w holds (n // 8) * w bytes, so the planes together hold (n // 8) * b
bytes). The last n % 8 codes follow as one little-endian bit string, so the total is exactly
ceil(n * b / 8) bytes. Every step is a few vectorized shifts over contiguous tensors: no Python loop
over elements or chunks.
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


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack a 1-D uint8 tensor (any stride) of codes below 2**bits into ``packed_size(n, bits)`` bytes.

    The result is always a new tensor: it travels while the caller reuses ``codes``.
    """
    _check_bits(bits)
    n = codes.numel()
    body_codes = (n // 8) * 8
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    start = shift = 0
    for width in _PARTS[bits]:
        part = codes[:body_codes]
        if shift:
            part = part >> shift
        if shift + width < bits:
            part = part & ((1 << width) - 1)
        per_byte = 8 // width
        plane = out[start : start + body_codes // per_byte]
        plane.copy_(part[0::per_byte])
        for i in range(1, per_byte):
            plane.bitwise_or_(part[i::per_byte] << (i * width))
        start += plane.numel()
        shift += width
    if n > body_codes:
        out[start:] = _pack_tail(codes[body_codes:], bits)
    return out


def unpack(packed: Tensor, bits: int, numel: int, out: Tensor | None = None) -> Tensor:
    """Inverse of :func:`pack`: ``numel`` uint8 codes, written into ``out`` when given."""
    _check_bits(bits)
    if packed.numel() != packed_size(numel, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {numel} codes of {bits} bits")
    codes = torch.empty(numel, dtype=torch.uint8, device=packed.device) if out is None else out
    if bits == 8:
        return codes.copy_(packed)
    body_codes = (numel // 8) * 8
    body = codes[:body_codes]
    start = shift = 0
    for width in _PARTS[bits]:
        per_byte = 8 // width
        plane = packed[start : start + body_codes // per_byte]
        mask = (1 << width) - 1
        pieces = [plane >> (i * width) for i in range(per_byte)]
        if width < 8:
            pieces = [piece & mask for piece in pieces]
        if shift == 0:
            # stack writes each code once, contiguously (strided element-wise writes are slow)
            torch.stack(pieces, dim=1, out=body.view(-1, per_byte))
        else:
            body.bitwise_or_(torch.stack(pieces, dim=1).view(-1) << shift)
        start += plane.numel()
        shift += width
    if numel > body_codes:
        codes[body_codes:] = _unpack_tail(packed[start:], bits, numel - body_codes)
    return codes


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
