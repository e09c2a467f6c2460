"""``threshold``: send every element with |x| >= tau (a variable-size payload)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors.base import Capabilities, CompressorConfig, Key, Measured, Meta, Payload, check_gradient
from gradcomp.compressors.registry import register
from gradcomp.compressors.rows import ByRows, ChunkRows, PartBuffers, RowsMeta
from gradcomp.compressors.segments import Segments, end_to_end
from gradcomp.compressors.sparse import SparseCompressor

ROW = 256
"""Elements per row when a part is compressed at once: a tensor's last row is padded to it (at most
ROW - 1 zeros per tensor), and nothing else depends on it (the selection is element by element)."""


@dataclasses.dataclass(frozen=True)
class ThresholdConfig(CompressorConfig):
    tau: float = 1e-3
    """Magnitude at or above which an element is sent."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"tau must be a finite number >= 0, got {self.tau}")


@dataclasses.dataclass(frozen=True)
class SpanMeta:
    """The context of a part selected where it lies: its span of the buffer."""

    start: int
    stop: int


@register
class Threshold(ByRows, SparseCompressor):
    """Hard-threshold sparsification (Strom, Interspeech 2015): x_i travels if |x_i| >= tau.

    Wire: m * (value bytes + index bytes) for the m selected elements; m depends on the data and can
    be anything from 0 to n, so the engine gathers with variable sizes. NaN elements are always
    selected (so they reach every rank). Biased: use with error feedback, which lets the small
    elements accumulate until they cross tau.
    When: gradients whose scale is known and stable; otherwise prefer ``topk``, which fixes the size.

    A part of a bucket is selected at once (the selection is element by element, so each tensor's
    is its own): one compare, one ``nonzero``, one payload whose indices run over the part (int32
    for parts of up to 2**31 elements, where small tensors alone would send smaller index types),
    where it lies when its tensors lie end to end, else (and with error feedback, whose residuals
    are kept so) in rows of :data:`ROW` elements (:class:`~gradcomp.compressors.rows.ChunkRows`).
    """

    name = "threshold"
    Config = ThresholdConfig
    config: ThresholdConfig
    chunk = ROW

    @classmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        return dataclasses.replace(super().declare(config), measures=True, whole_part=True)  # as many as pass tau

    @functools.cached_property
    def measured_rows(self) -> PartBuffers:
        """A part's rows between :meth:`measure_part` (backward's thread) and
        :meth:`compress_measured_part` (the executor's), where a thread's workspace would not do."""
        return PartBuffers()

    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        flat = check_gradient(tensor)
        return self.sparse_payload(flat, host.nonzero(self._selected(flat))), Meta.of(tensor)

    def measure(self, tensor: Tensor, key: Key = None) -> Measured:
        return Measured(self._selected(check_gradient(tensor)).sum(), tensor)

    def compress_measured(
        self, measured: Measured, count: int, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Meta]:
        flat = check_gradient(measured.tensor)
        indices = torch.nonzero_static(self._selected(flat), size=count).view(-1)
        return self.sparse_payload(flat, indices), Meta.of(measured.tensor)

    # -- a part at once ---------------------------------------------------------------------------------

    def encode_rows(self, rows: Tensor, layout: ChunkRows, segments: Segments) -> tuple[Tensor, ...]:
        """Error feedback's part (its residuals are kept in rows: :mod:`.feedback.rows`)."""
        flat = rows.view(-1)
        return self.sparse_payload(flat, host.nonzero(self._selected_rows(rows, layout).view(-1)))

    def decode_rows(self, payload: tuple[Tensor, ...], layout: ChunkRows, out: Tensor) -> None:
        values, indices = payload
        out.zero_().view(-1)[indices.long()] = values.to(out.dtype)

    def sent_in_rows(self, payload: tuple[Tensor, ...]) -> Tensor:
        """Where the part's payload was taken from, as flat int64 indices of its rows."""
        return payload[1].long()

    def compress_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[tuple[Payload, Any]]:
        """The part selected where it lies, when its tensors lie end to end (no copy: indices over
        the span); else by rows."""
        span = end_to_end(segments)
        if span is None:
            return super().compress_part(buffer, segments, divisor)
        flat = buffer[span[0] : span[1]].div_(divisor)
        # the count read here is free on the CPU; an accelerator's path is measure_part's (no read)
        return [(self.sparse_payload(flat, host.nonzero(self._selected(flat))), SpanMeta(*span))]

    def measure_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[Measured]:
        """One record for the whole part: its span of ``buffer`` (or its rows, kept per part, where
        its tensors do not lie end to end) and their count above tau."""
        span = end_to_end(segments)
        if span is not None:
            flat = buffer[span[0] : span[1]].div_(divisor)
            return [Measured(self._selected(flat).sum(), flat)]
        layout = ChunkRows.of(segments, ROW)
        rows = self.measured_rows.take("rows", segments.keys, layout.shape, buffer.dtype, buffer.device)
        return self.measure_rows(layout.gather(buffer, rows, "zero").div_(divisor), layout)

    def measure_rows(self, rows: Tensor, layout: ChunkRows) -> list[Measured]:
        """The record of a part's ``rows`` (divided already; kept until they are compressed)."""
        return [Measured(self._selected_rows(rows, layout).sum(), rows)]

    def compress_measured_part(
        self, measured: Sequence[Measured], counts: Sequence[int], segments: Segments
    ) -> list[tuple[Payload, Any]]:
        ((record,), (count,)) = (measured, counts)
        if record.tensor.dim() == 1:  # a span (measure_part's)
            span = end_to_end(segments)
            assert span is not None
            indices = torch.nonzero_static(self._selected(record.tensor), size=count).view(-1)
            return [(self.sparse_payload(record.tensor, indices), SpanMeta(*span))]
        layout = ChunkRows.of(segments, ROW)
        indices = torch.nonzero_static(self._selected_rows(record.tensor, layout).view(-1), size=count).view(-1)
        return [(self.sparse_payload(record.tensor.view(-1), indices), RowsMeta(layout, record.tensor.dtype))]

    def decompress_part(self, payloads: Sequence[Payload], contexts: Sequence[Any], buffer: Tensor,
                        segments: Segments) -> None:  # fmt: skip
        if contexts and isinstance(contexts[0], SpanMeta):
            ((values, indices),) = payloads
            span = buffer[contexts[0].start : contexts[0].stop].zero_()
            span[indices.long()] = values.to(span.dtype)
            return
        super().decompress_part(payloads, contexts, buffer, segments)

    def decompress_sum_part(self, gathered: Sequence[Sequence[Payload]], contexts: Sequence[Any], buffer: Tensor,
                            segments: Segments) -> None:  # fmt: skip
        """Every rank's values added into zeros in rank order, as :meth:`decompress_sum` adds a
        tensor's (in float32 for half precision): into the span, or into rows put back in place."""
        if not isinstance(contexts[0], (RowsMeta, SpanMeta)):  # compressed tensor by tensor
            super().decompress_sum_part(gathered, contexts, buffer, segments)
            return
        ((everyone,), (meta,)) = (gathered, contexts)
        half = buffer.dtype in (torch.float16, torch.bfloat16)
        if isinstance(meta, SpanMeta):
            span = buffer[meta.start : meta.stop]
            total = self.workspace.take("span.total", span.numel(), torch.float32, span.device) if half else span
        else:
            rows = self._take("rows.total", meta.layout, torch.float32 if half else buffer.dtype, buffer.device)
            total = rows.view(-1)
        total.zero_()
        for values, indices in everyone:
            total.index_add_(0, indices.long(), values.to(total.dtype))
        if isinstance(meta, RowsMeta):
            meta.layout.scatter(rows, buffer)
        elif half:
            span.copy_(total)

    def _selected_rows(self, rows: Tensor, layout: ChunkRows) -> Tensor:
        """:meth:`_selected` of a part's rows, shaped as them, their pads never selected (zeros:
        only tau = 0 would take them)."""
        selected = self._selected(rows.view(-1)).view(rows.shape)
        if self.config.tau == 0 and layout.tails:
            selected[layout.full_rows :].masked_fill_(layout.tail_pads(rows.device), False)
        return selected

    def _selected(self, flat: Tensor) -> Tensor:
        """Where |x| >= tau, as a workspace mask (valid until the next call)."""
        below = self.workspace.take("below", flat.numel(), torch.bool, flat.device)
        magnitudes = self.workspace.take("abs", flat.numel(), flat.dtype, flat.device)
        torch.lt(torch.abs(flat, out=magnitudes), self.config.tau, out=below)
        # "not below" rather than ">=": NaN compares false either way, and must be selected.
        return below.logical_not_()
