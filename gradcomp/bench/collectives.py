"""``gradcomp bench collectives``: all-reduce bus bandwidth of every algorithm, beside gloo's own.

Ranks are started on this machine (``gradcomp.launch``), on loopback or inside an emulated
network (``gradcomp.netem``: ``--net 1gbit``), once per size (so that the command can say which size
runs: :mod:`gradcomp.progress`). For each size, every repeat runs each algorithm
once, in an order rotated from repeat to repeat, after a barrier; a repeat's time is the slowest
rank's, and each figure is the median over repeats. Definitions as in nccl-tests: algbw = bytes /
time, busbw = algbw * 2 (p - 1) / p (the per-rank link traffic of an optimal all-reduce, so that
busbw compares across world sizes and algorithms).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradcomp import collectives
from gradcomp.bench.report import markdown_table
from gradcomp.bench.units import format_bytes
from gradcomp.collectives.cost_model import busbw
from gradcomp.launch import spawn
from gradcomp.progress import Progress, step

DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
"""Bytes: 4 KiB to 16 MiB."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One algorithm at one size."""

    algo: str
    size_bytes: int
    ranks: int
    time_ms: float
    native_time_ms: float
    network: str = "loopback"

    @property
    def algbw(self) -> float:
        """GB/s of tensor per unit time."""
        return self.size_bytes / (self.time_ms * 1e-3) / 1e9

    @property
    def busbw(self) -> float:
        """GB/s per rank on the wire for an optimal algorithm: algbw * 2 (p - 1) / p."""
        return busbw(self.size_bytes, self.ranks, self.time_ms * 1e-3) / 1e9

    @property
    def vs_native(self) -> float:
        """This algorithm's busbw over the native all-reduce's, at the same size in the same run."""
        return self.native_time_ms / self.time_ms

    def as_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields.update(algbw=self.algbw, busbw=self.busbw, vs_native=self.vs_native)
        return fields


def _options(algo: str, local_size: int | None) -> dict[str, Any]:
    return {"local_size": local_size} if algo == "hierarchical" else {}


def measure(
    rank: int, world: int, sizes: Sequence[int], algos: Sequence[str], repeats: int, local_size: int | None
) -> list[dict[str, Any]]:
    """Inside every rank: the median of the slowest rank's time, per (size, algorithm)."""
    rows = []
    for size in sizes:
        tensor = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
        times: dict[str, list[float]] = {algo: [] for algo in algos}
        for repeat in range(repeats + 1):  # the first round warms up
            # rotate the order, so that no algorithm always runs right after the same one
            for algo in [*algos[repeat % len(algos) :], *algos[: repeat % len(algos)]]:
                dist.barrier()
                start = time.perf_counter()
                collectives.all_reduce(tensor, "sum", algo=algo, **_options(algo, local_size))
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if repeat:
                    times[algo].append(float(elapsed))
                tensor.div_(world)  # keep the values bounded across repeats
        for algo in algos:
            rows.append({"algo": algo, "size_bytes": tensor.numel() * 4, "time_s": statistics.median(times[algo])})
    return rows


def run(
    ranks: int,
    sizes: Sequence[int] = DEFAULT_SIZES,
    algos: Sequence[str] = collectives.ALGORITHMS,
    repeats: int = 10,
    local_size: int | None = None,
    network: str = "loopback",
    progress: Progress | None = None,
) -> list[Row]:
    """Measure on ``ranks`` ranks on ``network`` (a netem profile); ``native`` is always measured, as the
    anchor. The ranks start once per size (a tenth of a second on loopback), so that ``progress``
    hears of each size (``len(sizes)`` steps)."""
    unknown = sorted(set(algos) - set(collectives.ALGORITHMS))
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; valid: {', '.join(collectives.ALGORITHMS)}")
    if "hierarchical" in algos:
        local_size = local_size or (2 if ranks % 2 == 0 else 1)
        if ranks % local_size:
            raise ValueError(f"--local-size {local_size} does not divide --ranks {ranks}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not sizes or min(sizes) < 4 or any(size % 4 for size in sizes):
        raise ValueError(f"sizes must be whole numbers of float32 values (multiples of 4 bytes), got {list(sizes)}")
    ordered = ["native", *[a for a in algos if a != "native"]]
    measured = []
    for i, size in enumerate(sizes):
        label = f"{network}: {format_bytes(size)} ({i + 1} of {len(sizes)} sizes), {len(ordered)} algorithms"
        with step(progress, label):
            args = ([size], ordered, repeats, local_size)
            measured += spawn(ranks, measure, args, timeout=3600, network=network)[0]
    native = {r["size_bytes"]: r["time_s"] for r in measured if r["algo"] == "native"}
    return [
        Row(r["algo"], r["size_bytes"], ranks, r["time_s"] * 1e3, native[r["size_bytes"]] * 1e3, network)
        for r in measured
    ]


def format_table(rows: Sequence[Row], local_size: int | None = None) -> str:
    """A Markdown table: one line per size and algorithm."""
    header = ("size", "algorithm", "time ms", "algbw GB/s", "busbw GB/s", "x native busbw")
    lines = []
    for row in rows:
        name = f"hierarchical (local_size={local_size})" if row.algo == "hierarchical" and local_size else row.algo
        lines.append((format_bytes(row.size_bytes), name, f"{row.time_ms:.3f}", f"{row.algbw:.3f}", f"{row.busbw:.3f}",
                      f"{row.vs_native:.2f}"))  # fmt: skip
    return markdown_table(header, lines, right=[True, False, True, True, True, True])
