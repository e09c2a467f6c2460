"""Run the compression protocol for p simulated ranks in one process, without torch.distributed.

This is the reference the engine is tested against, and how tests and benchmarks exercise a
compressor end to end: every rank compresses its own tensor, payloads are summed (``sum``) or
gathered (``gather``) exactly as the collectives would, and each rank decompresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Aggregation, Compressor, Key, Payload


def sum_payloads(payloads: Sequence[Payload]) -> Payload:
    """Element-wise sum in rank order and in the payload's own dtype, as an all-reduce would."""
    total = tuple(t.clone() for t in payloads[0])
    for payload in payloads[1:]:
        for acc, t in zip(total, payload, strict=True):
            acc.add_(t)
    return total


def _copy(payload: Payload) -> Payload:
    """What a rank receives: its own copy (collectives write into the receiver's buffers)."""
    return tuple(t.clone() for t in payload)


def compress_all(
    compressors: Sequence[Compressor],
    tensors: Sequence[Tensor],
    key: Key = None,
    shapes: Sequence[torch.Size] | None = None,
) -> tuple[list[Any], list[Payload]]:
    """Every rank's context and final (local, not yet aggregated) payload, through all rounds."""
    if len(compressors) != len(tensors) or not compressors:
        raise ValueError("simulate needs one compressor per tensor, and at least one rank")
    states = [c.compress(t, key, shapes) for c, t in zip(compressors, tensors, strict=True)]
    for _ in range(1, compressors[0].capabilities.rounds):
        total = sum_payloads([payload for payload, _ in states])
        states = [c.next_round(_copy(total), ctx) for c, (_, ctx) in zip(compressors, states, strict=True)]
    return [ctx for _, ctx in states], [payload for payload, _ in states]


def aggregate(compressors: Sequence[Compressor], contexts: Sequence[Any], finals: Sequence[Payload]) -> list[Tensor]:
    """Every rank's decompressed sum of the final payloads, as the engine computes it."""
    if compressors[0].capabilities.aggregation is Aggregation.SUM:
        total = sum_payloads(finals)
        return [c.decompress(_copy(total), ctx) for c, ctx in zip(compressors, contexts, strict=True)]
    return [c.decompress_sum(finals, ctx) for c, ctx in zip(compressors, contexts, strict=True)]


def simulate(
    compressors: Sequence[Compressor],
    tensors: Sequence[Tensor],
    key: Key = None,
    shapes: Sequence[torch.Size] | None = None,
) -> list[Tensor]:
    """Each rank's decompressed sum of every rank's (compressed) tensor; one compressor per rank."""
    contexts, finals = compress_all(compressors, tensors, key, shapes)
    return aggregate(compressors, contexts, finals)


def roundtrip(
    compressor: Compressor, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
) -> Tensor:
    """decompress(compress(tensor)) through every round, as a world of one rank sees it."""
    return simulate([compressor], [tensor], key, shapes)[0]
