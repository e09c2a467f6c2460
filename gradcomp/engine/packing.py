"""Many tensors as one byte buffer, so that a bucket's payloads travel in one collective.

Each tensor's bytes start at a multiple of 8 (so that they can be viewed as their dtype again); the
receiver knows the dtypes and trailing dimensions from its own payloads, and gets the element
counts, which may differ between ranks (sparse payloads), as a separate int64 header.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

ALIGN = 8


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """The tensors' bytes, each padded to a multiple of 8, in one new uint8 tensor."""
    pieces = []
    for tensor in tensors:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8)
        padding = aligned(raw.numel()) - raw.numel()
        pieces.append(raw if not padding else torch.cat([raw, raw.new_zeros(padding)]))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)


def packed_bytes(numels: Sequence[int], like: Sequence[Tensor]) -> int:
    """Size of :func:`pack` of tensors with ``numels`` elements and the dtypes of ``like``."""
    return sum(aligned(n * t.element_size()) for n, t in zip(numels, like, strict=True))


def unpack(raw: Tensor, numels: Sequence[int], like: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``raw`` as tensors of ``numels`` elements, with the dtypes and trailing dimensions of
    ``like`` (the first dimension is what varies between ranks)."""
    tensors, offset = [], 0
    for n, local in zip(numels, like, strict=True):
        piece = raw[offset : offset + n * local.element_size()].view(local.dtype)
        tensors.append(piece.view(-1, *local.shape[1:]) if local.dim() > 1 else piece)
        offset += aligned(n * local.element_size())
    return tensors
