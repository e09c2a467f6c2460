"""A part's tensors batched by size: what lets a sparsifier select each tensor's own k for a whole
part in operators that grow with the part's distinct sizes, not with its tensors.

Top-k keeps the k largest |x| of each tensor, k = ceil(ratio * n): tensors of the same size n keep
the same k, so stacked as the rows of one (tensors, n) matrix they are selected by one
``torch.topk(dim=1)``, gathered by one ``gather``, decoded by one ``scatter`` and summed over ranks by
one ``scatter_add_`` per rank, whatever their number. A GPT-shaped model's 150 tensors come in about
ten sizes (its biases and norms share a few), so a bucket costs operators per size. The tensors that
a compressor would rather treat alone (top-k's large ones: a sampled threshold beats a full
selection there) go one by one, as the base class does.

Each tensor's selection, payload values and decoded result are its own (the same ``torch.topk`` over
its row), bitwise what it gives alone; the payload of a size is one (values, indices) pair of shape
(tensors, k), indices within the tensor in the smallest type that holds n, as a tensor's alone.
Cost: the stacking copy of the part's small tensors each way (one pass over them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Payload
from gradcomp.compressors.capabilities import ratio_option
from gradcomp.compressors.segments import Segments
from gradcomp.compressors.sparse import index_dtype
from gradcomp.workspace import Workspace


@dataclasses.dataclass(frozen=True)
class SizeGroup:
    """The tensors of a part with ``numel`` elements: where each lies (segment indices, offsets)."""

    numel: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]

    def rows(self, buffer: Tensor) -> list[Tensor]:
        """Each member as a flat view of ``buffer``."""
        return [buffer[offset : offset + self.numel] for offset in self.offsets]


@dataclasses.dataclass(frozen=True)
class SizeGroups:
    """A part's tensors: those batched, by size (in order of first appearance), and those alone."""

    groups: tuple[SizeGroup, ...]
    alone: tuple[int, ...]
    """Segment indices of the tensors compressed one by one."""

    @classmethod
    @functools.lru_cache(maxsize=256)
    def of(cls, segments: Segments, largest: int) -> SizeGroups:
        """The groups of ``segments``, tensors of at most ``largest`` elements batched (kept per part)."""
        members: dict[int, list[int]] = {}
        alone = []
        for index, shape in enumerate(segments.shapes):
            numel = math.prod(shape)
            if numel <= largest:
                members.setdefault(numel, []).append(index)
            else:
                alone.append(index)
        offsets = segments.offsets
        groups = tuple(SizeGroup(n, tuple(found), tuple(offsets[i] for i in found)) for n, found in members.items())
        return cls(groups, tuple(alone))


@dataclasses.dataclass(frozen=True)
class GroupMeta:
    """The context of a size group's payload: the group, its k, and the gradients' dtype."""

    group: SizeGroup
    k: int
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class AloneMeta:
    """The context of a tensor compressed alone in a part: its segment index and its own context."""

    index: int
    inner: Any


class BySize:
    """Part-level compression for a sparsifier whose selection is per tensor (``Compressor.compress_part``
    and the methods beside it), by size groups (the module's notes). A compressor mixes it in before
    :class:`~gradcomp.compressors.sparse.SparseCompressor` and provides :attr:`largest_batched`,
    :meth:`kept_of` and :meth:`select_rows`; classic error feedback follows it
    (:mod:`gradcomp.compressors.feedback.sizes`)."""

    @property
    def largest_batched(self) -> int:
        """The largest tensors that go in size groups (0: none, every tensor alone)."""
        raise NotImplementedError

    def kept_of(self, numel: int, ratio: float | None) -> int:
        """k of a tensor of ``numel`` elements at ``ratio`` (a warm-up's) or the configuration's."""
        raise NotImplementedError

    def select_rows(self, rows: Tensor, k: int) -> Tensor:
        """int64 indices (tensors, k) of each row's selection: what each tensor selects alone."""
        raise NotImplementedError

    def size_groups(self, segments: Segments) -> SizeGroups:
        return SizeGroups.of(segments, self.largest_batched)

    def stacked(self, buffer: Tensor, group: SizeGroup, name: str) -> Tensor:
        """The group's tensors as the rows of a workspace matrix (one stacking copy)."""
        workspace = self.workspace  # type: ignore[attr-defined]
        rows = workspace.take(name, len(group.members) * group.numel, buffer.dtype, buffer.device)
        return torch.stack(group.rows(buffer), out=rows.view(len(group.members), group.numel))

    def encode_group(self, rows: Tensor, group: SizeGroup, ratio: float | None) -> tuple[Payload, GroupMeta]:
        """The payload of the stacked ``rows`` of ``group`` (divided already) and its context."""
        k = self.kept_of(group.numel, ratio)
        indices = self.select_rows(rows, k)
        payload = (torch.gather(rows, 1, indices), indices.to(index_dtype(group.numel)))
        return payload, GroupMeta(group, k, rows.dtype)

    def compress_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[tuple[Payload, Any]]:
        groups = self.size_groups(segments)
        states: list[tuple[Payload, Any]] = []
        for group in groups.groups:
            rows = self.stacked(buffer, group, "groups.rows").div_(divisor)
            states.append(self.encode_group(rows, group, ratio))
        views, options = segments.views(buffer), ratio_option(ratio)
        for index in groups.alone:
            payload, ctx = self.compress_divided(views[index], divisor, segments.keys[index], **options)  # type: ignore[attr-defined]
            states.append((payload, AloneMeta(index, ctx)))
        return states

    def decompress_part(self, payloads: Sequence[Payload], contexts: Sequence[Any], buffer: Tensor,
                        segments: Segments) -> None:  # fmt: skip
        self.decompress_sum_part([[p] for p in payloads], contexts, buffer, segments)

    def decompress_sum_part(self, gathered: Sequence[Sequence[Payload]], contexts: Sequence[Any], buffer: Tensor,
                            segments: Segments) -> None:  # fmt: skip
        sum_into(gathered, contexts, buffer, segments, self.workspace, self.decompress_sum)  # type: ignore[attr-defined]


def sum_into(gathered: Sequence[Sequence[Payload]], contexts: Sequence[Any], buffer: Tensor, segments: Segments,
             workspace: Workspace, alone: Callable[..., Tensor]) -> None:  # fmt: skip
    """Every rank's payloads of a part compressed by size groups, summed into ``buffer``: per group,
    into zeros one ``scatter_add_`` per rank in rank order (indices are unique within a rank's row:
    each element adds what ``decompress_sum`` adds, in float32 for half precision), the rows back in
    place in one foreach copy; a tensor alone by ``alone`` (a ``decompress_sum``)."""
    views = segments.views(buffer)
    half = buffer.dtype in (torch.float16, torch.bfloat16)
    for everyone, ctx in zip(gathered, contexts, strict=True):
        if isinstance(ctx, AloneMeta):
            alone(everyone, ctx.inner, out=views[ctx.index])
            continue
        group = ctx.group
        total = workspace.take("groups.total", len(group.members) * group.numel,
                               torch.float32 if half else buffer.dtype, buffer.device)  # fmt: skip
        total = total.view(len(group.members), group.numel).zero_()
        for values, indices in everyone:
            total.scatter_add_(1, indices.long(), values.to(total.dtype))
        torch._foreach_copy_(group.rows(buffer), list(total.unbind(0)))
