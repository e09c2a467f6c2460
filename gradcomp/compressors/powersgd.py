"""``powersgd``: rank-r approximation of each matrix by one step of power iteration (two rounds)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors import counter
from gradcomp.compressors.base import (
    Aggregation,
    Capabilities,
    Compressor,
    CompressorConfig,
    Key,
    Meta,
    Payload,
    check_gradient,
    flat_out,
)
from gradcomp.compressors.counter import Counters
from gradcomp.compressors.finite import finite
from gradcomp.compressors.keys import plain
from gradcomp.compressors.registry import register
from gradcomp.compressors.segments import Segments, end_to_end
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


@dataclasses.dataclass(frozen=True)
class Group:
    """Compressed matrices of one shape and rank at a constant distance in the flat input: one
    batched view ``(count, rows, cols)`` of it, so that each step of the power iteration is one
    batched matmul for them all (``torch.bmm``) instead of one per matrix."""

    start: int
    stride: int
    count: int
    rows: int
    cols: int
    rank: int

    def matrices(self, flat: Tensor) -> Tensor:
        """The group's matrices as a ``(count, rows, cols)`` view of ``flat`` (no copy)."""
        return flat.as_strided(
            (self.count, self.rows, self.cols), (self.stride, self.cols, 1), flat.storage_offset() + self.start
        )


@dataclasses.dataclass
class PowerSGDContext:
    meta: Meta
    key: Key
    segments: list[Segment]
    groups: list[Group]
    flat: Tensor  # the input; read again in the second round and for the local contribution
    prescales: list[Tensor | None]  # per group, (count, 1, 1): the power of two each matrix was scaled by
    ps: list[Tensor] = dataclasses.field(default_factory=list)  # per group, orthonormal P, after round one
    raw_sum: Tensor | None = None  # the aggregated uncompressed part, after round one
    raw_local: Tensor | None = None  # this rank's uncompressed part, once ``flat`` was overwritten
    ranks: float = 1.0  # how many ranks' payloads are summed (the divisor of compress_divided)
    keys: list[list[Key]] | None = None  # a part's (compress_part): per group, each matrix's own key


