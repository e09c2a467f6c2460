"""What compressing and decompressing cost on this machine, fitted from timings of the real kernels.

A compressor's time grows with the elements it touches, but not in proportion: a fixed cost per
call (Python, launches, small allocations) dominates a model of many small tensors, and the cost per
element rises once a tensor outgrows the caches (by a third to a half here between 1M and 4M
elements). So :func:`measure` times the real kernels (median of repeats, as ``gradcomp bench
compressors`` does) at sizes from 4K to 9.4M elements, and :class:`KernelCost` interpolates between
them. Decompressing the payloads of ``p`` ranks (``decompress_sum`` of a ``gather`` compressor)
costs one payload's decompression plus ``p - 1`` times what one more payload adds (timed with 1 and
4 payloads); a ``sum`` compressor decompresses one aggregated payload whatever ``p``.

Costs: timing the sizes takes from a fraction of a second (casts) to a few seconds (exact top-k)
per spec, on one thread.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradcomp.bench.compressors import gradient
from gradcomp.bench.timing import median_seconds
from gradcomp.compressors import Aggregation, Compressor, Key, make_compressor, parse_spec

SIDES = (64, 256, 1024, 2048, 3072)
"""Square matrices timed by default: 4K to 9.4M elements (square, for PowerSGD's sake)."""
PEERS = (1, 4)
"""Payload counts ``decompress_sum`` is timed with (gather compressors)."""


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """Seconds of one compressor's kernels, interpolated from timings at a few sizes.

    ``numel`` are the sizes timed (ascending); ``compress_s`` one compression each (the first round);
    ``next_round_s`` the later rounds of a multi-round compressor (PowerSGD's second product and
    orthogonalization: they run between collectives, not in backward); ``decompress_s`` decompressing
    one payload; ``extra_payload_s`` what each further payload adds to ``decompress_sum`` (0 for
    ``sum`` compressors). Between sizes the cost is interpolated linearly; below the smallest it is
    the smallest's (a fixed cost per call dominates there); above the largest it grows in proportion
    to the elements (memory-bound).

    ``overhead_s`` (at bucket sizes ``bucket_numel``) is what the engine adds to a bucket beyond
    these kernels and the link's collectives, measured by running the engine itself
    (:func:`gradcomp.cost.calibrate.time_engine`): handing the bucket between threads, packing,
    allocations, and the kernels' slowdown when another thread of the rank competes for the core. It
    may be negative where the kernels' or the link's fit overestimates.
    """

    numel: tuple[int, ...]
    compress_s: tuple[float, ...]
    next_round_s: tuple[float, ...]
    decompress_s: tuple[float, ...]
    extra_payload_s: tuple[float, ...]
    bucket_numel: tuple[int, ...] = ()
    overhead_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.numel)
        timings = (self.compress_s, self.next_round_s, self.decompress_s, self.extra_payload_s)
        if n == 0 or any(len(v) != n for v in timings):
            raise ValueError("a kernel cost needs one timing of each kind per size, and at least one size")
        if list(self.numel) != sorted(set(self.numel)) or self.numel[0] < 1:
            raise ValueError(f"kernel sizes must be distinct, positive and ascending, got {self.numel}")
        if len(self.bucket_numel) != len(self.overhead_s) or list(self.bucket_numel) != sorted(set(self.bucket_numel)):
            raise ValueError("engine overheads need one timing per bucket size, the sizes distinct and ascending")

    def compress(self, numel: float) -> float:
        return self._at(numel, self.compress_s)

    def next_round(self, numel: float) -> float:
        return self._at(numel, self.next_round_s)

    def decompress(self, numel: float, payloads: int = 1) -> float:
        return self._at(numel, self.decompress_s) + (payloads - 1) * self._at(numel, self.extra_payload_s)

    def overhead(self, numel: float) -> float:
        """What the engine adds to a bucket of ``numel`` elements (0 when not measured)."""
        return _interpolate(numel, self.bucket_numel, self.overhead_s) if self.bucket_numel else 0.0

    def _at(self, numel: float, seconds: tuple[float, ...]) -> float:
        return _interpolate(numel, self.numel, seconds)

    def as_dict(self) -> dict[str, list[float]]:
        return {f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelCost:
        def column(name: str) -> tuple[Any, ...]:
            kind = int if name.endswith("numel") else float
            return tuple(kind(v) for v in data.get(name, ()))

        return cls(*(column(f.name) for f in dataclasses.fields(cls)))


def _interpolate(numel: float, sizes: Sequence[int], seconds: Sequence[float]) -> float:
    """Linear between ``sizes``, the smallest's below them, in proportion to ``numel`` above them."""
    if numel <= 0:
        return 0.0
    if numel > sizes[-1]:
        return seconds[-1] * numel / sizes[-1]
    return float(np.interp(numel, sizes, seconds))


FREE = KernelCost((1,), (0.0,), (0.0,), (0.0,), (0.0,))
"""The uncompressed gradient: nothing to compress."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One timing: ``seconds`` to compress (``phase``: ``compress``), run the later rounds
    (``next_round``) or decompress ``payloads`` payloads (``decompress``) of ``numel`` elements."""

    phase: str
    numel: int
    payloads: int
    seconds: float


def measure(
    spec: str, sides: Sequence[int] = SIDES, repeats: int = 5, seed: int = 0, device: torch.device | str = "cpu"
) -> list[Sample]:
    """Time ``spec``'s compression (its first round, then its later rounds) and decompression on
    square float32 matrices of ``sides`` on ``device``, decompressing 1 and 4 payloads for ``gather``
    compressors."""
    compressor = make_compressor(parse_spec(spec), seed=seed)
    return [sample for side in sides for sample in _time_side(compressor, side, seed, repeats, torch.device(device))]


def _time_side(compressor: Compressor, side: int, seed: int, repeats: int, device: torch.device) -> list[Sample]:
    x = gradient(side * side, seed).to(device)
    return time_tensor(compressor, x.view(side, side) if x.dim() == 1 else x, ("calibrate", side), repeats)


def time_tensor(
    compressor: Compressor,
    x: Tensor,
    key: Key,
    repeats: int = 3,
    peers: Sequence[int] = PEERS,
    clock: Callable[[Callable[[], None]], float] | None = None,
) -> list[Sample]:
    """Time ``compressor`` on the tensor ``x`` (keyed ``key`` for its state): compress, the later
    rounds, and decompress (of 1 and of ``peers`` payloads for ``gather`` compressors). ``x`` is not
    modified. Used on real gradients by the ``auto`` hook. ``clock`` prices one run of a phase
    instead of timing it (the roofline's: :mod:`gradcomp.cost.roofline`)."""
    out = torch.empty_like(x)
    state: dict[str, Any] = {}

    def timed(run: Callable[[], None], runs: int = repeats, warmup: int = 1) -> float:
        if clock is not None:
            return clock(run)
        return median_seconds(run, x.device, repeats=runs, warmup=warmup)

    def compress() -> None:
        state["payload"], state["ctx"] = compressor.compress(x, key=key)

    def later_rounds() -> None:
        payload, ctx = state["payload"], state["ctx"]
        for _ in range(1, compressor.capabilities.rounds):
            payload, ctx = compressor.next_round(payload, ctx)
        state["final"], state["final_ctx"] = payload, ctx

    def decompress(count: int) -> None:
        if compressor.capabilities.aggregation is Aggregation.SUM:
            compressor.decompress(state["payload"], state["ctx"], out=out)
        else:
            compressor.decompress_sum([state["payload"]] * count, state["ctx"], out=out)

    compress()
    samples = [Sample("compress", x.numel(), 1, timed(compress))]
    if compressor.capabilities.rounds > 1:
        # the later rounds read the first round's context: time them on fresh ones, outside the clock
        rounds = []
        for _ in range(repeats + 1):
            compress()
            rounds.append(timed(later_rounds, runs=1, warmup=0))
        samples.append(Sample("next_round", x.numel(), 1, statistics.median(rounds[1:])))
        state["payload"], state["ctx"] = state["final"], state["final_ctx"]
    for count in sorted({1, *peers}) if compressor.capabilities.aggregation is Aggregation.GATHER else (1,):
        seconds = timed(functools.partial(decompress, count))
        samples.append(Sample("decompress", x.numel(), count, seconds))
    return samples


def fit(samples: Sequence[Sample]) -> KernelCost:
    """The :class:`KernelCost` of :func:`measure`'s timings (medians where a size was timed more than
    once): each further payload's cost is the slope between the largest and the smallest payload
    count timed at a size."""
    sizes = sorted({s.numel for s in samples})
    compress, later, decompress, extra = [], [], [], []
    for numel in sizes:
        at = [s for s in samples if s.numel == numel]
        compress_times = [s.seconds for s in at if s.phase == "compress"]
        decompress_times: dict[int, list[float]] = {}
        for sample in at:
            if sample.phase == "decompress":
                decompress_times.setdefault(sample.payloads, []).append(sample.seconds)
        if not compress_times or 1 not in decompress_times:
            raise ValueError(f"no compress and single-payload decompress timings at {numel} elements")
        one, most = statistics.median(decompress_times[1]), max(decompress_times)
        compress.append(statistics.median(compress_times))
        later.append(statistics.median([s.seconds for s in at if s.phase == "next_round"] or [0.0]))
        decompress.append(one)
        extra.append(max(0.0, (statistics.median(decompress_times[most]) - one) / (most - 1)) if most > 1 else 0.0)
    return KernelCost(tuple(sizes), tuple(compress), tuple(later), tuple(decompress), tuple(extra))


class KernelTable:
    """Kernel costs by canonical spec: a profile's, else timed here on first use (and remembered).

    Call it with a spec; :attr:`timed_here` lists the specs it had to time itself, so that a report
    can say which costs come from this machine rather than from the profile.
    """

    def __init__(self, known: Mapping[str, KernelCost] | None = None, repeats: int = 5) -> None:
        self.known = dict(known or {})
        self.repeats = repeats
        self.timed_here: list[str] = []

    def __call__(self, spec: str) -> KernelCost:
        canonical = str(parse_spec(spec))
        if canonical not in self.known:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as a rank of the benchmarks runs
            try:
                self.known[canonical] = fit(measure(canonical, repeats=self.repeats))
            finally:
                torch.set_num_threads(threads)
            self.timed_here.append(canonical)
        return self.known[canonical]
