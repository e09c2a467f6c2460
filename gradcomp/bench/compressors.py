"""``gradcomp bench compressors``: kernel cost of every compressor against the memory floor.

For each size, one generated gradient is timed through one fp16 cast (the floor: the single memory
pass of torch's ``fp16_compress_hook``, which allocates its output as here), through ``torch.topk``
at ratio 0.01 (what a naive top-k costs), and through every compressor's compress + decompress
(all rounds, no communication; decompression writes into a preallocated output, as the engine
writes into the gradient bucket). Each figure is the median of ``repeats`` runs after a warm-up.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.bench.report import markdown_table
from gradcomp.bench.timing import median_seconds
from gradcomp.bench.units import format_elements
from gradcomp.compressors import Aggregation, Compressor, make_compressor, parse_spec
from gradcomp.compressors.sparse import kept
from gradcomp.options import parse_naming
from gradcomp.progress import Progress, step

DEFAULT_SPECS = (
    "none",
    "fp16",
    "bf16",
    "fp8:format=e4m3",
    "fp8:format=e5m2",
    "quantize:bits=8",
    "quantize:bits=4",
    "quantize:bits=4,rounding=nearest",
    "quantize:bits=3",
    "quantize:bits=2",
    "qsgd:bits=4",
    "terngrad",
    "sign",
    "topk:ratio=0.01,method=exact",
    "topk:ratio=0.01,method=sampled",
    "randomk:ratio=0.01",
    "threshold:tau=2.5",
    "powersgd:rank=4",
)
"""What ``gradcomp bench compressors`` times by default (``threshold:tau=2.5`` keeps about 1.2% of a
standard normal gradient)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One compressor at one size."""

    spec: str
    numel: int
    compress_ms: float
    decompress_ms: float
    floor_ms: float
    """One fp16 cast of the same tensor as torch's ``fp16_compress_hook`` does it (allocating its
    output), timed between this row's runs."""
    floor_into_ms: float
    """The same cast into a preallocated buffer: the pure memory pass, without page faults."""
    wire_bytes: int

    @property
    def total_ms(self) -> float:
        return self.compress_ms + self.decompress_ms

    @property
    def gbps(self) -> float:
        """Input gigabytes (float32) per second through compress + decompress."""
        return 4 * self.numel / (self.total_ms * 1e-3) / 1e9

    @property
    def ratio(self) -> float:
        """Compression ratio: float32 input bytes over wire bytes."""
        return 4 * self.numel / self.wire_bytes if self.wire_bytes else math.inf

    @property
    def vs_floor(self) -> float:
        """Compress + decompress time over one fp16 cast of the same tensor."""
        return self.total_ms / self.floor_ms

    @property
    def vs_floor_into(self) -> float:
        """Compress + decompress time over one fp16 cast into a preallocated buffer."""
        return self.total_ms / self.floor_into_ms

    def as_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields.update(
            total_ms=self.total_ms,
            gbps=self.gbps,
            ratio=self.ratio,
            vs_floor=self.vs_floor,
            vs_floor_into=self.vs_floor_into,
        )
        return fields


@dataclasses.dataclass(frozen=True)
class Reference:
    """The anchors measured beside the compressors, at one size."""

    numel: int
    fp16_cast_ms: float
    fp16_cast_into_ms: float
    torch_topk_ms: float


