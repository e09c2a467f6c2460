"""A part of a bucket as rows of chunks: what lets a chunked compressor take every tensor at once.

The chunked compressors (the quantizers, sign, fp8) send a scale per chunk of ``chunk`` consecutive
elements of a tensor, and a chunk never crosses a tensor's end: each tensor's last chunk may be
short. :class:`ChunkRows` lays a part's tensors out as one matrix of ``chunk`` columns: first every
tensor's full chunks, one row each, then every tensor's tail chunk, padded to a whole row. Every
per-chunk statistic and map is then a row operation on one matrix, the same kernels whatever the
number of tensors, and the tensors' own chunks and scales are kept (a pad never changes a row's
statistic: padding is zeros, or the row's first element where a minimum or maximum is taken).

Moving a part in and out of the layout is a few operators for the whole part: the full chunks in one
``torch.cat``, the tails in one ``torch._foreach_copy_`` (one launch on a GPU), and back the same
way; codes leave the layout compacted (:meth:`ChunkRows.compact`: the pads never travel) and come
back expanded. Cost: one extra pass each way over the part (the copy into the layout and back).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gradcomp.compressors.segments import Segments

Pad = Literal["zero", "first"]
"""What fills a tail row past its tensor's end: zeros (for sums, norms and maxima of |x|), or the
row's first element (for minima and maxima)."""


