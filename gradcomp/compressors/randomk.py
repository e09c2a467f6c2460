"""``randomk``: send k random elements chosen identically on every rank, so only values travel."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

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
from gradcomp.compressors.registry import register
from gradcomp.compressors.sizes import BySize, GroupMeta, SizeGroup
from gradcomp.compressors.sparse import kept, ratio_error


@dataclasses.dataclass(frozen=True)
class RandomKConfig(CompressorConfig):
    ratio: float = 0.01
    """Fraction of elements sent, in (0, 1]."""
    scale: bool = True
    """Multiply values by the inverse inclusion probability (about 1 / ratio), making the estimate
    unbiased. Off with error feedback (``scale=false,ef=true``), which corrects the bias itself: a
    scaled random-k is no contraction, and error feedback on it diverges (refused)."""

    def __post_init__(self) -> None:
        problem = ratio_error(self.ratio)
        if problem:
            raise ValueError(problem)


@dataclasses.dataclass(frozen=True)
class RandomKContext:
    meta: Meta
    indices: Tensor


@register
class RandomK(BySize, Compressor):
    """Random-k sparsification (Stich et al., NeurIPS 2018) with shared-seed, stratified indices.

    The n elements are cut into k consecutive blocks of floor or ceil(n / k) elements, and one
    element per block is drawn from a generator seeded identically on every rank, so every rank
    picks the same k indices in the same step and only the values travel: the payloads are summable
    (``sum`` aggregation, an all-reduce of k values). Each element is picked with probability
    1 / (its block's size); with ``scale=true`` values are multiplied by that size, so the result is
    unbiased with variance below uniform sampling's.

    Wire: k value bytes, no indices. Every rank must compress the same tensors in the same order (the
    engine guarantees it), or their indices diverge. Non-finite inputs poison the sent values; a
    scaled value beyond the dtype's largest finite one saturates there (unbiased except there).
    When: cheap unbiased sparsification; weaker than top-k per byte, but summable.
    """

    name = "randomk"
    Config = RandomKConfig
    config: RandomKConfig

    def __init__(self, config: CompressorConfig | None = None, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(config, seed=seed, rank=rank)
        self.counters = Counters(seed, "random-k's indices")  # the seed alone: the same indices on every rank

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        assert isinstance(config, RandomKConfig)
        problem = None
        if config.scale:
            problem = (
                "scaled by about 1 / ratio, random-k is no contraction and error feedback on it diverges "
                "(measured: the digits MLP's loss at 1e10 within 10 steps); use randomk:scale=false,ef=true"
            )
        return Capabilities(
            Aggregation.SUM,  # the same indices on every rank: the values add up
            payload_shows_non_finite=True,  # every value is NaN if the input holds a non-finite one
            ratio=config.ratio,
            unbiased=config.scale,
            feedback_problem=problem,
        )

    def compress(
        self,
        tensor: Tensor,
        key: Key = None,
        shapes: Sequence[torch.Size] | None = None,
        *,
        ratio: float | None = None,
    ) -> tuple[Payload, RandomKContext]:
        """``ratio``: the fraction kept this time (a warm-up's), instead of the config's."""
        flat = check_gradient(tensor)
        n = flat.numel()
        k = kept(self.config.ratio if ratio is None else ratio, n)
        first = torch.full((1,), self._first(key), dtype=torch.int64, device=flat.device)
        indices = self._indices(first, n, k).view(-1)
        values = self._values(flat.view(1, -1), indices.view(1, -1), n, k).view(-1)
        return (values,), RandomKContext(Meta.of(tensor), indices)

    def _first(self, key: Key) -> int:
        """The first counter of ``key``'s next draw (:mod:`gradcomp.compressors.counter`)."""
        return counter.counter(self.counters.start(key), self.counters.draw(key))

    def _indices(self, firsts: Tensor, n: int, k: int) -> Tensor:
        """(rows, k) int64: per row, one index per block of its n elements, drawn from the counters
        that follow the row's first (``firsts``): the same on every rank, and on every device."""
        starts, sizes = _blocks(n, k, firsts.device)
        uniform = counter.uniform_of(counter.mix(firsts[:, None] + counter.steps(k, firsts.device)[None, :]))
        return starts[None, :] + (uniform * sizes[None, :]).long()

    def _values(self, rows: Tensor, indices: Tensor, n: int, k: int) -> Tensor:
        """(rows, k): each row's values at its indices, scaled (``scale=true``), and every one NaN in a
        row that holds a non-finite value."""
        values = torch.gather(rows, 1, indices)
        if self.config.scale:
            values = values * _blocks(n, k, rows.device)[1].to(values.dtype)
            # An estimate past the dtype's range saturates rather than becoming Inf (finite inputs
            # give finite results); only such elements lose unbiasedness. k elements: cheap.
            limit = torch.finfo(values.dtype).max
            values.clamp_(-limit, limit)
        if n:
            # Dropped elements would hide a NaN/Inf from the optimizer; 0 * (max, min) is NaN iff
            # the input holds a non-finite value, and makes every sent value NaN then.
            low, high = torch.aminmax(rows, dim=1)  # one pass for both
            values.add_((high * 0).add_(low * 0)[:, None])
        return values

    largest_batched = 1 << 16
    """Tensors of up to this many elements go by size groups in a part (as top-k's); larger ones
    alone (stacking them would add a pass)."""

    first_written = True  # as decompress_sum writes the first rank's values

    def encode_group(
        self, rows: Tensor, group: SizeGroup, ratio: float | None, keys: Sequence[Any]
    ) -> tuple[Payload, GroupMeta]:
        """By size groups (:mod:`gradcomp.compressors.sizes`): every row's indices drawn at once from
        its tensor's counters, one payload for the size; bitwise each tensor's own."""
        n = group.numel
        k = kept(self.config.ratio if ratio is None else ratio, n)
        firsts = torch.tensor([self._first(key) for key in keys], dtype=torch.int64, device=rows.device)
        indices = self._indices(firsts, n, k)
        return (self._values(rows, indices, n, k),), GroupMeta(group, k, rows.dtype, indices)

    def decompress(self, payload: Payload, ctx: RandomKContext, out: Tensor | None = None) -> Tensor:
        (values,) = payload
        result = flat_out(out, ctx.meta, values.device).zero_()
        result[ctx.indices] = values.to(result.dtype)
        return result.view(ctx.meta.shape)

    def sent_indices(self, payload: Payload, ctx: RandomKContext) -> Tensor:
        return ctx.indices

    def subtract_contribution(self, payload: Payload, ctx: RandomKContext, tensor: Tensor) -> bool:
        # The contribution is zero off the k indices (unique: one per block): k reads and writes.
        (values,) = payload
        flat = tensor.view(-1)
        flat[ctx.indices] = flat[ctx.indices] - values.to(flat.dtype)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"counters": self.counters.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.load_state_dict(state.get("counters", state.get("shared", {})))  # "shared": generator states


@functools.lru_cache(maxsize=256)
def _blocks(n: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The first element of each of the k blocks of n elements, and their sizes (floor or ceil(n / k))."""
    bounds = torch.arange(k + 1, device=device, dtype=torch.int64) * n // max(k, 1)
    return bounds[:-1], bounds.diff()
