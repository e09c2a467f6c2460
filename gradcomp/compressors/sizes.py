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

from gradcomp.compressors.base import Measured, Payload
from gradcomp.compressors.capabilities import ratio_option
from gradcomp.compressors.rows import PartBuffers
from gradcomp.compressors.segments import Segments


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
    """The context of a size group's payload: the group, its k, the gradients' dtype, and the
    indices (tensors, k) where they do not travel (random-k's: the same on every rank)."""

    group: SizeGroup
    k: int
    dtype: torch.dtype
    indices: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class AloneMeta:
    """The context of a tensor compressed alone in a part: its segment index and its own context."""

    index: int
    inner: Any


class BySize:
    """Part-level compression for a compressor whose selection is per tensor (``Compressor.compress_part``
    and the methods beside it), by size groups (the module's notes). A compressor mixes it in before
    its base class and provides :attr:`largest_batched` and :meth:`encode_group`; classic error
    feedback follows it (:mod:`gradcomp.compressors.feedback.sizes`)."""

    first_written: bool = False
    """Whether its ``decompress_sum`` writes the first rank's values (a -0.0 stays) rather than
    adding them to zeros (:meth:`sum_group` does the same)."""

    largest_batched: int
    """The largest tensors that go in size groups (0: none, every tensor alone)."""

    def size_groups(self, segments: Segments) -> SizeGroups:
        return SizeGroups.of(segments, self.largest_batched)

    def stacked(self, buffer: Tensor, group: SizeGroup, name: str) -> Tensor:
        """The group's tensors as the rows of a workspace matrix (one stacking copy)."""
        workspace = self.workspace  # type: ignore[attr-defined]
        rows = workspace.take(name, len(group.members) * group.numel, buffer.dtype, buffer.device)
        return torch.stack(group.rows(buffer), out=rows.view(len(group.members), group.numel))

    def encode_group(
        self, rows: Tensor, group: SizeGroup, ratio: float | None, keys: Sequence[Any]
    ) -> tuple[Payload, GroupMeta]:
        """The payload of the stacked ``rows`` of ``group`` (divided already; its tensors' ``keys``)
        and its context: each row's payload, bitwise what its tensor's alone would be."""
        raise NotImplementedError

    def measure_group(self, rows: Tensor, group: SizeGroup, ratio: float | None) -> Measured:
        """For a compressor whose payloads are measured (``Capabilities.measures``): the record of
        the stacked ``rows`` of ``group`` (divided already, kept until compressed), ``rows`` set."""
        raise NotImplementedError

    def compress_measured_group(
        self, measured: Measured, group: SizeGroup, keys: Sequence[Any]
    ) -> tuple[Payload, GroupMeta]:
        """:meth:`encode_group` of what :meth:`measure_group` recorded."""
        raise NotImplementedError

    @functools.cached_property
    def measured_rows(self) -> PartBuffers:
        """A part's stacked rows between :meth:`measure_part` (backward's thread) and
        :meth:`compress_measured_part` (the executor's), where a thread's workspace would not do."""
        return PartBuffers()

    def held_rows(self, buffer: Tensor, group: SizeGroup, segments: Segments, name: str) -> Tensor:
        """The group's tensors stacked as rows into a buffer kept per part (:attr:`measured_rows`)."""
        shape = (len(group.members), group.numel)
        rows = self.measured_rows.take(f"{name}.{group.numel}", segments.keys, shape, buffer.dtype, buffer.device)
        return torch.stack(group.rows(buffer), out=rows)

    def measure_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[Measured]:
        """One record per size group (its rows: :meth:`measure_group`), then one per tensor alone."""
        groups = self.size_groups(segments)
        records = [self.measure_group(self.held_rows(buffer, group, segments, "groups.measured").div_(divisor),
                                      group, ratio) for group in groups.groups]  # fmt: skip
        views, options = segments.views(buffer), ratio_option(ratio)
        measure = self.measure_divided  # type: ignore[attr-defined]
        return records + [measure(views[i], divisor, segments.keys[i], **options) for i in groups.alone]

    def compress_measured_part(
        self, measured: Sequence[Measured], counts: Sequence[int], segments: Segments
    ) -> list[tuple[Payload, Any]]:
        groups = self.size_groups(segments)
        grouped = len(groups.groups)
        states: list[tuple[Payload, Any]] = [
            self.compress_measured_group(record, group, [segments.keys[i] for i in group.members])
            for record, group in zip(measured[:grouped], groups.groups, strict=True)
        ]
        compress = self.compress_measured  # type: ignore[attr-defined]
        for record, count, index in zip(measured[grouped:], counts[grouped:], groups.alone, strict=True):
            payload, ctx = compress(record, count, segments.keys[index])
            states.append((payload, AloneMeta(index, ctx)))
        return states

    def sent_rows(self, payload: Payload, ctx: GroupMeta) -> Tensor:
        """int64 (tensors, k): where each row's values go."""
        return ctx.indices if ctx.indices is not None else payload[1].long()

    def compress_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[tuple[Payload, Any]]:
        groups = self.size_groups(segments)
        states: list[tuple[Payload, Any]] = []
        for group in groups.groups:
            rows = self.stacked(buffer, group, "groups.rows").div_(divisor)
            states.append(self.encode_group(rows, group, ratio, [segments.keys[i] for i in group.members]))
        views, options = segments.views(buffer), ratio_option(ratio)
        for index in groups.alone:
            payload, ctx = self.compress_divided(views[index], divisor, segments.keys[index], **options)  # type: ignore[attr-defined]
            states.append((payload, AloneMeta(index, ctx)))
        return states

    def decompress_part(self, payloads: Sequence[Payload], contexts: Sequence[Any], buffer: Tensor,
                        segments: Segments) -> None:  # fmt: skip
        if contexts and not isinstance(contexts[0], (GroupMeta, AloneMeta)):  # compressed tensor by tensor
            super().decompress_part(payloads, contexts, buffer, segments)  # type: ignore[misc]
            return
        decompress = self.decompress  # type: ignore[attr-defined]
        decode_parts(payloads, contexts, buffer, segments, self, decompress)

    def decompress_sum_part(self, gathered: Sequence[Sequence[Payload]], contexts: Sequence[Any], buffer: Tensor,
                            segments: Segments) -> None:  # fmt: skip
        if contexts and not isinstance(contexts[0], (GroupMeta, AloneMeta)):  # compressed tensor by tensor
            super().decompress_sum_part(gathered, contexts, buffer, segments)  # type: ignore[misc]
            return
        sum_into(gathered, contexts, buffer, segments, self, self.decompress_sum)  # type: ignore[attr-defined]

    def sum_group(self, everyone: Sequence[Payload], ctx: GroupMeta, buffer: Tensor, write_first: bool) -> None:
        """Every rank's payload of a group added into zero rows, rank by rank (indices are unique
        within a rank's row: each element adds what ``decompress_sum`` adds, in float32 for half
        precision; ``write_first``: the first rank's values written, as ``decompress`` writes them),
        then the rows back in place in one foreach copy."""
        group = ctx.group
        half = buffer.dtype in (torch.float16, torch.bfloat16)
        workspace = self.workspace  # type: ignore[attr-defined]
        total = workspace.take("groups.total", len(group.members) * group.numel,
                               torch.float32 if half else buffer.dtype, buffer.device)  # fmt: skip
        total = total.view(len(group.members), group.numel).zero_()
        for rank, payload in enumerate(everyone):
            add = total.scatter_ if rank == 0 and write_first else total.scatter_add_
            add(1, self.sent_rows(payload, ctx), payload[0].to(total.dtype))
        torch._foreach_copy_(group.rows(buffer), list(total.unbind(0)))


