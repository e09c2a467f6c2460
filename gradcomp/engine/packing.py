"""Many tensors as one byte buffer, so that a bucket's payloads travel in one collective.

Each tensor's bytes start at a multiple of 8 (so that they can be viewed as their dtype again). The
receiver knows the dtypes from its own payloads (the same structure on every rank) and gets the
shapes, which may differ between ranks and between the shards of a tensor (a sparse payload's
length, a per-chunk scale's number of chunks), as a separate int64 header: :func:`header` and
:func:`shapes` encode and decode it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

ALIGN = 8

Shape = tuple[int, ...]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """The tensors' bytes, each padded to a multiple of 8, in one new uint8 tensor."""
    out = torch.empty(packed_bytes([t.shape for t in tensors], tensors), dtype=torch.uint8, device=device)
    return pack_into(tensors, out)


def pack_into(tensors: Sequence[Tensor], out: Tensor) -> Tensor:
    """:func:`pack` into the first :func:`packed_bytes` bytes of the uint8 tensor ``out`` (the
    alignment padding zeroed: nothing uninitialized travels); returns ``out``."""
    offset = 0
    for tensor in tensors:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + raw.numel()].copy_(raw)
        out[offset + raw.numel() : offset + aligned(raw.numel())].zero_()
        offset += aligned(raw.numel())
    return out


def packed_bytes(shapes: Sequence[Shape], like: Sequence[Tensor]) -> int:
    """Size of :func:`pack` of tensors of ``shapes`` with the dtypes of ``like``."""
    return sum(aligned(math.prod(shape) * t.element_size()) for shape, t in zip(shapes, like, strict=True))


def header(tensors: Sequence[Tensor]) -> list[int]:
    """Every tensor's dimensions, one after the other: what a receiver needs besides the dtypes."""
    return [size for tensor in tensors for size in tensor.shape]


def shapes(values: Sequence[int], like: Sequence[Tensor]) -> list[Shape]:
    """Cut a :func:`header` back into shapes, with the numbers of dimensions of ``like``."""
    result, offset = [], 0
    for tensor in like:
        result.append(tuple(int(v) for v in values[offset : offset + tensor.dim()]))
        offset += tensor.dim()
    if offset != len(values):
        raise ValueError(f"a header of {len(values)} sizes does not describe {len(like)} tensors")
    return result


def unpack(raw: Tensor, shapes: Sequence[Shape], like: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``raw`` as tensors of ``shapes``, with the dtypes of ``like``."""
    tensors, offset = [], 0
    for shape, local in zip(shapes, like, strict=True):
        nbytes = math.prod(shape) * local.element_size()
        tensors.append(raw[offset : offset + nbytes].view(local.dtype).view(shape))
        offset += aligned(nbytes)
    return tensors
