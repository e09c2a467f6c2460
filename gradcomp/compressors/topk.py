"""``topk``: send the k = ceil(ratio * n) largest-magnitude elements, exactly or by a sampled threshold."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.base import Capabilities, CompressorConfig, Key, Measured, Meta, Payload, check_gradient
from gradcomp.compressors.randomness import Generators, rank_seed
from gradcomp.compressors.registry import register
from gradcomp.compressors.sizes import BySize, GroupMeta, SizeGroup
from gradcomp.compressors.sparse import SparseCompressor, index_dtype, kept, ratio_error

Method = Literal["exact", "sampled"]

SAMPLE_HITS = 1024
"""Expected number of sampled elements above the k-th largest: sets the sample size to
SAMPLE_HITS * n / k, and the threshold's relative error to about 1 / sqrt(SAMPLE_HITS) = 3%."""
EXACT_MARGIN = 4.0
"""The exact method lowers the sampled threshold by this many standard deviations, so that at least
k candidates pass it except with probability ~3e-5 (then it falls back to a full ``torch.topk``)."""
SMALL = 1 << 16
"""Below this many elements a plain ``torch.topk`` is as fast as sampling."""


@dataclasses.dataclass(frozen=True)
class TopKConfig(CompressorConfig):
    ratio: float = 0.01
    """Fraction of elements sent, in (0, 1]."""
    method: Method = "exact"
    """``exact``: exactly the k largest |x|. ``sampled``: a threshold estimated from a random sample
    (DGC); sends between (1 - tolerance) * k and k elements."""
    tolerance: float = 0.2
    """``sampled`` only: the fewest elements it may send is (1 - tolerance) * k; below that it falls
    back to the exact selection."""

    def __post_init__(self) -> None:
        problem = ratio_error(self.ratio)
        if problem:
            raise ValueError(problem)
        if self.method not in ("exact", "sampled"):
            raise ValueError(f"method must be 'exact' or 'sampled', got {self.method!r}")
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")