def sum_into(gathered: Sequence[Sequence[Payload]], contexts: Sequence[Any], buffer: Tensor, segments: Segments,
             grouped: BySize, alone: Callable[..., Tensor]) -> None:  # fmt: skip
    """Every rank's payloads of a part compressed by size groups, summed into ``buffer``: a group
    by ``grouped`` (:meth:`BySize.sum_group`), a tensor alone by ``alone`` (a ``decompress_sum``)."""
    views = segments.views(buffer)
    for everyone, ctx in zip(gathered, contexts, strict=True):
        if isinstance(ctx, AloneMeta):
            alone(everyone, ctx.inner, out=views[ctx.index])
        else:
            grouped.sum_group(everyone, ctx, buffer, grouped.first_written)


def decode_parts(payloads: Sequence[Payload], contexts: Sequence[Any], buffer: Tensor, segments: Segments,
                 grouped: BySize, alone: Callable[..., Tensor]) -> None:  # fmt: skip
    """One payload per group or tensor (an aggregate, or this rank's) decoded into ``buffer``, as
    ``decompress`` decodes a tensor's: a group by ``grouped``, a tensor alone by ``alone``."""
    views = segments.views(buffer)
    for payload, ctx in zip(payloads, contexts, strict=True):
        if isinstance(ctx, AloneMeta):
            alone(payload, ctx.inner, out=views[ctx.index])
        else:
            grouped.sum_group([payload], ctx, buffer, write_first=True)
