"""Collectives on real gloo ranks, against torch's own collectives and the cost formulas.

One group of ranks is spawned per world size and runs every check inside it (starting a rank costs
seconds); each rank returns its failures and byte counts, and the assertions run here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomp import collectives
from gradcomp.launch import spawn

OPS = ["sum", "avg", "min", "max", "product"]
SIZES = [0, 1, "p-1", 1001, 4099, 20011]  # 20011 int64/float32: past halving-doubling's short path
BIG = 3 * 2**20 // 4 // 840 * 840  # about 3 MiB of float32, divisible by every world size tested


def algorithms(world: int) -> list[tuple[str, dict[str, Any]]]:
    algos: list[tuple[str, dict[str, Any]]] = [("ring", {}), ("tree", {}), ("halving_doubling", {}), ("native", {})]
    for local in sorted({1, world} | {d for d in (2, 4) if world % d == 0}):
        algos.append(("hierarchical", {"local_size": local}))
    if world % 2 == 0:
        algos.append(("hierarchical", {"local_size": 2, "inter": "halving_doubling"}))
    return algos


def rank_data(rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator, dtype=dtype)
    low, high = (1, 3) if op == "product" else (-1000, 1000)  # products stay exact and in range
    return torch.randint(low, high, (numel,), generator=generator, dtype=dtype)


def reference(x: torch.Tensor, op: str) -> torch.Tensor:
    """torch's own all-reduce of the same data (avg as sum / p: gloo has no AVG)."""
    ref = x.clone()
    torch_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}[op]  # fmt: skip
    dist.all_reduce(ref, op=torch_op)
    if op == "avg":
        ref /= dist.get_world_size()
    return ref


def identical_everywhere(result: torch.Tensor) -> bool:
    copies = [torch.empty_like(result) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, result)
    return all(torch.equal(copy, result) for copy in copies)


def check_all_reduce(rank: int, world: int) -> dict[str, Any]:
    failures: list[str] = []
    traffic: dict[str, tuple[int, int]] = {}
    for algo, options in algorithms(world):
        name = f"{algo}{options or ''}"
        for dtype in (torch.int64, torch.float32):
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                for size in SIZES:
                    numel = world - 1 if size == "p-1" else int(size)
                    x = rank_data(rank, numel, dtype, op)
                    ref = reference(x, op)
                    handle = collectives.all_reduce(x, op, algo=algo, **options)
                    if handle.wait() is not x:
                        failures.append(f"{name} {op} {dtype} n={numel}: not in place")
                    exact = not dtype.is_floating_point or op in ("min", "max")
                    same = torch.equal(x, ref) if exact else torch.allclose(x, ref, rtol=1e-5, atol=1e-5)
                    if not same:
                        failures.append(f"{name} {op} {dtype} n={numel}: differs from dist.all_reduce")
                    if not identical_everywhere(x):
                        failures.append(f"{name} {op} {dtype} n={numel}: not bitwise identical on all ranks")
        big = rank_data(rank, BIG, torch.float32, "sum")
        ref = reference(big, "sum")
        handle = collectives.all_reduce(big, "sum", algo=algo, **options)
        if not torch.allclose(big, ref, rtol=1e-5, atol=1e-4) or not identical_everywhere(big):
            failures.append(f"{name}: 3 MiB sum wrong or not identical")
        if handle.traffic is not None:
            traffic[name] = (handle.traffic.sent, handle.traffic.received)
    # non-contiguous input, reduced in place
    matrix = rank_data(rank, 60, torch.float32, "sum").view(6, 10)
    column = matrix.t()
    ref = reference(column.contiguous(), "sum")
    collectives.all_reduce(column, "sum", algo="ring")
    if not torch.allclose(column, ref):
        failures.append("ring: non-contiguous input")
    return {"failures": failures, "traffic": traffic}


WORLDS = [1, 2, 3, 4, 5, 8]


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_matches_torch_for_every_algorithm_op_and_size(world: int) -> None:
    results = spawn(world, check_all_reduce, timeout=600)
    failures = [f"rank {r}: {f}" for r, result in enumerate(results) for f in result["failures"]]
    assert not failures, "\n".join(failures[:20])
    n_bytes = BIG * 4
    for r, result in enumerate(results):
        traffic = result["traffic"]
        # design.md section 4: ring sends and receives 2 (p - 1) / p * n bytes per rank
        assert traffic["ring"] == (2 * (world - 1) * n_bytes // world,) * 2, (r, traffic["ring"])
        if world & (world - 1) == 0:  # halving-doubling: the same, for powers of two
            assert traffic["halving_doubling"] == (2 * (world - 1) * n_bytes // world,) * 2
    if world > 1:
        # binomial tree: p - 1 whole-tensor messages up, p - 1 down, over all ranks
        assert sum(result["traffic"]["tree"][0] for result in results) == 2 * (world - 1) * n_bytes
        sent = sum(result["traffic"]["tree"][0] for result in results)
        assert sent == sum(result["traffic"]["tree"][1] for result in results)
