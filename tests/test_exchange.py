"""Reduce-scatter, all-gather(v), all-to-all(v), broadcast, async handles, interleaving with native
collectives, bad arguments and dead peers: on real gloo ranks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomp import collectives
from tests.distributed import Failures, identical_on_all_ranks, run_checks, spawn_ranks


def data(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-50, 50, (numel,), generator=torch.Generator().manual_seed(97 * rank + seed + numel))


def torch_all_gather(x: torch.Tensor) -> torch.Tensor:
    """torch's own all-gather of ``x`` (the same size on every rank), in rank order: the reference."""
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x)
    return torch.cat(pieces)


def check_exchanges(rank: int, world: int) -> Failures:
    failures = Failures()
    expect = failures.expect
    for block in (0, 1, 5, 1000, 300_000):  # 300k int64: several MiB per call
        # reduce-scatter: block r of the sum, against a local recomputation of every rank's input
        inputs = [data(r, world * block) for r in range(world)]
        out = torch.empty(block, dtype=torch.int64)
        handle = collectives.reduce_scatter(out, inputs[rank].clone(), "sum")
        expect(torch.equal(out, sum(inputs).view(world, block)[rank]), f"reduce_scatter block={block}")
        expect(
            handle.traffic is not None and handle.traffic.sent == (world - 1) * block * 8,
            f"reduce_scatter bytes block={block}",
        )
        # all-gather against torch's
        mine = data(rank, block, seed=1)
        gathered = torch.empty(world * block, dtype=torch.int64)
        collectives.all_gather(gathered, mine)
        expect(torch.equal(gathered, torch_all_gather(mine)), f"all_gather block={block}")
        # all-to-all: block j of every rank's input lands on rank j
        source = data(rank, world * block, seed=2)
        received = torch.empty_like(source)
        collectives.all_to_all(received, source)
        everyone = [data(r, world * block, seed=2).view(world, block) for r in range(world)]
        expect(
            torch.equal(received.view(world, block), torch.stack([e[rank] for e in everyone])),
            f"all_to_all block={block}",
        )

    # all-gatherv: a different size on every rank, zero included
    sizes = [(3 * r) % 7 for r in range(world)]
    pieces = collectives.all_gatherv(data(rank, sizes[rank], seed=3)).wait()
    expect([p.numel() for p in pieces] == sizes, "all_gatherv sizes")
    expect(all(torch.equal(p, data(r, sizes[r], seed=3)) for r, p in enumerate(pieces)), "all_gatherv data")

    # all-to-allv: rank r sends (r + j) % 3 elements to rank j, with and without known output splits
    def splits(r: int) -> list[int]:
        return [(r + j) % 3 for j in range(world)]

    source = data(rank, sum(splits(rank)), seed=4)
    for known in (None, [splits(r)[rank] for r in range(world)]):
        output = collectives.all_to_allv(source, splits(rank), known).wait()
        parts = []
        for r in range(world):
            theirs = data(r, sum(splits(r)), seed=4)
            start = sum(splits(r)[:rank])
            parts.append(theirs[start : start + splits(r)[rank]])
        expect(torch.equal(output, torch.cat(parts)), f"all_to_allv (output_splits={known})")

    # broadcast from every root
    for src in range(world):
        x = data(rank, 333, seed=5)
        collectives.broadcast(x, src)
        expect(torch.equal(x, data(src, 333, seed=5)), f"broadcast src={src}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_exchanges_deliver_every_block(world: int) -> None:
    run_checks(world, check_exchanges, timeout=240)


def interleave(rank: int, world: int) -> Failures:
    """gradcomp collectives in flight while the main thread runs torch's on the same group."""
    failures = Failures()
    for step in range(20):
        ours = torch.full((50_000,), float(rank + step))
        theirs = torch.full((1000,), float(rank * step))
        handle = collectives.all_reduce(ours, "sum", algo=["ring", "tree", "halving_doubling"][step % 3], async_op=True)
        dist.all_reduce(theirs)  # native, meanwhile
        dist.barrier()
        handle.wait()
        if not torch.equal(ours, torch.full_like(ours, sum(r + step for r in range(world)))):
            failures.append(f"step {step}: gradcomp result")
        if not torch.equal(theirs, torch.full_like(theirs, sum(r * step for r in range(world)))):
            failures.append(f"step {step}: native result")
    # many async operations queued at once complete in order
    handles = [collectives.all_reduce(torch.full((10,), float(i)), "max", async_op=True) for i in range(30)]
    values = [h.wait()[0].item() for h in handles]
    if values != [float(i) for i in range(30)]:
        failures.append(f"queued handles: {values}")
    return failures


def test_interleaving_with_native_collectives_on_the_same_group() -> None:
    run_checks(3, interleave, timeout=240)


def refuse_bad_arguments(rank: int, world: int) -> Failures:
    refused = Failures()
    x = torch.ones(10)
    cases = [
        (lambda: collectives.all_reduce(x, "median"), ValueError, "unknown reduce op 'median'"),
        (lambda: collectives.all_reduce(x, algo="butterfly"), ValueError, "valid: native, ring"),
        (lambda: collectives.all_reduce(x, algo="hierarchical"), ValueError, "needs local_size"),
        (lambda: collectives.all_reduce(x, algo="hierarchical", local_size=3), ValueError, "divide the world size"),
        (lambda: collectives.all_reduce(torch.ones(3, dtype=torch.int64), "avg"), TypeError, "avg needs a floating"),
        (lambda: collectives.all_reduce([1.0]), TypeError, "must be a torch.Tensor"),  # type: ignore[arg-type]
        (lambda: collectives.reduce_scatter(torch.ones(3), torch.ones(5)), ValueError, "reduce_scatter needs 2 blocks"),
        (lambda: collectives.all_gather(torch.ones(3), torch.ones(2)), ValueError, "all_gather needs 2 blocks"),
        (lambda: collectives.all_to_all(torch.ones(3), torch.ones(3)), ValueError, "multiple of 2"),
        (lambda: collectives.all_to_allv(x, [4, 4]), ValueError, "adding up to"),
        (lambda: collectives.broadcast(x, 5), ValueError, "src must be a rank"),
    ]
    for call, error, message in cases:
        try:
            call()
            refused.append(f"accepted: {message}")
        except error as caught:
            if message not in str(caught):
                refused.append(f"{message!r} not in {caught!r}")
    return refused


def test_bad_arguments_are_refused_before_any_communication() -> None:
    run_checks(2, refuse_bad_arguments, timeout=120)


def lose_a_peer(rank: int, world: int) -> dict[str, Any]:
    if rank == world - 1:
        return {"left": True}  # its process exits now, in the middle of everyone else's collective
    start = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(100_000), "sum", algo="ring")
    except Exception as error:  # the error must reach the caller, not hang
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_a_dead_peer_is_an_error_not_a_hang() -> None:
    group_timeout = 5
    results = spawn_ranks(3, lose_a_peer, timeout=90, group_timeout=group_timeout)
    assert results[2] == {"left": True}
    for survivor in results[:2]:
        assert survivor["error"] is not None, "the collective completed without its third rank"
        assert survivor["seconds"] < group_timeout + 10


def reduce_every_dtype(rank: int, world: int) -> Failures:
    """Any dtype: gradcomp's algorithms only move bytes and reduce with torch, whatever the backend."""
    failures = Failures()
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int8, torch.uint8):
        everyone = [
            torch.randint(0, 4, (5000,), generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)
        ]
        expected = sum(e.double() for e in everyone)
        for algo in ("ring", "tree", "halving_doubling"):
            mine = everyone[rank].clone()
            collectives.all_reduce(mine, "sum", algo=algo)
            if mine.dtype != dtype or not torch.equal(mine.double(), expected):  # small integers: exact
                failures.append(f"{algo} {dtype}")
            failures.expect(identical_on_all_ranks(mine), f"{algo} {dtype}: not identical on all ranks")
    return failures


def test_every_dtype_reduces_exactly_on_small_integers() -> None:
    run_checks(3, reduce_every_dtype, timeout=120)
