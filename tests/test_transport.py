"""Transport of a bucket's payloads (sizes first, then packed bytes), on ranks simulated as threads:
every rank receives exactly what every other rank sent, in rank order, and the bytes on the wire are
the header plus the packed payloads, nothing more."""

from __future__ import annotations

import pytest
import torch

from gradcomp.compressors import Payload, make_compressor
from gradcomp.engine import packing, transport
from tests.fake_group import ThreadTransport, on_threads

SPECS = ["threshold:tau=1.0", "quantize:bits=3,chunk=16", "topk:ratio=0.1", "fp8"]
"""Variable-size (threshold keeps a different count on every rank), bit-packed, sparse, scaled."""
SHAPES = [(37,), (8, 5), (0,), (1,)]


def payloads(rank: int, salt: int = 0) -> list[Payload]:
    """This rank's payloads: one per (spec, shape), from tensors that differ between ranks."""
    result = []
    for i, (spec, shape) in enumerate((s, sh) for s in SPECS for sh in SHAPES):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + 10 * salt + i))
        result.append(make_compressor(spec, rank=rank).compress(x, key=i)[0])
    return result


def same(a: list[Payload], b: list[Payload]) -> bool:
    return all(
        len(p) == len(q) and all(s.dtype == t.dtype and torch.equal(s, t) for s, t in zip(p, q, strict=True))
        for p, q in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_all_gather_delivers_every_ranks_payloads_in_rank_order(world: int) -> None:
    def rank_body(exchange: ThreadTransport) -> tuple[bool, int, int]:
        mine = payloads(exchange.rank)
        everyone = transport.all_gather_payloads(mine, torch.device("cpu"), exchange)
        correct = len(everyone) == world and all(same(everyone[r], payloads(r)) for r in range(world))
        tensors = [t for p in mine for t in p]
        own = len(packing.header(tensors)) + packing.packed_bytes([t.shape for t in tensors], tensors)
        return correct, exchange.sent_elements, own

    for correct, sent, own in on_threads(world, rank_body):
        assert correct
        assert sent == (world - 1) * own  # the header's shapes and the packed bytes, to every other rank


@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_to_all_delivers_what_each_rank_sent_to_this_one(world: int) -> None:
    def rank_body(exchange: ThreadTransport) -> bool:
        outgoing = [payloads(exchange.rank, salt=j) for j in range(world)]  # different payloads per destination
        received = transport.all_to_all_payloads(outgoing, torch.device("cpu"), exchange)
        return len(received) == world and all(same(received[s], payloads(s, salt=exchange.rank)) for s in range(world))

    assert all(on_threads(world, rank_body))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_padded_all_gather_delivers_the_same_in_one_collective_once_it_knows_the_size(world: int) -> None:
    """The first call learns the capacity (two collectives: sizes, then frames); later calls with
    payloads of the same size need one; every rank derives the same capacity; a payload that
    outgrows it costs one more round, not a wrong result."""

    def rank_body(exchange: ThreadTransport) -> list[tuple[bool, int, int]]:
        results, capacity = [], 0
        for salt in range(3):
            before = exchange.collectives
            everyone, capacity = transport.all_gather_padded(
                payloads(exchange.rank, salt), torch.device("cpu"), exchange, capacity
            )
            correct = all(same(everyone[r], payloads(r, salt)) for r in range(world))
            results.append((correct, exchange.collectives - before, capacity))
        return results

    per_rank = on_threads(world, rank_body)
    for results in per_rank:
        assert all(correct for correct, _, _ in results)
        rounds = [count for _, count, _ in results]
        # threshold's payload size varies with the data: a larger one than seen grows the capacity
        assert rounds[0] == 2 and all(r in (1, 2) for r in rounds[1:])
        capacities = [c for _, _, c in results]
        assert capacities == sorted(capacities) and all(c % 8 == 0 for c in capacities)
    assert len({tuple(c for _, _, c in results) for results in per_rank}) == 1  # the same on every rank


def test_a_fixed_size_payload_travels_in_one_padded_collective_of_exactly_its_frame() -> None:
    """quantize's payload has the same size every step: from the second step on, one collective of
    exactly 8 bytes of size, the header and the packed bytes, per rank and destination."""

    def rank_body(exchange: ThreadTransport) -> tuple[int, int, int]:
        compressor = make_compressor("quantize:bits=4,chunk=32", rank=exchange.rank)
        capacity = 0
        for _ in range(3):
            mine = [compressor.compress(torch.randn(100, 30), key=0)[0]]
            exchange.sent_elements, before = 0, exchange.collectives
            everyone, capacity = transport.all_gather_padded(mine, torch.device("cpu"), exchange, capacity)
            assert same(everyone[exchange.rank], mine)
        tensors = [t for p in mine for t in p]
        frame = 8 + 8 * len(packing.header(tensors)) + packing.packed_bytes([t.shape for t in tensors], tensors)
        return exchange.collectives - before, exchange.sent_elements, frame

    for collectives, sent, frame in on_threads(3, rank_body):
        assert collectives == 1 and sent == 2 * frame


def test_regroup_cuts_a_flat_list_back_into_payloads() -> None:
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    assert transport.regroup([(a, b), (), (c,)], [c, a, b]) == [(c, a), (), (b,)]