@register
class PowerSGD(Compressor):
    """PowerSGD (Vogels et al., NeurIPS 2019): M ~ P Q^T with P = orth(sum M Q), Q = sum M^T P.

    Each matrix-shaped tensor M (n x m, higher-dimensional tensors as shape[0] x rest) travels as
    two thin factors in two rounds of all-reduce: round one sums P = M Q (n x r), every rank
    orthonormalizes it (QR, safe for zero and rank-deficient columns), round two sums Q = M^T P
    (m x r). Vectors, and matrices that r * (n + m) would not shrink, travel uncompressed in round
    one. Q is remembered per key for a warm start (the previous step's aggregate); a column that
    came back zero restarts from a random one. Matrices of one shape at a constant distance in a
    bucket (a transformer's layers) are computed as one batch: one ``bmm`` and one batched QR for
    them all (as torch's ``batch_tensors_with_same_shape``, without its copy). A part of a bucket
    (``compress_part``) is compressed so, each tensor's Q its own (its key's), in operators that
    grow with the part's shapes, not its tensors. Initial and restarted columns are Gaussian, drawn
    from counters of (seed, key, draw) (:mod:`~gradcomp.compressors.counter`): the same on every
    rank and device, however the tensors are grouped.

    Wire: 4 * r * (n + m) bytes per compressed matrix, the raw bytes of the rest. Biased (a low-rank
    projection): use with error feedback, as the paper does. Finite inputs give finite results at
    every float32 magnitude, decided on the device: a matrix whose largest entry lies outside
    [2**-60, 2**60] is scaled by a power of two while its factors are computed (exact, and P's span
    does not change), the warm start is rescaled (unscaled it squares the gradient's magnitude), Q
    saturates at float32's range, and a column of P Q^T that would pass the result's dtype saturates
    (``docs/compressors.md``). Pass ``shapes`` when compressing a flat bucket, or
    every tensor looks like a vector.
    When: large matrices on slow links; the compute is two thin matmuls per matrix.
    """

    name = "powersgd"
    Config = PowerSGDConfig
    config: PowerSGDConfig

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        return Capabilities(Aggregation.SUM, rounds=2, needs_shapes=True)  # P, then Q; of each matrix

    def __init__(self, config: CompressorConfig | None = None, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(config, seed=seed, rank=rank)
        self.counters = Counters(seed, "PowerSGD's initial factors")  # the seed alone: the same on every rank
        self.memory: dict[Key, Tensor] = {}
        """Per key, the last aggregate Q of every compressed matrix, flat in the order of the groups."""

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
        groups = batches(segments)
        return self._compressed(flat, self._initial_qs(key, groups, flat.device), segments, groups, key, tensor)

    def _compressed(self, flat: Tensor, qs: list[Tensor], segments: list[Segment], groups: list[Group], key: Key,
                    tensor: Tensor | None = None) -> tuple[Payload, PowerSGDContext]:  # fmt: skip
        """Round one's payload (P = M Q per matrix, the uncompressed pieces) and the context."""
        matrices = [g.matrices(flat).float() for g in groups]
        firsts = [_first_factor(m, q) for m, q in zip(matrices, qs, strict=True)]
        p_local = _cat([p for p, _ in firsts], torch.float32, flat.device)
        prescales = [scale for _, scale in firsts]
        raw = [flat[s.start : s.stop] for s in segments if not s.rank]
        payload = (p_local, _cat(raw, flat.dtype, flat.device))
        meta = Meta.of(flat if tensor is None else tensor)
        return payload, PowerSGDContext(meta, key, segments, groups, flat, prescales)

    def compress_divided(
        self,
        tensor: Tensor,
        divisor: float,
        key: Key = None,
        shapes: Sequence[torch.Size] | None = None,
        *,
        ratio: float | None = None,
    ) -> tuple[Payload, PowerSGDContext]:
        payload, ctx = super().compress_divided(tensor, divisor, key, shapes, ratio=ratio)  # keeps no ratio: None
        ctx.ranks = max(divisor, 1.0)  # what bounds the sum of the saturated factors (next_round)
        return payload, ctx

    def next_round(self, payload: Payload, ctx: PowerSGDContext) -> tuple[Payload, PowerSGDContext]:
        p_sum, raw_sum = payload
        ctx.ps = [torch.linalg.qr(p).Q for p in views(p_sum, [(g.count, g.rows, g.rank) for g in ctx.groups])]
        ctx.raw_sum = raw_sum
        # M^T P per matrix, on the matrix scaled as in round one (its columns' norms can pass
        # float32's range): scaled back, it saturates so that the sum over ranks stays finite.
        limit = torch.finfo(torch.float32).max / ctx.ranks
        q_local = []
        for g, p, scale in zip(ctx.groups, ctx.ps, ctx.prescales, strict=True):
            q = _times(g.matrices(ctx.flat).float().transpose(1, 2), p if scale is None else p * scale)
            q_local.append(torch.clamp_(q if scale is None else q / scale, -limit, limit))
        return (_cat(q_local, torch.float32, ctx.flat.device),), ctx

    # -- a part of a bucket at once ----------------------------------------------------------------------

    def compress_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[tuple[Payload, Any]]:
        """The part as one flat tensor of its tensors' shapes: its matrices batched by shape (one
        ``bmm`` and one QR per shape), each starting from its own key's Q; one payload per round.
        Tensor by tensor where the part's tensors do not lie end to end in ``buffer``."""
        span = end_to_end(segments)
        if span is None:
            return super().compress_part(buffer, segments, divisor, ratio=ratio)
        flat = buffer[span[0] : span[1]].div_(divisor)
        return [self.compress_span(flat, segments, max(divisor, 1.0))]

    def compress_span(self, flat: Tensor, segments: Segments, ranks: float) -> tuple[Payload, PowerSGDContext]:
        """Round one of a part's tensors lying end to end in ``flat`` (divided already; ``segments``
        say their shapes and keys, in order; ``ranks``: how many ranks' payloads are summed)."""
        layout = self.layout(flat.numel(), flat.shape, segments.shapes)
        groups = batches(layout)
        starts = {segment.start: index for index, segment in enumerate(layout)}
        keys = [[segments.keys[starts[g.start + j * g.stride]] for j in range(g.count)] for g in groups]
        payload, ctx = self._compressed(flat, self._part_qs(keys, groups, flat.device), layout, groups, None)
        ctx.keys, ctx.ranks = keys, ranks
        return payload, ctx

    def decompress_part(self, payloads: Sequence[Payload], contexts: Sequence[Any], buffer: Tensor,
                        segments: Segments) -> None:  # fmt: skip
        ctx = contexts[0] if len(contexts) == 1 else None
        if not isinstance(ctx, PowerSGDContext) or ctx.keys is None:  # compressed tensor by tensor
            super().decompress_part(payloads, contexts, buffer, segments)
            return
        span = end_to_end(segments)
        assert span is not None
        self.decompress(payloads[0], ctx, out=buffer[span[0] : span[1]])

    def _part_qs(self, keys: list[list[Key]], groups: list[Group], device: torch.device) -> list[Tensor]:
        """Per group, each matrix's initial Q, as its key alone would start (:meth:`_initial_qs`)."""
        qs = []
        for g, members in zip(groups, keys, strict=True):
            fresh = self._fresh(g, [self._first(key, 0) for key in members], device)
            held = [self.memory.get(key) for key in members]
            if all(q is None or q.numel() != g.cols * g.rank for q in held):
                qs.append(fresh)
                continue
            zero = _zeros(g.cols * g.rank, device)  # a key with no Q: unusable columns, so fresh ones
            remembered = torch.stack([q if q is not None and q.numel() == zero.numel() else zero for q in held])
            remembered = remembered.view(g.count, g.cols, g.rank)
            qs.append(torch.where(_usable(remembered), _unit_columns(remembered), fresh))
        return qs

    def _remember_part(self, q_sum: Tensor, ctx: PowerSGDContext) -> None:
        """Each matrix's summed Q into its key's memory where finite (each key's own decision)."""
        assert ctx.keys is not None
        shapes = [(g.count, g.cols * g.rank) for g in ctx.groups]
        for q, members in zip(views(q_sum, shapes), ctx.keys, strict=True):
            held = [self.memory.get(key) for key in members]
            if any(h is None or h.shape != q.shape[1:] for h in held):  # a first step: key by key
                for key, row, h in zip(members, q, held, strict=True):
                    if h is None or h.shape != row.shape:
                        self.memory[key] = row.clone()
                    else:
                        torch.where(finite(row), row, h, out=h)
                continue
            stacked = torch.stack(held)  # type: ignore[arg-type]
            ok = torch.isfinite(torch.stack(torch.aminmax(q, dim=1))).all(dim=0)
            torch.where(ok[:, None], q, stacked, out=stacked)
            torch._foreach_copy_(held, list(stacked.unbind(0)))  # type: ignore[arg-type]

    def decompress(self, payload: Payload, ctx: PowerSGDContext, out: Tensor | None = None) -> Tensor:
        """The aggregate from the summed Qs; remembers them for the next step's warm start."""
        if ctx.raw_sum is None:
            raise RuntimeError("powersgd: decompress called before next_round (it needs two rounds)")
        if self.config.warm_start and ctx.keys is not None:
            self._remember_part(payload[0], ctx)
        elif self.config.warm_start and ctx.groups:  # a tensor with no matrix has no Q to keep
            q_sum, remembered = payload[0], self.memory.get(ctx.key)
            if remembered is None or remembered.shape != q_sum.shape:
                self.memory[ctx.key] = q_sum.clone()
            else:  # a NaN step must not poison the memory: masked on the device, not a branch
                torch.where(finite(q_sum), q_sum, remembered, out=remembered)
        return self._reconstruct(payload[0], ctx.raw_sum, ctx, out)

    def contribution(self, payload: Payload, ctx: PowerSGDContext, out: Tensor | None = None) -> Tensor:
        """This rank's share, P Q_local^T plus its own uncompressed part; leaves the memory alone."""
        raw = ctx.raw_local if ctx.raw_local is not None else self._local_raw(ctx)
        return self._reconstruct(payload[0], raw, ctx, out)

    @staticmethod
    def _local_raw(ctx: PowerSGDContext) -> Tensor:
        return _cat([ctx.flat[s.start : s.stop] for s in ctx.segments if not s.rank], ctx.flat.dtype, ctx.flat.device)

    def subtract_contribution(self, payload: Payload, ctx: PowerSGDContext, tensor: Tensor) -> bool:
        """``tensor - P Q_local^T`` with one ``baddbmm_`` per group (BLAS reads and writes each
        matrix once); the uncompressed pieces travel exactly, so nothing of them is left."""
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            return False
        flat = tensor.view(-1)
        if flat.data_ptr() == ctx.flat.data_ptr():  # contribution() must still find what was sent
            ctx.raw_local = self._local_raw(ctx)
        for g, p, q in zip(ctx.groups, ctx.ps, self._safe_qs(payload[0], ctx, torch.float32), strict=True):
            g.matrices(flat).baddbmm_(p, q.transpose(1, 2), alpha=-1)
        pieces = [flat[s.start : s.stop] for s in ctx.segments if not s.rank]
        if pieces:
            torch._foreach_zero_(pieces)
        return True

    def _reconstruct(self, q_flat: Tensor, raw: Tensor, ctx: PowerSGDContext, out: Tensor | None) -> Tensor:
        """P Q^T per matrix, and the raw pieces, from the (summed or local) Q factors ``q_flat``."""
        result = flat_out(out, ctx.meta, raw.device)
        for g, p, q in zip(ctx.groups, ctx.ps, self._safe_qs(q_flat, ctx, result.dtype), strict=True):
            target = g.matrices(result)
            if result.dtype == torch.float32:
                torch.bmm(p, q.transpose(1, 2), out=target)
            else:
                target.copy_(torch.bmm(p, q.transpose(1, 2)))
        pieces = [s for s in ctx.segments if not s.rank]
        if pieces:  # one foreach copy (one launch on a GPU) for every uncompressed piece
            homes = [result[s.start : s.stop] for s in pieces]
            torch._foreach_copy_(homes, list(raw.split([s.stop - s.start for s in pieces])))
        return result.view(ctx.meta.shape)

    def _safe_qs(self, q_flat: Tensor, ctx: PowerSGDContext, dtype: torch.dtype) -> list[Tensor]:
        """Per group, the Q factors, each row scaled down where P Q^T could pass ``dtype``'s range:
        column j of P Q^T is at most sum_k |Q[j, k]| max_i |P[i, k]| (a bound computed in float64,
        which also bounds BLAS's partial sums); past it the column saturates, and stays finite.
        Decided on the device; a row that fits is multiplied by exactly 1."""
        limit = torch.finfo(dtype).max * (1 - 2.0**-10)  # a margin for float32's roundings of the product
        safe = []
        for q, p in zip(views(q_flat, [(g.count, g.cols, g.rank) for g in ctx.groups]), ctx.ps, strict=True):
            reach = p.abs().amax(dim=1).double().unsqueeze(2)  # (count, rank, 1): max_i |P[i, k]|
            bound = torch.bmm(q.abs().double(), reach)  # (count, cols, 1)
            safe.append(q * (limit / bound).clamp_(max=1.0).float())
        return safe

    def _initial_qs(self, key: Key, groups: list[Group], device: torch.device) -> list[Tensor]:
        draw, fresh, at = self.counters.draw(key) if groups else 0, [], 0  # drawn where it has a matrix
        for g in groups:  # each matrix's draws start at its Q's place in the key's memory
            width = g.cols * g.rank
            firsts = [self._first(key, at + j * width, draw) for j in range(g.count)]
            fresh.append(self._fresh(g, firsts, device))
            at += g.count * width
        remembered = self.memory.get(key)
        if remembered is None or remembered.numel() != sum(f.numel() for f in fresh):
            return fresh
        # A zero column (the tensor's gradient was zero last step) would make P rank-deficient for
        # good: restart it from the random draw. The others are scaled to a largest entry of 1: Q
        # carries the gradient's magnitude, and M Q would square it (overflowing float32 past
        # |x| ~ 1e19). torch.where keeps this free of host syncs.
        qs = views(remembered, [f.shape for f in fresh])
        return [torch.where(_usable(q), _unit_columns(q), f) for q, f in zip(qs, fresh, strict=True)]

    def _first(self, key: Key, position: int, draw: int | None = None) -> int:
        """The first counter of the normals of ``key``'s Q from ``position`` (its memory's element)
        on, at ``draw`` (None: the key's next draw, counted as drawn)."""
        draw = self.counters.draw(key) if draw is None else draw
        return counter.counter(self.counters.start(key), draw, 2 * position)

    @staticmethod
    def _fresh(g: Group, firsts: list[int], device: torch.device) -> Tensor:
        """(count, cols, rank) standard normals, matrix j's from the counters after ``firsts[j]``:
        Box-Muller of two uniforms each, in float64 (exact uniforms: a log's argument never 0)."""
        width = g.cols * g.rank
        starts = torch.tensor(firsts, dtype=torch.int64, device=device)
        uniform = counter.uniform_of(counter.mix(starts[:, None] + counter.steps(2 * width, device)[None, :]))
        radius = torch.log1p(-uniform[:, :width]).mul_(-2.0).sqrt_()
        normal = radius.mul_(torch.cos(uniform[:, width:].mul_(2 * math.pi)))
        return normal.float().view(g.count, g.cols, g.rank)

    def state_dict(self) -> dict[str, Any]:
        return {
            "counters": self.counters.state_dict(),
            "memory": [{"key": plain(key), "q": q} for key, q in self.memory.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.load_state_dict(state.get("counters", state.get("shared", {})))  # "shared": generator states
        self.memory = {}
        for entry in state["memory"]:
            if "q" in entry:
                self.memory[entry["key"]] = entry["q"]
            # an older checkpoint's per-matrix list ("qs") is in another order: that key starts afresh


@functools.lru_cache(maxsize=64)
def _zeros(numel: int, device: torch.device) -> Tensor:
    """A zero Q (never written): what a key with no Q stacks as."""
    return torch.zeros(numel, dtype=torch.float32, device=device)


def batches(segments: list[Segment]) -> list[Group]:
    """The compressed segments as groups: one shape and rank, at a constant distance, in order."""
    groups: list[Group] = []
    open_groups: dict[tuple[int, int, int], int] = {}  # shape and rank -> the group that may grow
    for s in segments:
        if not s.rank:
            continue
        shape = (s.rows, s.cols, s.rank)
        index = open_groups.get(shape)
        if index is not None:
            g = groups[index]
            last = g.start + (g.count - 1) * g.stride
            stride = s.start - last if g.count == 1 else g.stride
            if s.start - last == stride:
                groups[index] = dataclasses.replace(g, stride=stride, count=g.count + 1)
                continue
        open_groups[shape] = len(groups)
        groups.append(Group(s.start, s.rows * s.cols, 1, s.rows, s.cols, s.rank))
    return groups


def _first_factor(matrices: Tensor, qs: Tensor) -> tuple[Tensor, Tensor | None]:
    """M Q per matrix of a batch, and the prescale it was computed with (None: 1). On an accelerator
    always prescaled (:func:`prescale`: no host read); on the CPU, where a read is free, only when
    the plain product overflowed."""
    if host.reads_are_free(matrices.device):
        p = _times(matrices, qs)
        if host.flag(finite(p)):
            return p, None
    scale = prescale(matrices)
    return _times(matrices, qs * scale), scale


def prescale(matrices: Tensor) -> Tensor:
    """Per matrix of a ``(count, rows, cols)`` batch, a power of two that brings its largest |entry|
    near 1 when that lies outside [2**-60, 2**60], else exactly 1 (zero and non-finite matrices
    too): shape ``(count, 1, 1)``. Scaling by it is exact, and keeps M Q and M^T P inside float32."""
    peaks = torch.maximum(matrices.amax(dim=(1, 2)), matrices.amin(dim=(1, 2)).neg())
    exponent = torch.frexp(peaks).exponent.clamp_(-100, 100)
    usual = (peaks == 0) | ~torch.isfinite(peaks) | ((peaks >= 2.0**-60) & (peaks <= 2.0**60))
    scale = torch.where(usual, 1.0, torch.ldexp(torch.ones_like(peaks), -exponent))
    return scale.view(-1, 1, 1)


def _times(matrices: Tensor, thin: Tensor) -> Tensor:
    """matrices @ thin, batched, computed as (thin^T @ matrices^T)^T: faster for a thin right factor
    on CPU BLAS (up to 10x, for a transposed matrix: ``docs/benchmarks.md``), and the same numbers."""
    return torch.bmm(thin.transpose(1, 2), matrices.transpose(1, 2)).transpose(1, 2)


def _peaks(matrix: Tensor) -> Tensor:
    """The largest |entry| of each column (no squares: exact at every magnitude)."""
    return matrix.abs().amax(dim=-2, keepdim=True)


def _usable(matrix: Tensor) -> Tensor:
    """Columns with a finite, nonzero largest |entry| (the others restart from a random draw)."""
    peaks = _peaks(matrix)
    return torch.isfinite(peaks) & (peaks > 0)


def _unit_columns(matrix: Tensor) -> Tensor:
    """Each column divided by its largest |entry| (zero columns stay zero), as float32."""
    peaks = _peaks(matrix)
    return (matrix / torch.where(peaks > 0, peaks, 1.0)).float()


def _cat(tensors: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """One new flat tensor holding ``tensors`` in order (always a copy: it travels)."""
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])
