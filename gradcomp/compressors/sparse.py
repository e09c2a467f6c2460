"""What the sparsifiers (``topk``, ``threshold``) share: (values, indices) payloads and their sums."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp.compressors.base import Aggregation, Capabilities, Compressor, CompressorConfig, Meta, Payload, flat_out


def index_dtype(numel: int) -> torch.dtype:
    """The smallest integer type that can index ``numel`` elements."""
    if numel <= 2**8:
        return torch.uint8
    if numel <= 2**15:
        return torch.int16
    if numel <= 2**31:
        return torch.int32
    return torch.int64


def kept(ratio: float, numel: int) -> int:
    """How many of ``numel`` elements a ratio keeps: ceil(ratio * n), at least one of a non-empty tensor."""
    # round() first: 0.07 * 100 is 7.000000000000001 in floating point, and must keep 7
    return min(numel, max(1 if numel else 0, math.ceil(round(ratio * numel, 6))))


def ratio_error(ratio: float) -> str | None:
    """Why a keep-ratio is invalid, or None."""
    if not 0.0 < ratio <= 1.0:
        return f"ratio must be in (0, 1], got {ratio}"
    return None


class SparseCompressor(Compressor):
    """Base of sparsifiers whose payload is ``(values, indices)`` with indices unique per rank.

    Payload: ``values`` in the gradient's dtype and ``indices`` in :func:`index_dtype` of n.
    Aggregates by ``gather``; :meth:`decompress_sum` adds every rank's values with ``index_add_``,
    one rank at a time (indices are unique within a rank, so the result is deterministic on GPUs
    too), without densifying any payload.
    """

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        # values of different indices on every rank do not add up; NaN and Inf always count as selected
        return Capabilities(Aggregation.GATHER, payload_shows_non_finite=True)

    def sparse_payload(self, flat: Tensor, indices: Tensor) -> Payload:
        """The payload of ``flat`` at ``indices`` (int64)."""
        return flat[indices], indices.to(index_dtype(flat.numel()))

    def decompress(self, payload: Payload, ctx: Meta, out: Tensor | None = None) -> Tensor:
        values, indices = payload
        result = flat_out(out, ctx, values.device).zero_()
        result[indices.long()] = values.to(result.dtype)
        return result.view(ctx.shape)

    def sent_indices(self, payload: Payload, ctx: Meta) -> Tensor:
        return payload[1].long()

    def subtract_contribution(self, payload: Payload, ctx: Meta, tensor: Tensor) -> bool:
        # The contribution is zero off the indices (unique within a payload): k reads and writes,
        # no pass over the tensor. Under error feedback the values are the tensor's own there, so
        # what is left at the indices is exactly zero.
        values, indices = payload
        flat, at = tensor.view(-1), indices.long()
        flat[at] = flat[at] - values.to(flat.dtype)
        return True

    def decompress_sum(self, payloads: Sequence[Payload], ctx: Meta, out: Tensor | None = None) -> Tensor:
        if not payloads:
            raise ValueError("decompress_sum needs at least one payload")
        device = payloads[0][0].device
        result = flat_out(out, ctx, device)
        low_precision = result.dtype in (torch.float16, torch.bfloat16)
        acc = self.workspace.take("sum", ctx.numel, torch.float32, device) if low_precision else result
        acc.zero_()
        for values, indices in payloads:
            acc.index_add_(0, indices.long(), values.to(acc.dtype))
        if low_precision:
            result.copy_(acc)
        return result.view(ctx.shape)
