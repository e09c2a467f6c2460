"""All-reduce on real gloo ranks, against torch's own all-reduce and the cost formulas.

One group of ranks per world size runs every case (starting a rank costs seconds) and returns each
case's failures and the byte counts; the tests below assert one case each, so that a failure names
its world size, algorithm, op, dtype and size, e.g. ``test_all_reduce[w4-ring-sum-float32-n1001]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

from gradcomp import collectives
from gradcomp.launch import RankError
from tests.distributed import (
    Failures,
    assert_no_failures,
    identical_each_on_all_ranks,
    identical_on_all_ranks,
    spawn_ranks,
    torch_all_reduce,
)

WORLDS = [1, 2, 3, 4, 5, 8]
OPS = ["sum", "avg", "min", "max", "product"]
DTYPES = [torch.int64, torch.float32]
SIZES = [0, 1, "p-1", 1001, 4099, 20011]  # 20011 int64/float32: past halving-doubling's short path
BIG = 3 * 2**20 // 4 // 840 * 840  # about 3 MiB of float32, divisible by every world size tested


class Algo(NamedTuple):
    """An all-reduce algorithm and its options, named as a spec: ``hierarchical:local_size=2``."""

    name: str
    options: dict[str, Any]

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.options.items()) if self.options else "")


def algorithms(world: int) -> list[Algo]:
    algos = [Algo("ring", {}), Algo("tree", {}), Algo("halving_doubling", {}), Algo("native", {})]
    for local in sorted({1, world} | {d for d in (2, 4) if world % d == 0}):
        algos.append(Algo("hierarchical", {"local_size": local}))
    if world % 2 == 0:
        algos.append(Algo("hierarchical", {"local_size": 2, "inter": "halving_doubling"}))
    return algos


class Case(NamedTuple):
    """One all-reduce checked against torch's: ``x`` of ``numel`` elements of ``dtype`` on every rank."""

    world: int
    algo: Algo
    op: str
    dtype: torch.dtype
    numel: int

    def __str__(self) -> str:
        return f"w{self.world}-{self.algo}-{self.op}-{str(self.dtype).removeprefix('torch.')}-n{self.numel}"


def cases(world: int) -> list[Case]:
    numels = list(dict.fromkeys(world - 1 if size == "p-1" else int(size) for size in SIZES))  # p-1 may repeat one
    return [
        Case(world, algo, op, dtype, numel)
        for algo in algorithms(world)
        for dtype in DTYPES
        for op in OPS
        if op != "avg" or dtype.is_floating_point
        for numel in numels
    ]


def rank_data(rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator, dtype=dtype)
    low, high = (1, 3) if op == "product" else (-1000, 1000)  # products stay exact and in range
    return torch.randint(low, high, (numel,), generator=generator, dtype=dtype)


def check_world(rank: int, world: int) -> dict[str, Any]:
    """Every case of this world size: failures by case, by algorithm for the 3 MiB sum (and its
    bytes sent and received), and for a non-contiguous input. torch's reference is reduced once per
    input (every algorithm gets the same), and every case's result is checked bitwise the same on
    every rank in one all-gather at the end: a collective per case each would triple this test."""
    results: dict[str, Any] = {"cases": {}, "big": {}, "traffic": {}}
    references: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}
    outputs = {}
    for case in cases(world):
        x = rank_data(rank, case.numel, case.dtype, case.op)
        source = (case.op, case.dtype, case.numel)
        if source not in references:
            references[source] = torch_all_reduce(x, case.op)
        reference = references[source]
        failures = results["cases"][str(case)] = Failures()
        handle = collectives.all_reduce(x, case.op, algo=case.algo.name, **case.algo.options)
        failures.expect(handle.wait() is x, "not in place")
        exact = not case.dtype.is_floating_point or case.op in ("min", "max")
        same = torch.equal(x, reference) if exact else torch.allclose(x, reference, rtol=1e-5, atol=1e-5)
        if not same:
            difference = float((x.double() - reference.double()).abs().max())
            failures.append(f"differs from dist.all_reduce (max |difference| {difference:.3g})")
        outputs[str(case)] = x
    for name, identical in zip(outputs, identical_each_on_all_ranks(list(outputs.values())), strict=True):
        results["cases"][name].expect(identical, "not bitwise identical on all ranks")
    reference = torch_all_reduce(rank_data(rank, BIG, torch.float32, "sum"), "sum")
    for algo in algorithms(world):
        big = rank_data(rank, BIG, torch.float32, "sum")
        handle = collectives.all_reduce(big, "sum", algo=algo.name, **algo.options)
        failures = Failures()
        failures.expect(torch.allclose(big, reference, rtol=1e-5, atol=1e-4), "differs from dist.all_reduce")
        failures.expect(identical_on_all_ranks(big), "not bitwise identical on all ranks")
        results["big"][str(algo)] = failures
        if handle.traffic is not None:
            results["traffic"][str(algo)] = (handle.traffic.sent, handle.traffic.received)
    # min and max propagate NaN: a NaN on one rank reaches every rank, and no other element
    results["nan"] = {}
    for algo in algorithms(world):
        for op in ("min", "max"):
            x = rank_data(rank, 11, torch.float32, op)
            if rank == world - 1:
                x[3] = float("nan")
            collectives.all_reduce(x, op, algo=algo.name, **algo.options)
            if algo.name == "native":
                results["native_nan"] = bool(x[3].isnan())  # gloo's own: documented, not ours to test
                continue
            failures = Failures()
            failures.expect(bool(x[3].isnan()), "the NaN was dropped")
            failures.expect(bool(torch.isfinite(x[torch.arange(11) != 3]).all()), "the NaN spread")
            failures.expect(identical_on_all_ranks(x), "not bitwise identical on all ranks")
            results["nan"][f"{algo}-{op}"] = failures
    # a non-contiguous input, reduced in place
    column = rank_data(rank, 60, torch.float32, "sum").view(6, 10).t()
    reference = torch_all_reduce(column.contiguous(), "sum")
    collectives.all_reduce(column, "sum", algo="ring")
    results["non_contiguous"] = Failures()
    results["non_contiguous"].expect(torch.allclose(column, reference), "differs from dist.all_reduce")
    return results


