"""Kernels per bucket: what compressing a part of a bucket launches, for one tensor and for many.

On a GPU every operator is a kernel launch, 4-10 us whatever it does, on backward's thread: a
compressor whose kernels grow with a bucket's tensors spends a step's worth of launches on a model of
150 tensors. :func:`count` runs a compressor on one part of a bucket as the engine does
(``Compressor.compress_part``, every further round, then ``decompress_part`` or, for a ``gather``
compressor, ``decompress_sum_part`` of two ranks' payloads) on an accelerator's paths
(``gradcomp.host.as_accelerator``), and counts its non-view operators with
:func:`gradcomp.cost.roofline.traffic`. :func:`compare` does it for a bucket of one tensor and for a
bucket of :func:`gpt_shapes` (150 tensors) holding as many elements: the same count for both is a
compressor whose launches do not grow with the tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from gradcomp.compressors import Aggregation, Compressor, Spec, make_compressor, parse_spec
from gradcomp.cost.roofline import traffic
from gradcomp.engine.plan import Context, plan_bucket, segments_of
from gradcomp.engine.spec import HookSpec


def gpt_shapes(layers: int = 12, width: int = 128, vocabulary: int = 256, context: int = 64) -> list[torch.Size]:
    """The parameter shapes of a GPT-shaped model (token and position embeddings, per layer a fused
    QKV projection, the attention's output, a 4x MLP, two layer norms, each with its bias; a final
    norm and the head): 12 per layer and 6 more, 150 tensors at 12 layers (GPT-2 small has 148)."""
    w = width
    block = [(3 * w, w), (3 * w,), (w, w), (w,), (4 * w, w), (4 * w,), (w, 4 * w), (w,), (w,), (w,), (w,), (w,)]
    shapes = [(vocabulary, w), (context, w)] + block * layers + [(w,), (w,), (vocabulary, w), (vocabulary,)]
    return [torch.Size(s) for s in shapes]


@dataclasses.dataclass(frozen=True)
class Launches:
    """The operators one part of a bucket costs, on an accelerator's paths."""

    tensors: int
    numel: int
    compress: int
    """Compression, every round included."""
    decompress: int
    """Decompression: of the sum (``sum`` compressors) or of two ranks' payloads (``gather``)."""
    fused: int = 0
    """Compress + decompress where the fused kernels compile: each counts as one launch
    (:func:`gradcomp.cost.roofline.traffic`)."""

    @property
    def total(self) -> int:
        return self.compress + self.decompress


def count(compressor: Compressor, spec: Spec, shapes: Sequence[torch.Size], seed: int = 0) -> Launches:
    """The operators ``compressor`` (made from ``spec``) launches for a bucket holding tensors of
    ``shapes``, handed over as the engine's plan hands it (2 ranks, past any warm-up: the casts take
    the bucket as one run of elements, the others a part of tensors), at its second step: the first
    also fills what is kept per layout and per key (error feedback's state, index tables)."""
    hook = HookSpec(spec)
    numel = sum(math.prod(s) for s in shapes)
    planned = segments_of(hook, numel, [("bench", i) for i in range(len(shapes))], shapes)
    (part,) = plan_bucket(hook, Context(2, accelerator=True), 0, planned).parts
    segments = part.layout
    bucket = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    declared = compressor.capabilities
    held: dict[str, list[object]] = {}

    def compress() -> None:
        states = compressor.compress_part(bucket.clone(), segments, 2.0)
        for _ in range(1, declared.rounds):
            states = [compressor.next_round(p, c) for p, c in states]
        held["payloads"], held["contexts"] = [p for p, _ in states], [c for _, c in states]

    out = torch.empty_like(bucket)

    def decompress() -> None:
        payloads, contexts = held["payloads"], held["contexts"]
        if declared.aggregation is Aggregation.SUM:
            compressor.decompress_part(payloads, contexts, out, segments)  # type: ignore[arg-type]
        else:
            gathered = [[p, p] for p in payloads]  # two ranks' payloads of each tensor
            compressor.decompress_sum_part(gathered, contexts, out, segments)  # type: ignore[arg-type]

    compress()  # a first step fills what is kept per layout and per key: count a steady-state step
    decompress()
    compressed = traffic(compress)
    decompressed = traffic(decompress)
    fused = traffic(compress, fused=True).kernels + traffic(decompress, fused=True).kernels
    return Launches(len(shapes), numel, compressed.kernels, decompressed.kernels, fused)


def compare(spec: str, shapes: Sequence[torch.Size] | None = None, seed: int = 0) -> tuple[Launches, Launches]:
    """``spec``'s operators for a bucket of one tensor (the squarest matrix of its elements: a
    vector would travel uncompressed through PowerSGD) and for a bucket of ``shapes`` (default
    :func:`gpt_shapes`) holding as many elements, each through a fresh compressor (its state empty)."""
    many = list(shapes) if shapes is not None else gpt_shapes()
    numel = sum(math.prod(s) for s in many)
    rows = max(d for d in range(1, math.isqrt(numel) + 1) if numel % d == 0)  # the squarest matrix
    one = [torch.Size((rows, numel // rows))]
    parsed = parse_spec(spec)
    alone = count(make_compressor(parsed, seed=seed), parsed, one, seed)
    return alone, count(make_compressor(parsed, seed=seed), parsed, many, seed)


def rows(specs: Sequence[str], seed: int = 0) -> list[tuple[str, Launches, Launches]]:
    """(spec, one tensor, 150 tensors) for every spec, and with error feedback where a spec takes it
    and has none (``ef=true``: its state is per tensor too)."""
    found = []
    for spec in specs:
        parsed = parse_spec(spec)
        variants = [str(parsed)]
        if not parsed.ef and parsed.capabilities.feedback_problem is None and parsed.name != "none":
            variants.append(str(parse_spec((parsed.name, {**dataclasses.asdict(parsed.config), "ef": True}))))
        found += [(variant, *compare(variant, seed=seed)) for variant in variants]
    return found


def format_table(found: Sequence[tuple[str, Launches, Launches]]) -> str:
    """The Markdown table of :func:`rows`."""
    from gradcomp.bench.report import markdown_table

    lines = [
        (f"`{spec}`", f"{one.compress} + {one.decompress}", f"{many.compress} + {many.decompress}",
         f"{(many.total - one.total) / (many.tensors - 1):.1f}", f"{one.fused}", f"{many.fused}")
        for spec, one, many in found
    ]  # fmt: skip
    tensors = f"{found[0][2].tensors} tensors" if found else "many"
    header = ("compressor", "1 tensor", tensors, "more per tensor", "fused: 1 tensor", f"fused: {tensors}")
    return markdown_table(header, lines)
