"""``powersgd``: rank-r approximation of each matrix by one step of power iteration (two rounds)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.base import (
    Aggregation,
    Compressor,
    CompressorConfig,
    Key,
    Meta,
    Payload,
    all_finite,
    check_gradient,
    flat_out,
)
from gradcomp.compressors.randomness import Generators
from gradcomp.compressors.registry import register
from gradcomp.flat import views


@dataclasses.dataclass(frozen=True)
class PowerSGDConfig(CompressorConfig):
    rank: int = 1
    """Rank r of the approximation; 1 to 4 is typical. Wire cost grows linearly in r."""
    warm_start: bool = True
    """Start each step's power iteration from the previous step's Q (one iteration then suffices)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One tensor of the (flat) input: elements [start, stop), viewed as rows x cols if compressed."""

    start: int
    stop: int
    rows: int
    cols: int
    rank: int  # 0: sent uncompressed


@dataclasses.dataclass
class PowerSGDContext:
    meta: Meta
    key: Key
    segments: list[Segment]
    flat: Tensor  # the input; read again in the second round and for the local contribution
    ps: list[Tensor] = dataclasses.field(default_factory=list)  # orthonormal P, after round one
    raw_sum: Tensor | None = None  # the aggregated uncompressed part, after round one
    raw_local: Tensor | None = None  # this rank's uncompressed part, once ``flat`` was overwritten
    ranks: float = 1.0  # how many ranks' payloads are summed (the divisor of compress_divided)


@register
class PowerSGD(Compressor):
    """PowerSGD (Vogels et al., NeurIPS 2019): M ~ P Q^T with P = orth(sum M Q), Q = sum M^T P.

    Each matrix-shaped tensor M (n x m, higher-dimensional tensors as shape[0] x rest) travels as
    two thin factors in two rounds of all-reduce: round one sums P = M Q (n x r), every rank
    orthonormalizes it (QR, safe for zero and rank-deficient columns), round two sums Q = M^T P
    (m x r). Vectors, and matrices that r * (n + m) would not shrink, travel uncompressed in round
    one. Q is remembered per key for a warm start (the previous step's aggregate); a column that
    came back zero restarts from a random one.

    Wire: 4 * r * (n + m) bytes per compressed matrix, the raw bytes of the rest. Biased (a low-rank
    projection): use with error feedback, as the paper does. Finite inputs give finite results at
    every float32 magnitude: the warm start is rescaled (its scale does not change P's span, and
    unscaled it squares the gradient's magnitude), and factors that overflow float32 (entries past
    ~3.4e38 / sqrt(rows or cols)) are recomputed in float64 and saturated (``docs/compressors.md``).
    Pass ``shapes`` when compressing a flat bucket, or every tensor looks like a vector.
    When: large matrices on slow links; the compute is two thin matmuls per matrix.
    """

    name = "powersgd"
    aggregation = Aggregation.SUM
    rounds = 2
    needs_shapes = True
    Config = PowerSGDConfig
    config: PowerSGDConfig

    def __init__(self, config: CompressorConfig | None = None, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(config, seed=seed, rank=rank)
        self.shared = Generators(seed)  # initial Q: the same on every rank
        self.memory: dict[Key, list[Tensor]] = {}

    def layout(self, numel: int, shape: torch.Size, shapes: Sequence[torch.Size] | None) -> list[Segment]:
        """How a tensor splits into compressed matrices and uncompressed pieces."""
        shapes = [shape] if shapes is None else [torch.Size(s) for s in shapes]
        total = sum(math.prod(s) for s in shapes)
        if total != numel:
            raise ValueError(f"shapes {list(map(tuple, shapes))} hold {total} elements, the tensor has {numel}")
        segments, start = [], 0
        for s in shapes:
            size = math.prod(s)
            rows = s[0] if len(s) >= 2 else size
            cols = size // rows if len(s) >= 2 and rows else 1
            rank = min(self.config.rank, rows, cols) if len(s) >= 2 else 0
            if rank and rank * (rows + cols) >= size:
                rank = 0  # the factors would not be smaller than the matrix
            segments.append(Segment(start, start + size, rows, cols, rank))
            start += size
        return segments

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, PowerSGDContext]:
        flat = check_gradient(tensor)
        segments = self.layout(flat.numel(), tensor.shape, shapes)
        qs = self._initial_qs(key, segments, flat.device)
        compressed = _compressed(segments)
        pairs = list(zip(compressed, qs, strict=True))
        p_local = _cat([_times(self._matrix(flat, s), q) for s, q in pairs], torch.float32, flat.device)
        if not all_finite(p_local) and all_finite(flat):
            # M Q overflowed float32. Only P's span matters (it is orthonormalized), so this rank's
            # columns are scaled to a largest entry of 1, computed in float64.
            p_local = _cat(
                [_unit_columns(self._matrix(flat, s).double() @ q.double()) for s, q in pairs],
                torch.float32,
                flat.device,
            )
        raw = [flat[s.start : s.stop] for s in segments if not s.rank]
        payload = (p_local, _cat(raw, flat.dtype, flat.device))
        return payload, PowerSGDContext(Meta.of(tensor), key, segments, flat)

    def compress_divided(
        self, tensor: Tensor, divisor: float, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, PowerSGDContext]:
        payload, ctx = super().compress_divided(tensor, divisor, key, shapes)
        ctx.ranks = max(divisor, 1.0)  # what bounds the sum of the saturated factors (next_round)
        return payload, ctx

    def next_round(self, payload: Payload, ctx: PowerSGDContext) -> tuple[Payload, PowerSGDContext]:
        p_sum, raw_sum = payload
        compressed = _compressed(ctx.segments)
        ctx.ps = [torch.linalg.qr(p).Q for p in views(p_sum, [(s.rows, s.rank) for s in compressed])]
        ctx.raw_sum = raw_sum
        pairs = list(zip(compressed, ctx.ps, strict=True))
        device = ctx.flat.device
        q_local = _cat([_times(self._matrix(ctx.flat, s).t(), p) for s, p in pairs], torch.float32, device)
        if not all_finite(q_local) and all_finite(ctx.flat):
            # M^T P overflowed: a column of M whose norm is past float32's range. The projection's
            # coordinates cannot travel as float32; they saturate so that the sum over ranks stays finite.
            limit = torch.finfo(torch.float32).max / ctx.ranks
            wide = [(self._matrix(ctx.flat, s).double().t() @ p.double()).clamp_(-limit, limit) for s, p in pairs]
            q_local = _cat(wide, torch.float32, device)
        return (q_local,), ctx

    def decompress(self, payload: Payload, ctx: PowerSGDContext, out: Tensor | None = None) -> Tensor:
        """The aggregate from the summed Qs; remembers them for the next step's warm start."""
        if ctx.raw_sum is None:
            raise RuntimeError("powersgd: decompress called before next_round (it needs two rounds)")
        qs = views(payload[0], [(s.cols, s.rank) for s in _compressed(ctx.segments)])
        if self.config.warm_start and all(all_finite(q) for q in qs):  # a NaN step must not poison the memory
            self.memory[ctx.key] = [q.clone() for q in qs]
        return self._reconstruct(payload[0], ctx.raw_sum, ctx, out)

    def contribution(self, payload: Payload, ctx: PowerSGDContext, out: Tensor | None = None) -> Tensor:
        """This rank's share, P Q_local^T plus its own uncompressed part; leaves the memory alone."""
        raw = ctx.raw_local if ctx.raw_local is not None else self._local_raw(ctx)
        return self._reconstruct(payload[0], raw, ctx, out)

    @staticmethod
    def _local_raw(ctx: PowerSGDContext) -> Tensor:
        return _cat([ctx.flat[s.start : s.stop] for s in ctx.segments if not s.rank], ctx.flat.dtype, ctx.flat.device)

    def subtract_contribution(self, payload: Payload, ctx: PowerSGDContext, tensor: Tensor) -> bool:
        """``tensor - P Q_local^T`` with one ``addmm_`` per matrix (BLAS reads and writes the
        matrix once); the uncompressed pieces travel exactly, so nothing of them is left."""
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            return False
        if self._overflows(payload[0]):
            return False  # the product needs float64 and saturation: contribution() does both
        flat = tensor.view(-1)
        if flat.data_ptr() == ctx.flat.data_ptr():  # contribution() must still find what was sent
            ctx.raw_local = self._local_raw(ctx)
        qs = views(payload[0], [(s.cols, s.rank) for s in _compressed(ctx.segments)])
        compressed = iter(zip(ctx.ps, qs, strict=True))
        for s in ctx.segments:
            if s.rank:
                p, q = next(compressed)
                flat[s.start : s.stop].view(s.rows, s.cols).addmm_(p, q.t(), alpha=-1)
            else:
                flat[s.start : s.stop].zero_()
        return True

    def _reconstruct(self, q_flat: Tensor, raw: Tensor, ctx: PowerSGDContext, out: Tensor | None) -> Tensor:
        """P Q^T per matrix, and the raw pieces, from the (summed or local) Q factors ``q_flat``."""
        result = flat_out(out, ctx.meta, raw.device)
        raw_at = 0
        qs = views(q_flat, [(s.cols, s.rank) for s in _compressed(ctx.segments)])
        wide = self._overflows(q_flat)
        compressed = iter(zip(ctx.ps, qs, strict=True))
        for s in ctx.segments:
            target = result[s.start : s.stop]
            if s.rank:
                p, q = next(compressed)
                if wide:  # saturate, in the input's dtype, what float32 products would turn into Inf
                    limit = torch.finfo(target.dtype).max
                    target.copy_((p.double() @ q.double().t()).clamp_(-limit, limit).view(-1))
                elif target.dtype == torch.float32:
                    torch.matmul(p, q.t(), out=target.view(s.rows, s.cols))
                else:
                    target.copy_(p.matmul(q.t()).view(-1))
            else:
                target.copy_(raw[raw_at : raw_at + target.numel()])
                raw_at += target.numel()
        return result.view(ctx.meta.shape)

    def _initial_qs(self, key: Key, segments: list[Segment], device: torch.device) -> list[Tensor]:
        compressed = _compressed(segments)
        generator = self.shared.on(device, key)
        fresh = [torch.randn(s.cols, s.rank, generator=generator, device=device) for s in compressed]
        remembered = self.memory.get(key)
        if remembered is None or [q.shape for q in remembered] != [q.shape for q in fresh]:
            return fresh
        # A zero column (the tensor's gradient was zero last step) would make P rank-deficient for
        # good: restart it from the random draw. The others are scaled to a largest entry of 1: Q
        # carries the gradient's magnitude, and M Q would square it (overflowing float32 past
        # |x| ~ 1e19). torch.where keeps this free of host syncs.
        return [torch.where(_peaks(q) > 0, _unit_columns(q), f) for q, f in zip(remembered, fresh, strict=True)]

    def _overflows(self, qs: Tensor) -> bool:
        """Whether P Q^T may overflow float32, from all of a call's Q factors at once (one host
        check): its entries are at most rank * max |Q|, P being orthonormal."""
        if not qs.numel():
            return False
        return host.flag(qs.abs().amax() * self.config.rank >= torch.finfo(torch.float32).max / 2)

    @staticmethod
    def _matrix(flat: Tensor, segment: Segment) -> Tensor:
        return flat[segment.start : segment.stop].view(segment.rows, segment.cols).float()

    def state_dict(self) -> dict[str, Any]:
        return {
            "shared": self.shared.state_dict(),
            "memory": [{"key": key, "qs": qs} for key, qs in self.memory.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shared.load_state_dict(state["shared"])
        self.memory = {entry["key"]: list(entry["qs"]) for entry in state["memory"]}


def _times(matrix: Tensor, thin: Tensor) -> Tensor:
    """matrix @ thin, computed as (thin^T @ matrix^T)^T: faster for a thin right factor on CPU BLAS
    (up to 10x, for a transposed matrix: ``docs/benchmarks.md``), and the same numbers."""
    return thin.t().matmul(matrix.t()).t()


def _peaks(matrix: Tensor) -> Tensor:
    """The largest |entry| of each column (no squares: exact at every magnitude)."""
    return matrix.abs().amax(dim=0)


def _unit_columns(matrix: Tensor) -> Tensor:
    """Each column divided by its largest |entry| (zero columns stay zero), as float32."""
    peaks = _peaks(matrix)
    return (matrix / torch.where(peaks > 0, peaks, 1.0)).float()


def _compressed(segments: list[Segment]) -> list[Segment]:
    return [s for s in segments if s.rank]


def _cat(tensors: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """One new flat tensor holding ``tensors`` in order (always a copy: it travels)."""
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])

