"""Two-phase compressed all-reduce for ``gather`` compressors: bytes per rank stay O(1) in p.

For each tensor, cut into p shards (shard j belongs to rank j):

1. every rank compresses each shard for its owner and sends it there (one all-to-all of packed
   payloads, sizes first);
2. each rank decompresses and sums the p versions of its own shard (``decompress_sum``), compresses
   the reduced shard again, and all ranks all-gather those (packed, sizes first);
3. every rank decompresses every reduced shard into place.

A rank sends about 2 (p - 1) / p of the compressed tensor, against (p - 1) times for all-gathering
whole payloads, at the price of a second compression error. State is keyed per shard
(``StateKey.of_shard(j)``) and reduced shard (``StateKey.of_reduced(rank)``), so error feedback, when
on, corrects both compressions, and DDP's bucket changes leave it in place. Results are bitwise
identical on every rank: each reduced shard is decompressed from the same bytes everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from gradcomp.collectives.ring import chunk_bounds
from gradcomp.compressors import Compressor, Key, Meta, Payload
from gradcomp.compressors.capabilities import ratio_option
from gradcomp.compressors.keys import StateKey
from gradcomp.engine import transport


def reduce(
    compressor: Compressor,
    parts: Sequence[Tensor],
    keys: Sequence[Key],
    exchange: transport.Transport,
    ratio: float | None = None,
) -> int:
    """Replace every tensor of ``parts`` (views into a bucket) by the sum over the ranks of
    ``exchange``, compressed twice (at a warm-up's keep-``ratio`` where given); return the payload
    bytes this rank produced."""
    rank, world = exchange.rank, exchange.world
    options = ratio_option(ratio)
    base = compressor.codec  # decompresses any rank's payload without this rank's context or state
    flats = [part.reshape(-1) for part in parts]
    bounds = [chunk_bounds(flat.numel(), world) for flat in flats]
    device = flats[0].device if flats else torch.device("cpu")

    # Phase 1: shard j of every tensor, compressed for rank j.
    outgoing: list[list[Payload]] = [
        [
            compressor.compress(flat[b[j][0] : b[j][1]], StateKey.of(key).of_shard(j), **options)[0]
            for flat, b, key in zip(flats, bounds, keys, strict=True)
        ]
        for j in range(world)
    ]
    # every shard goes to its owner, this rank's own too: nothing comes back None
    received = cast(list[list[Payload]], transport.all_to_all_payloads(outgoing, device, exchange))
    reduced = []
    for i, (flat, b) in enumerate(zip(flats, bounds, strict=True)):
        start, stop = b[rank]
        mine = torch.empty(stop - start, dtype=flat.dtype, device=device)
        base.decompress_sum([received[s][i] for s in range(world)], Meta.of(mine), out=mine)
        reduced.append(compressor.compress(mine, StateKey.of(keys[i]).of_reduced(rank), **options)[0])

    produced = sum(compressor.wire_bytes(p) for payloads in outgoing for p in payloads)
    produced += sum(compressor.wire_bytes(p) for p in reduced)

    # Phase 2: everyone gets every rank's reduced shards.
    for s, payloads in enumerate(transport.all_gather_payloads(reduced, device, exchange)):
        for (flat, b), payload in zip(zip(flats, bounds, strict=True), payloads, strict=True):
            start, stop = b[s]
            target = flat[start:stop]
            base.decompress(payload, Meta.of(target), out=target)
    return produced