@dataclasses.dataclass(frozen=True)
class ChunkRows:
    """The rows of ``chunk`` elements a part's tensors make (the module's notes)."""

    chunk: int
    full: tuple[tuple[int, int], ...]
    """Per tensor with full chunks: its offset in the part's buffer and how many."""
    tails: tuple[tuple[int, int], ...]
    """Per tensor with a short last chunk: that chunk's offset and length."""
    owners: tuple[int, ...] = ()
    """Per row, the index of its tensor in the segments."""

    @classmethod
    @functools.lru_cache(maxsize=256)
    def of(cls, segments: Segments, chunk: int) -> ChunkRows:
        """The layout of ``segments`` (kept per layout: parts repeat at every step)."""
        full, tails, full_owners, tail_owners = [], [], [], []
        for index, (offset, shape) in enumerate(zip(segments.offsets, segments.shapes, strict=True)):
            count, rest = divmod(math.prod(shape), chunk)
            if count:
                full.append((offset, count))
                full_owners += [index] * count
            if rest:
                tails.append((offset + count * chunk, rest))
                tail_owners.append(index)
        return cls(chunk, tuple(full), tuple(tails), tuple(full_owners + tail_owners))

    @functools.cached_property
    def full_rows(self) -> int:
        return sum(count for _, count in self.full)

    @property
    def rows(self) -> int:
        """Rows of the layout: every chunk of every tensor."""
        return self.full_rows + len(self.tails)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, chunk): the layout's matrix."""
        return (self.rows, self.chunk)

    @functools.cached_property
    def numel(self) -> int:
        """Elements of the tensors (the pads left out)."""
        return self.full_rows * self.chunk + sum(length for _, length in self.tails)

    def lengths(self, device: torch.device) -> Tensor:
        """Each row's number of elements (float64): ``chunk``, or its tail's length."""
        return self._lengths(torch.device(device))

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a few devices per layout, kept with it
    def _lengths(self, device: torch.device) -> Tensor:
        tails = [length for _, length in self.tails]
        return torch.tensor([float(self.chunk)] * self.full_rows + tails, dtype=torch.float64, device=device)

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def tail_pads(self, device: torch.device) -> Tensor:
        """(tail rows, chunk) bools: True at the pads, past each tail's end (full rows have none)."""
        lengths = torch.tensor([length for _, length in self.tails], dtype=torch.int64, device=device)
        return torch.arange(self.chunk, device=device) >= lengths[:, None]

    def zero_pads(self, rows: Tensor) -> Tensor:
        """``rows`` with its pads set to zero, in place (a pass over the tail rows alone)."""
        if self.tails:
            rows[self.full_rows :].masked_fill_(self.tail_pads(rows.device), 0)
        return rows

    def chunk_numbers(self, offsets: Sequence[int]) -> list[int]:
        """Per row, which chunk of its tensor it holds (0 for a tensor's first), the tensors starting
        at ``offsets`` (the segments' own)."""
        full = [number for _, count in self.full for number in range(count)]
        owners = self.owners[self.full_rows :]
        return full + [(o - offsets[i]) // self.chunk for (o, _), i in zip(self.tails, owners, strict=True)]

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def row_owners(self, device: torch.device) -> Tensor:
        """Per row, the index of its tensor (int64): what per-tensor decisions are spread by."""
        return torch.tensor(self.owners, dtype=torch.int64, device=device)

    def repad_first(self, rows: Tensor) -> None:
        """The tail rows' pads set to each row's first element again (after an element-wise change
        of the layout: a minimum or maximum taken over the row must not see the old pads)."""
        if self.tails:
            tails = rows[self.full_rows :]
            first = tails[:, :1].clone()  # the where writes over its own row
            torch.where(self.tail_pads(rows.device), first, tails, out=tails)

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def _firsts(self, device: torch.device) -> Tensor:
        """For every element of the tail rows, the offset of its row's first element in the buffer."""
        offsets = torch.tensor([offset for offset, _ in self.tails], dtype=torch.int64, device=device)
        return offsets.repeat_interleave(self.chunk)

    def gather(self, buffer: Tensor, out: Tensor, pad: Pad = "zero") -> Tensor:
        """The part's tensors (in the flat ``buffer``) into the layout ``out`` ((rows, chunk),
        contiguous): the tail rows filled as ``pad`` says, then every tensor's chunks copied in one
        foreach copy (one launch on a GPU)."""
        tails = out[self.full_rows :]
        if self.tails and pad == "zero":
            tails.zero_()
        elif self.tails:
            torch.index_select(buffer, 0, self._firsts(out.device), out=tails.view(-1))
        torch._foreach_copy_(*self._pairs(out, buffer))
        return out

    def scatter(self, rows: Tensor, buffer: Tensor) -> None:
        """The layout ``rows`` back into the tensors' places in the flat ``buffer`` (cast to its dtype)."""
        places, homes = self._pairs(rows, buffer)
        torch._foreach_copy_(homes, places)

    def _pairs(self, rows: Tensor, buffer: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """(each tensor's chunks in the layout, the same in the buffer), full chunks then tails."""
        chunk, starts = self.chunk, _starts([n for _, n in self.full])
        places = [rows[s : s + n].view(-1) for s, (_, n) in zip(starts, self.full, strict=True)]
        places += [rows[self.full_rows + i, :n] for i, (_, n) in enumerate(self.tails)]
        homes = [buffer[o : o + n * chunk] for o, n in self.full] + [buffer[o : o + n] for o, n in self.tails]
        return places, homes

    def compact(self, rows: Tensor) -> Tensor:
        """The layout's elements without the pads, in layout order (what travels), as a new tensor."""
        pieces = [rows[: self.full_rows].view(-1)]
        pieces += [rows[self.full_rows + i, :n] for i, (_, n) in enumerate(self.tails)]
        return torch.cat(pieces)

    def expand(self, flat: Tensor, out: Tensor) -> Tensor:
        """:meth:`compact`'s inverse into the layout ``out`` in one foreach copy; the pads are left as
        they were."""
        body = self.full_rows * self.chunk
        places = [out[: self.full_rows].view(-1)] + [out[self.full_rows + i, :n] for i, (_, n) in enumerate(self.tails)]
        starts = _starts([n for _, n in self.tails], body)
        sources = [flat[:body]] + [flat[s : s + n] for s, (_, n) in zip(starts, self.tails, strict=True)]
        torch._foreach_copy_(places, sources)
        return out


def _starts(sizes: list[int], first: int = 0) -> list[int]:
    starts, at = [], first
    for size in sizes:
        starts.append(at)
        at += size
    return starts


class PartBuffers:
    """Buffers kept per part (its keys) and name, for what one thread fills and
    another reads (a measured part: measured on backward's thread, compressed on the executor's),
    where a thread's :class:`~gradcomp.workspace.Workspace` would not do. Memory: one buffer per
    name and part, for the holder's life."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, tuple[Any, ...]], Tensor] = {}

    def take(self, name: str, keys: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> Tensor:  # fmt: skip
        """The buffer of ``name`` and ``shape`` for the part of ``keys`` (uninitialised when new)."""
        held = self._held.get((name, keys))
        if held is None or held.shape != shape or held.dtype != dtype or held.device != torch.device(device):
            held = self._held[(name, keys)] = torch.empty(shape, dtype=dtype, device=device)
        return held

    def put(self, name: str, keys: tuple[Any, ...], buffer: Tensor) -> None:
        """``buffer`` becomes the one of ``name`` for the part of ``keys`` (two buffers swapping roles)."""
        self._held[(name, keys)] = buffer


@dataclasses.dataclass(frozen=True)
class RowsMeta:
    """The context of a part compressed by rows: its layout and the gradients' dtype."""

    layout: ChunkRows
    dtype: torch.dtype


class ByRows:
    """Part-level compression for a chunked compressor (``Compressor.compress_part`` and the methods
    beside it): the part's tensors in one :class:`ChunkRows` layout, compressed as one tensor of
    whole chunks (the same kernels whatever the number of tensors), one payload for the part.

    A compressor mixes it in before :class:`~gradcomp.compressors.base.Compressor` and provides
    ``chunk``, ``workspace``, :meth:`encode_rows` and :meth:`decode_rows`; ``pad`` says what fills
    the tail rows. Classic error feedback follows it by rows (:mod:`gradcomp.compressors.feedback.rows`).

    A part's codes are the tensors' own (:attr:`by_rows`: the compressor declares it). Stochastic
    rounding keeps drawing each tensor's noise from the tensor's own random stream (two operators
    per tensor), so that what a tensor sends does not depend on which part of which bucket DDP puts
    it in (rule "state per tensor"); the rest of the part runs by rows."""

    pad: Pad = "zero"

    @property
    def by_rows(self) -> bool:
        """Whether a part is compressed by rows (else tensor by tensor, as ``Compressor`` does): what
        the compressor declares (``Capabilities.whole_part``)."""
        return bool(self.capabilities.whole_part)  # type: ignore[attr-defined]

    def encode_rows(self, rows: Tensor, layout: ChunkRows, segments: Segments) -> tuple[Tensor, ...]:
        """The payload of the layout ``rows`` ((rows, chunk), divided already) of ``segments``."""
        raise NotImplementedError

    def decode_rows(self, payload: tuple[Tensor, ...], layout: ChunkRows, out: Tensor) -> None:
        """Decode ``payload`` into the layout ``out`` ((rows, chunk); the pads' values are anything)."""
        raise NotImplementedError

    def sent_in_rows(self, payload: tuple[Tensor, ...]) -> Tensor | None:
        """Where a sparse payload was taken from (flat int64 indices of the rows: DGC's momentum
        masking clears them); None for a dense one."""
        return None

    def compress_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[tuple[tuple[Tensor, ...], Any]]:
        if not self.by_rows:
            return super().compress_part(buffer, segments, divisor, ratio=ratio)  # type: ignore[misc]
        layout = ChunkRows.of(segments, self.chunk)  # type: ignore[attr-defined]
        rows = self._take("rows", layout, buffer.dtype, buffer.device)
        layout.gather(buffer, rows, self.pad).div_(divisor)
        return [(self.encode_rows(rows, layout, segments), RowsMeta(layout, buffer.dtype))]

    def decompress_part(self, payloads: Sequence[tuple[Tensor, ...]], contexts: Sequence[Any], buffer: Tensor,
                        segments: Segments) -> None:  # fmt: skip
        if not isinstance(contexts[0], RowsMeta):  # compressed tensor by tensor
            super().decompress_part(payloads, contexts, buffer, segments)  # type: ignore[misc]
            return
        ((payload,), (meta,)) = (payloads, contexts)
        decoded = self._take("rows.decoded", meta.layout, buffer.dtype, buffer.device)
        self.decode_rows(payload, meta.layout, decoded)
        meta.layout.scatter(decoded, buffer)

    def decompress_sum_part(self, gathered: Sequence[Sequence[tuple[Tensor, ...]]], contexts: Sequence[Any],
                            buffer: Tensor, segments: Segments) -> None:  # fmt: skip
        """Every rank's payload decoded and summed in rank order, as ``decompress_sum`` sums a
        tensor's: in the gradients' dtype, or for half precision each decoded into it and summed
        in float32, rounded once."""
        if not isinstance(contexts[0], RowsMeta):  # compressed tensor by tensor
            super().decompress_sum_part(gathered, contexts, buffer, segments)  # type: ignore[misc]
            return
        ((everyone,), (meta,)) = (gathered, contexts)
        layout, dtype = meta.layout, buffer.dtype
        half = dtype in (torch.float16, torch.bfloat16)
        total = self._take("rows.total", layout, torch.float32 if half else dtype, buffer.device)
        decoded = self._take("rows.decoded", layout, dtype, buffer.device)
        for rank, payload in enumerate(everyone):
            if rank == 0 and not half:
                self.decode_rows(payload, layout, total)
                continue
            self.decode_rows(payload, layout, decoded)
            if rank == 0:
                total.copy_(decoded)
            else:
                total.add_(decoded)
        layout.scatter(total, buffer)

    def _take(self, name: str, layout: ChunkRows, dtype: torch.dtype, device: torch.device) -> Tensor:
        workspace = self.workspace  # type: ignore[attr-defined]
        return workspace.take(name, layout.rows * layout.chunk, dtype, device).view(layout.rows, layout.chunk)