@pytest.fixture(scope="module")
def ranks() -> Callable[[int], list[dict[str, Any]]]:
    """Every rank's results for a world size, from one group of ranks per world size (started when a
    test first asks for that world size; a failed group fails every test of its world size)."""
    started: dict[int, list[dict[str, Any]] | RankError] = {}

    def results(world: int) -> list[dict[str, Any]]:
        if world not in started:
            try:
                started[world] = spawn_ranks(world, check_world, timeout=240)
            except RankError as error:
                started[world] = error
                raise
        outcome = started[world]
        if isinstance(outcome, RankError):
            pytest.fail(f"the group of {world} ranks failed (see the first w{world} test)", pytrace=False)
        return outcome

    return results


@pytest.mark.parametrize("case", [c for world in WORLDS for c in cases(world)], ids=str)
def test_all_reduce(case: Case, ranks: Callable[[int], list[dict[str, Any]]]) -> None:
    """In place, as torch's dist.all_reduce (exactly where the result is exact), bitwise identical on
    every rank."""
    assert_no_failures([result["cases"][str(case)] for result in ranks(case.world)])


@pytest.mark.parametrize(
    ("world", "algo"),
    [(w, a) for w in WORLDS for a in algorithms(w)],
    ids=[f"w{w}-{a}" for w in WORLDS for a in algorithms(w)],
)
def test_all_reduce_3mib(world: int, algo: Algo, ranks: Callable[[int], list[dict[str, Any]]]) -> None:
    """A float32 sum of about 3 MiB: close to torch's, bitwise identical on every rank."""
    assert_no_failures([result["big"][str(algo)] for result in ranks(world)])


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
def test_non_contiguous_input_is_reduced_in_place(world: int, ranks: Callable[[int], list[dict[str, Any]]]) -> None:
    """A transposed matrix, reduced by the ring in place: as torch's all-reduce of a contiguous copy."""
    assert_no_failures([result["non_contiguous"] for result in ranks(world)])


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
def test_min_and_max_propagate_nan(world: int, ranks: Callable[[int], list[dict[str, Any]]]) -> None:
    """gradcomp's min and max keep a NaN that one rank holds (torch.minimum / torch.maximum), as
    ``docs/collectives.md`` says, for every algorithm; a non-finite gradient is never hidden."""
    results = ranks(world)
    for key in results[0]["nan"]:
        assert_no_failures([result["nan"][key] for result in results])
    assert len(results[0]["nan"]) == 2 * (len(algorithms(world)) - 1)


def traffic(results: list[dict[str, Any]], algo: str) -> list[tuple[int, int]]:
    """Bytes (sent, received) by every rank in the 3 MiB sum."""
    return [result["traffic"][algo] for result in results]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"w{w}")
def test_ring_traffic(world: int, ranks: Callable[[int], list[dict[str, Any]]]) -> None:
    """A ring sends and receives 2 (p - 1) / p * n bytes per rank (the cost formula of docs/collectives.md)."""
    share = 2 * (world - 1) * BIG * 4 // world
    assert traffic(ranks(world), "ring") == [(share, share)] * world


@pytest.mark.parametrize("world", [w for w in WORLDS if w & (w - 1) == 0], ids=lambda w: f"w{w}")
def test_halving_doubling_traffic(world: int, ranks: Callable[[int], list[dict[str, Any]]]) -> None:
    """Halving-doubling: the ring's bytes, for powers of two."""
    share = 2 * (world - 1) * BIG * 4 // world
    assert traffic(ranks(world), "halving_doubling") == [(share, share)] * world


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1], ids=lambda w: f"w{w}")
def test_tree_traffic(world: int, ranks: Callable[[int], list[dict[str, Any]]]) -> None:
    """A binomial tree: p - 1 whole-tensor messages up, p - 1 down, over all ranks."""
    sent, received = zip(*traffic(ranks(world), "tree"), strict=True)
    assert sum(sent) == 2 * (world - 1) * BIG * 4
    assert sum(sent) == sum(received)