@register
class TopK(BySize, SparseCompressor):
    """Top-k sparsification (Aji & Heafield 2017; Lin et al., DGC, ICLR 2018).

    Both methods first estimate the k-th largest |x| from a random sample of SAMPLE_HITS * n / k
    elements, keep the elements above it (one compare and one ``nonzero`` pass), and cut the
    candidates down to k with a small ``torch.topk``. ``exact`` sets the threshold a few standard
    deviations low so that the candidates contain the true top k, and falls back to ``torch.topk``
    over everything in the rare case they do not; ``sampled`` uses the estimate as it is and may
    send fewer than k. Either is several times faster than ``torch.topk`` on large tensors on the
    CPU. Counting the candidates is a host read: on an accelerator ``exact`` is ``torch.topk`` (a
    radix select there, no read), and ``sampled`` counts them on the device for the engine, which
    reads every tensor's count of a bucket at once (``Compressor.measure``).

    Wire: k * (value bytes + index bytes), indices in the smallest integer type that fits n
    (``sampled``: up to k). NaN elements always count as the largest. Biased: use with error
    feedback, without which the dropped coordinates never reach the model.
    When: the strongest compression (50x at ratio 0.01 with int32 indices) on slow links, with ``ef=true``.
    """

    name = "topk"
    Config = TopKConfig
    config: TopKConfig

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        assert isinstance(config, TopKConfig)
        exact = config.method == "exact"  # k values and indices; sampled keeps what passes its threshold
        return dataclasses.replace(
            super().declare(config),
            same_shapes=exact,
            measures=not exact,
            ratio=config.ratio,
            dense_from=0.5,  # k values and k 4-byte indices: 2 k * 4 bytes against 4 n
        )

    def __init__(self, config: CompressorConfig | None = None, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(config, seed=seed, rank=rank)
        self.sampler = Generators(rank_seed(seed, rank))
        # a part's tensors of up to SMALL elements go by size groups: either method selects them by
        # a plain torch.topk alone (no sample: :meth:`_threshold`), a row of one there
        self.largest_batched = SMALL

    def compress(
        self,
        tensor: Tensor,
        key: Key = None,
        shapes: Sequence[torch.Size] | None = None,
        *,
        ratio: float | None = None,
    ) -> tuple[Payload, Meta]:
        """``ratio``: the fraction kept this time (a warm-up's), instead of the config's."""
        flat = check_gradient(tensor)
        magnitudes = self._magnitudes(flat)
        indices = self.select(magnitudes, kept(self.config.ratio if ratio is None else ratio, flat.numel()), key)
        return self.sparse_payload(flat, indices), Meta.of(tensor)

    def encode_group(
        self, rows: Tensor, group: SizeGroup, ratio: float | None, keys: Sequence[Any]
    ) -> tuple[Payload, GroupMeta]:
        """Each row's k largest |x| (a plain ``torch.topk`` alone, a row of one here): values and
        indices, (tensors, k), indices in the type a tensor alone sends."""
        return self._group_payload(rows, group, kept(self.config.ratio if ratio is None else ratio, group.numel))

    def measure_group(self, rows: Tensor, group: SizeGroup, ratio: float | None) -> Measured:
        """A group's k is its count (no sample below SMALL elements: exactly k travel)."""
        k = kept(self.config.ratio if ratio is None else ratio, group.numel)
        return Measured(_count(k, rows.device), rows, k, rows=len(group.members))

    def compress_measured_group(
        self, measured: Measured, group: SizeGroup, keys: Sequence[Any]
    ) -> tuple[Payload, GroupMeta]:
        return self._group_payload(measured.tensor, group, measured.k)

    def _group_payload(self, rows: Tensor, group: SizeGroup, k: int) -> tuple[Payload, GroupMeta]:
        if k == group.numel:  # everything, in order, as a tensor alone sends it
            indices = torch.arange(k, device=rows.device).expand(rows.shape[0], k)
        else:
            magnitudes = self.workspace.take("abs.rows", rows.numel(), rows.dtype, rows.device).view(rows.shape)
            indices = torch.topk(torch.abs(rows, out=magnitudes), k, dim=1, sorted=False).indices
        payload = (torch.gather(rows, 1, indices), indices.to(index_dtype(group.numel)))
        return payload, GroupMeta(group, k, rows.dtype)

    def select(self, magnitudes: Tensor, k: int, key: Key = None) -> Tensor:
        """int64 indices of (about, for ``sampled``) the k largest ``magnitudes``."""
        if self.config.method == "exact" and not host.reads_are_free(magnitudes.device):
            # The prefilter's candidates are counted on the host: on an accelerator that is a
            # synchronization, where torch.topk (a radix select there) reads nothing.
            return self._largest(magnitudes, k)
        threshold = self._threshold(magnitudes, k, key)
        if threshold is None:
            return self._largest(magnitudes, k)
        candidates = host.nonzero(self._passing(magnitudes, threshold))
        return self._cut(magnitudes, candidates, k)

    def measure(self, tensor: Tensor, key: Key = None, *, ratio: float | None = None) -> Measured:
        """The candidates the sampled threshold passes, at ``ratio`` (a warm-up's) or the config's:
        the threshold and k travel in the record to :meth:`compress_measured`."""
        flat = check_gradient(tensor)
        magnitudes = self._magnitudes(flat)
        k = kept(self.config.ratio if ratio is None else ratio, flat.numel())
        threshold = self._threshold(magnitudes, k, key)
        if threshold is None:
            return Measured(torch.full((), k, dtype=torch.int64, device=flat.device), tensor, k)
        return Measured(self._passing(magnitudes, threshold).sum(), tensor, k, threshold)

    def compress_measured(
        self, measured: Measured, count: int, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        flat = check_gradient(measured.tensor)
        magnitudes = self._magnitudes(flat)
        threshold, k = measured.threshold, measured.k
        if threshold is None or count < self._fewest(k):
            indices = self._largest(magnitudes, k)
        else:
            candidates = torch.nonzero_static(self._passing(magnitudes, threshold), size=count).view(-1)
            indices = self._cut(magnitudes, candidates, k)
        return self.sparse_payload(flat, indices), Meta.of(measured.tensor)

    def payload_length(self, count: int, measured: Measured) -> int:
        k = measured.k
        return k if count < self._fewest(k) else min(count, k)

    def _magnitudes(self, flat: Tensor) -> Tensor:
        magnitudes = self.workspace.take("abs", flat.numel(), flat.dtype, flat.device)
        return torch.abs(flat, out=magnitudes)

    def _threshold(self, magnitudes: Tensor, k: int, key: Key) -> Tensor | None:
        """The k-th largest magnitude estimated from a random sample (lowered for ``exact``), as a
        0-d tensor; None where a plain ``torch.topk`` is as fast (small tensors, large ratios)."""
        n = magnitudes.numel()
        sample_size = math.ceil(SAMPLE_HITS * n / max(k, 1))
        if k == n or n <= SMALL or sample_size >= n // 2:
            return None
        generator = self.sampler.on(magnitudes.device, key)
        positions = torch.randint(0, n, (sample_size,), generator=generator, device=magnitudes.device)
        sample = magnitudes[positions]
        hits = k * sample_size / n
        if self.config.method == "exact":
            hits += EXACT_MARGIN * math.sqrt(hits)
        return torch.topk(sample, min(sample_size, math.ceil(hits)), sorted=False).values.min()

    def _passing(self, magnitudes: Tensor, threshold: Tensor) -> Tensor:
        """Where the threshold passes, as a workspace mask (valid until the next call)."""
        below = self.workspace.take("below", magnitudes.numel(), torch.bool, magnitudes.device)
        torch.lt(magnitudes, threshold, out=below)
        # "not below" rather than ">=": NaN compares false either way, and must be a candidate.
        return below.logical_not_()

    @staticmethod
    def _largest(magnitudes: Tensor, k: int) -> Tensor:
        """The k largest, by ``torch.topk`` (everything, in order, when k is every element)."""
        if k == magnitudes.numel():
            return torch.arange(k, device=magnitudes.device)
        return torch.topk(magnitudes, k, sorted=False).indices

    def _fewest(self, k: int) -> int:
        return k if self.config.method == "exact" else math.ceil((1 - self.config.tolerance) * k)

    def _cut(self, magnitudes: Tensor, candidates: Tensor, k: int) -> Tensor:
        """The k largest of the candidates, or everything's when fewer than the method allows passed."""
        if candidates.numel() < self._fewest(k):
            return self._largest(magnitudes, k)
        if candidates.numel() > k:
            candidates = candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
        return candidates

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


@functools.lru_cache(maxsize=64)
def _count(k: int, device: torch.device) -> Tensor:
    """``k`` as a 0-d int64 tensor on ``device``, made once (a record's count, read with the others)."""
    return torch.tensor(k, dtype=torch.int64, device=device)
