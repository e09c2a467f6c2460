"""Two-phase aggregation (compressed reduce-scatter, then all-gather) on ranks simulated as threads:
bitwise the same result on every rank, the exact sum when compression is lossless, within two
compression errors otherwise, error feedback for both compressions, and exact payload bytes."""

from __future__ import annotations

import math

import pytest
import torch

from gradcomp.collectives.ring import chunk_bounds
from gradcomp.compressors import make_compressor
from gradcomp.engine import two_phase
from tests.fake_group import ThreadTransport, on_threads
from tests.helpers import expected_wire_bytes

SHAPES = [torch.Size([7, 9]), torch.Size([100]), torch.Size([9]), torch.Size([3]), torch.Size([1])]
"""A bucket's tensors: a matrix, vectors, and tensors smaller than the world (empty shards). At 2
ranks and 4 elements per chunk, the shards of the 9 have 2 and 1 chunks: shapes differ by shard."""


def gradients(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def reduce_on(world: int, spec: str, steps: int = 1) -> list[dict[str, object]]:
    """Every rank's bucket after ``steps`` two-phase reductions of its gradients (views into one
    buffer, as the engine passes them), with the bytes it produced and its compressor."""

    def rank_body(exchange: ThreadTransport) -> dict[str, object]:
        compressor = make_compressor(spec, seed=0, rank=exchange.rank)
        produced = []
        for _ in range(steps):
            buffer = torch.cat([g.reshape(-1) for g in gradients(exchange.rank)])
            parts, start = [], 0
            for shape in SHAPES:
                parts.append(buffer[start : start + math.prod(shape)].view(shape))
                start += math.prod(shape)
            produced.append(two_phase.reduce(compressor, parts, list(range(len(SHAPES))), exchange))
        return {"buffer": buffer, "produced": produced, "compressor": compressor}

    return on_threads(world, rank_body)


def exact_sum(world: int) -> torch.Tensor:
    """The sum over ranks, in rank order (as ``decompress_sum`` adds)."""
    total = torch.cat([g.reshape(-1) for g in gradients(0)])
    for rank in range(1, world):
        total += torch.cat([g.reshape(-1) for g in gradients(rank)])
    return total


@pytest.mark.parametrize("world", [2, 3, 5])
def test_lossless_compression_gives_the_sum_identically_on_every_rank(world: int) -> None:
    results = reduce_on(world, "topk:ratio=1")  # keeps every element: both phases are lossless
    assert all(torch.equal(r["buffer"], results[0]["buffer"]) for r in results)
    assert torch.equal(results[0]["buffer"], exact_sum(world))  # summed in rank order, in float32, once


@pytest.mark.parametrize(("world", "chunk"), [(2, 4), (2, 64), (4, 64)])
def test_lossy_compression_stays_within_two_compression_errors(world: int, chunk: int) -> None:
    results = reduce_on(world, f"quantize:bits=8,rounding=nearest,chunk={chunk}")
    exact = exact_sum(world)
    assert all(torch.equal(r["buffer"], results[0]["buffer"]) for r in results)
    # each phase rounds to the nearest of 255 steps of a chunk's range (at most half a step); the
    # first phase's error on each of p shards adds up, the second one's once
    steps = exact.abs().max() * 2 * world / 255
    assert float((results[0]["buffer"] - exact).abs().max()) <= (world + 1) * steps / 2


def test_bytes_produced_are_every_shard_for_its_owner_and_the_own_shard_reduced() -> None:
    spec, world = "quantize:bits=3,chunk=16", 3
    results = reduce_on(world, spec)
    reference = make_compressor(spec)
    for rank, result in enumerate(results):
        expected = 0
        for shape in SHAPES:
            bounds = chunk_bounds(math.prod(shape), world)
            shards = [torch.zeros(stop - start) for start, stop in bounds]
            expected += sum(expected_wire_bytes(reference, shard, []) for shard in shards)
            expected += expected_wire_bytes(reference, shards[rank], [])
        assert result["produced"] == [expected]


def test_error_feedback_keeps_a_residual_for_both_compressions() -> None:
    world = 2
    results = reduce_on(world, "topk:ratio=0.2,ef=true", steps=3)
    assert all(torch.equal(r["buffer"], results[0]["buffer"]) for r in results)
    for rank, result in enumerate(results):
        compressor = result["compressor"]
        keys = {entry["key"] for entry in compressor.state_dict()["residuals"]}
        for key in range(len(SHAPES)):
            assert {(key, j) for j in range(world)} | {(key, "reduced", rank)} <= keys