def gradient(numel: int, seed: int = 0, device: str = "cpu") -> Tensor:
    """A generated float32 gradient, shaped as a matrix when ``numel`` is a square (for PowerSGD)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    flat = torch.randn(numel, generator=generator, device=device)
    side = math.isqrt(numel)
    return flat.view(side, side) if side * side == numel else flat


def time_compressor(compressor: Compressor, x: Tensor, repeats: int) -> tuple[float, float, float, float, int]:
    """(compress ms, decompress ms, fp16 cast ms, fp16 cast-into ms, wire bytes) of full round trips:
    medians of ``repeats``, the casts timed between them so that the ratios resist machine drift."""
    out = torch.empty_like(x)
    flat = x.view(-1)
    half = torch.empty_like(flat, dtype=torch.float16)
    state: dict[str, Any] = {}

    def compress() -> None:
        payload, ctx = compressor.compress(x, key="bench")
        for _ in range(1, compressor.capabilities.rounds):
            payload, ctx = compressor.next_round(payload, ctx)
        state["payload"], state["ctx"] = payload, ctx

    def decompress() -> None:
        if compressor.capabilities.aggregation is Aggregation.SUM:
            compressor.decompress(state["payload"], state["ctx"], out=out)
        else:
            compressor.decompress_sum([state["payload"]], state["ctx"], out=out)

    compress()
    decompress()  # warm-up: workspaces allocated, caches primed
    floor, floor_into, compress_times, decompress_times = [], [], [], []
    for _ in range(repeats):
        floor.append(median_seconds(lambda: flat.to(torch.float16), x.device, repeats=1, warmup=0))
        floor_into.append(median_seconds(lambda: half.copy_(flat), x.device, repeats=1, warmup=0))
        compress_times.append(median_seconds(compress, x.device, repeats=1, warmup=0))
        decompress_times.append(median_seconds(decompress, x.device, repeats=1, warmup=0))
    wire = sum(compressor.wire_bytes(p) for p in _round_payloads(compressor, x))
    return (
        statistics.median(compress_times) * 1e3,
        statistics.median(decompress_times) * 1e3,
        statistics.median(floor) * 1e3,
        statistics.median(floor_into) * 1e3,
        wire,
    )


def _round_payloads(compressor: Compressor, x: Tensor) -> list[tuple[Tensor, ...]]:
    """The payload of every round of one compression of ``x`` (each one travels)."""
    payload, ctx = compressor.compress(x, key="bench-bytes")
    payloads = [payload]
    for _ in range(1, compressor.capabilities.rounds):
        payload, ctx = compressor.next_round(payload, ctx)
        payloads.append(payload)
    return payloads


def reference(x: Tensor, repeats: int) -> Reference:
    flat = x.view(-1)
    half = torch.empty_like(flat, dtype=torch.float16)
    magnitudes = flat.abs()
    k = kept(0.01, flat.numel())
    return Reference(
        numel=flat.numel(),
        fp16_cast_ms=median_seconds(lambda: flat.to(torch.float16), x.device, repeats) * 1e3,
        fp16_cast_into_ms=median_seconds(lambda: half.copy_(flat), x.device, repeats) * 1e3,
        torch_topk_ms=median_seconds(lambda: torch.topk(magnitudes, k, sorted=False), x.device, repeats) * 1e3,
    )


def run(
    sizes: Sequence[int],
    specs: Sequence[str] = DEFAULT_SPECS,
    repeats: int = 5,
    seed: int = 0,
    device: str = "cpu",
    progress: Progress | None = None,
) -> tuple[list[Reference], list[Row]]:
    """Time every spec at every size; the references come from the same run. ``progress`` hears of
    each size's references and each spec at each size (``len(sizes) * (len(specs) + 1)`` steps)."""
    parsed = [parse_naming(spec, parse_spec) for spec in specs]  # refuse a bad spec before timing anything
    references, rows = [], []
    for numel in sizes:
        size = f"{format_elements(numel)} elements"
        with step(progress, f"{size}: fp16 cast and torch.topk", 1):
            x = gradient(numel, seed, device)
            ref = reference(x, repeats)
        references.append(ref)
        for spec in parsed:
            with step(progress, f"{size}: {spec}", 1):
                timings = time_compressor(make_compressor(spec, seed=seed), x, repeats)
            rows.append(Row(str(spec), numel, *timings))
    return references, rows


def format_table(references: Sequence[Reference], rows: Sequence[Row]) -> str:
    """A Markdown table per size: the anchors first, then every compressor."""
    header = ("compressor", "compress ms", "decompress ms", "total ms", "GB/s", "ratio", "fp16 cast ms",
              "x fp16 cast", "x cast into buffer")  # fmt: skip
    sections = []
    for ref in references:
        lines = [
            (f"`{row.spec}`", f"{row.compress_ms:.1f}", f"{row.decompress_ms:.1f}", f"{row.total_ms:.1f}",
             f"{row.gbps:.2f}", f"{row.ratio:.1f}", f"{row.floor_ms:.1f}", f"{row.vs_floor:.2f}",
             f"{row.vs_floor_into:.1f}")
            for row in rows
            if row.numel == ref.numel
        ]  # fmt: skip
        sections.append(
            f"### {format_elements(ref.numel)} float32 elements ({4 * ref.numel / 1e6:.0f} MB)\n\n"
            f"Before the rows: fp16 cast {ref.fp16_cast_ms:.1f} ms (into a preallocated buffer: "
            f"{ref.fp16_cast_into_ms:.1f} ms); torch.topk at ratio 0.01: {ref.torch_topk_ms:.1f} ms. "
            "Each row's ratio uses the fp16 cast timed between its own runs.\n\n" + markdown_table(header, lines) + "\n"
        )
    return "\n".join(sections)
