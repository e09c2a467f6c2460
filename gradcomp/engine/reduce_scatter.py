"""Compressed reduce-scatter: the gradient reduction of sharded data parallelism (FSDP2, ZeRO).

A sharded step hands every rank a flat gradient of p equal shards (shard j belongs to rank j) and
wants back, on rank j, the sum over the ranks of shard j, divided (an average). Here the shards
travel compressed, in one hop among all ranks, or in two (intra-node, then inter-node), as
DeepSpeed's ZeRO++ does (qgZ).

One hop (:func:`reduce_scatter`):

- ``gather`` compressors (quantizers, sign, top-k, ...): a rank compresses the p - 1 shards it sends
  (its own never travels, so it is never compressed) and exchanges them in one all-to-all of packed
  payloads, sizes first; it decompresses the p - 1 versions of its own shard, in rank order, adds
  its own exactly, in float32 (or wider), and rounds once to the gradient's dtype.
- ``sum`` compressors (casts, shared-seed random-k): every shard is compressed, the payloads being
  linear, and one reduce-scatter of the payloads sums them on the wire; the rank decompresses its block.

Two hops (:func:`reduce_scatter_two_hop`), with L ranks per node and N = p / L nodes, rank = node * L + local:

1. inside each node, rank (n, l) sends its local peer k the N shards (m, k) of every node m,
   compressed as one tensor, and reduces what its L - 1 peers sent it: partial sums over the node
   of the N shards (m, l), in float32;
2. across nodes, among the N ranks of local index l, the partial sum of shard (m, l) is compressed
   again for its owner (m, l), which reduces the N versions.

Only the second hop crosses nodes: N - 1 compressed shards per rank where one hop sends p - 1 (L times
fewer bytes on the slow links), at the price of a second compression error, which error feedback,
when on, corrects too.

State is keyed per destination (``StateKey.of_shard(j)``; in two hops ``of_hop("intra").of_shard(k)``
and ``of_hop("inter").of_shard(m)``): error feedback follows the data, every destination keeps its
residual from step to step. Each output shard is computed on its owner only, in a fixed order: the
same whatever the timing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from gradcomp.compressors import Aggregation, Compressor, Key, Meta, Payload
from gradcomp.compressors.keys import StateKey
from gradcomp.engine import transport

Phases = Callable[[str], AbstractContextManager[None]]
"""Times a ``compress``, ``communicate`` or ``decompress`` phase (``BucketRecord.phase``)."""


def untimed(name: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def reduce_scatter(
    compressor: Compressor,
    parts: Tensor,
    divisor: float,
    key: Key,
    exchange: transport.Transport,
    out: Tensor,
    phases: Phases = untimed,
) -> int:
    """``out`` = the sum over the ranks of ``exchange`` of their ``parts[rank] / divisor``, compressed
    (one hop); return the payload bytes this rank produced for the others (its own shard's, which
    stays here, not counted).

    ``parts`` is ``(world, n)`` and contiguous, row j for rank j; it is scratch afterwards. ``out`` has
    n elements, of any floating dtype (the result is rounded to it once). ``phases`` times each phase."""
    if parts.dim() != 2 or parts.shape[0] != exchange.world or not parts.is_contiguous():
        raise ValueError(f"parts must be a contiguous ({exchange.world}, n) tensor, got {tuple(parts.shape)}")
    if out.numel() != parts.shape[1]:
        raise ValueError(f"out must have {parts.shape[1]} elements (a shard), got {out.numel()}")
    if compressor.capabilities.aggregation is Aggregation.SUM:
        return _summed(compressor, parts, divisor, key, exchange, out.view(-1), phases)
    return _gathered(compressor, parts, divisor, key, exchange, out.view(-1), phases)


def reduce_scatter_two_hop(
    compressor: Compressor,
    flat: Tensor,
    divisor: float,
    key: Key,
    intra: transport.Transport,
    inter: transport.Transport,
    out: Tensor,
    phases: Phases = untimed,
) -> int:
    """:func:`reduce_scatter` of the flat ``flat`` (p shards, p = ``intra.world * inter.world``) in
    two hops: ``intra`` holds this rank's node (its rank is the local index), ``inter`` the ranks of
    its local index on every node (its rank is the node). Returns the payload bytes produced for
    other ranks, in both hops."""
    local_size, nodes, n = intra.world, inter.world, out.numel()
    if flat.numel() != local_size * nodes * n:
        raise ValueError(f"flat must hold {local_size * nodes} shards of {n} elements, got {flat.numel()}")
    # Row k: the shards (m, k) of every node m, for local peer k (one copy, to compress each row whole).
    with phases("compress"):
        by_local = flat.view(nodes, local_size, n).transpose(0, 1).contiguous().view(local_size, nodes * n)
    partial = torch.empty(nodes * n, dtype=_accumulator(flat.dtype), device=flat.device)
    across = partial.view(nodes, n)
    produced = reduce_scatter(compressor, by_local, divisor, StateKey.of(key).of_hop("intra"), intra, partial, phases)
    return produced + reduce_scatter(compressor, across, 1, StateKey.of(key).of_hop("inter"), inter, out, phases)


def _gathered(
    compressor: Compressor,
    parts: Tensor,
    divisor: float,
    key: Key,
    exchange: transport.Transport,
    out: Tensor,
    phases: Phases,
) -> int:
    rank, world = exchange.rank, exchange.world
    with phases("compress"):
        outgoing: list[list[Payload] | None] = [
            None if j == rank else [_compress(compressor, parts[j], divisor, StateKey.of(key).of_shard(j))[0]]
            for j in range(world)
        ]
    with phases("communicate"):
        received = transport.all_to_all_payloads(outgoing, parts.device, exchange)
    with phases("decompress"):
        others = [payloads[0] for payloads in received if payloads is not None]
        acc = out if out.dtype in (torch.float32, torch.float64) else torch.empty_like(out, dtype=torch.float32)
        own = parts[rank] if divisor == 1 else parts[rank].div_(divisor)
        if others:
            compressor.codec.decompress_sum(others, Meta(acc.shape, acc.dtype, acc.numel()), out=acc)
            acc.add_(own)
        else:
            acc.copy_(own)
        if acc is not out:
            out.copy_(acc)
    return sum(compressor.wire_bytes(payloads[0]) for payloads in outgoing if payloads is not None)


def _summed(
    compressor: Compressor,
    parts: Tensor,
    divisor: float,
    key: Key,
    exchange: transport.Transport,
    out: Tensor,
    phases: Phases,
) -> int:
    with phases("compress"):
        payloads, joined, ctx = _summable(compressor, parts, divisor, key, exchange.rank)
    with phases("communicate"):
        summed = tuple(exchange.reduce_scatter(tensor) for tensor in joined)
    with phases("decompress"):
        if not compressor.capabilities.elementwise:  # each block is shaped like one shard's payload
            summed = tuple(block.view(like.shape) for block, like in zip(summed, payloads[0], strict=True))
        target = out if out.dtype == parts.dtype else torch.empty_like(out, dtype=parts.dtype)
        compressor.decompress(summed, ctx, out=target)
        if target is not out:
            out.copy_(target)
    if compressor.capabilities.elementwise:  # one payload of every shard, element by element: a world-th stays here
        return compressor.wire_bytes(payloads[0]) * (exchange.world - 1) // exchange.world
    return sum(compressor.wire_bytes(payload) for j, payload in enumerate(payloads) if j != exchange.rank)


def _summable(
    compressor: Compressor, parts: Tensor, divisor: float, key: Key, rank: int
) -> tuple[list[Payload], list[Tensor], object]:
    """Every shard's payload, their tensors joined per position (the reduce-scatter's inputs, shard j
    in block j), and this rank's context."""
    world, n = parts.shape
    if compressor.capabilities.elementwise:  # stateless, element by element: all shards in one payload, no copy
        payload, _ = _compress(compressor, parts.view(-1), divisor, key)
        return [payload], [t.reshape(-1) for t in payload], Meta(torch.Size([n]), parts.dtype, n)
    states = [_compress(compressor, parts[j], divisor, StateKey.of(key).of_shard(j)) for j in range(world)]
    payloads = [payload for payload, _ in states]
    if len({tuple((t.shape, t.dtype) for t in payload) for payload in payloads}) > 1:
        raise ValueError(f"{compressor.name} gave payloads of different shapes for equal shards: cannot sum them")
    joined = [torch.cat([payload[i].reshape(-1) for payload in payloads]) for i in range(len(payloads[0]))]
    return payloads, joined, states[rank][1]


def _compress(compressor: Compressor, tensor: Tensor, divisor: float, key: Key) -> tuple[Payload, object]:
    """``compress(tensor / divisor)``, the division folded into the compressor's first pass where it can."""
    if divisor == 1:
        return compressor.compress(tensor, key)
    return compressor.compress_divided(tensor, divisor, key)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """float32, or the gradient's dtype if wider: partial sums are kept in it."""
    return torch.promote_types(dtype, torch.float32)
