"""The per-tensor policy on a sharded reduce-scatter (``min_numel``, ``vectors`` with FSDP2).

FSDP2 hands its reduce-scatter a module's gradients as ``world`` rows, row j the concatenation of
every parameter's shard j (each padded to the same size on every rank). The hook knows the module's
parameters, and so the columns of a row each one holds: :func:`dense_columns` finds those of the
parameters a spec sends uncompressed (by ``HookSpec.uncompressed``, the rule DDP's buckets follow),
and :class:`Columns` splits a row's columns into those and the rest, and puts the results back.

Cost: two gathers of the input by column and two scatters of the output (a pass over the module's
gradient each), through index tensors made once per module and size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp.engine.spec import HookSpec

Span = tuple[int, int]
"""Columns ``[start, stop)`` of a row."""


def dense_columns(spec: HookSpec, tensors: Sequence[tuple[torch.Size, int]], row: int) -> list[Span] | None:
    """The columns, in a row of ``row`` elements, of the tensors that ``spec`` sends uncompressed:
    ``tensors`` gives each one's shape and the columns it holds, in the row's order. None when they
    do not fill the row (a module whose unused parameters left this reduction: it goes compressed)."""
    if sum(columns for _, columns in tensors) != row:
        return None
    spans: list[Span] = []
    start = 0
    for shape, columns in tensors:
        if columns and spec.uncompressed(shape):
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], start + columns)
            else:
                spans.append((start, start + columns))
        start += columns
    return spans


@dataclasses.dataclass(frozen=True)
class Columns:
    """A row's columns in two: the uncompressed ones (:attr:`dense`) and the rest (:attr:`kept`)."""

    dense: Tensor
    """Indices (int64) of the columns that travel uncompressed."""
    kept: Tensor
    """Indices of the others, which travel compressed."""

    @classmethod
    def of(cls, spans: Sequence[Span], row: int, device: torch.device) -> Columns:
        mask = torch.zeros(row, dtype=torch.bool)
        for start, stop in spans:
            mask[start:stop] = True
        everything = torch.arange(row)
        return cls(everything[mask].to(device), everything[~mask].to(device))

    def split(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``rows`` (world, row) as its dense columns and its kept ones, each a contiguous (world, n)."""
        return rows.index_select(1, self.dense), rows.index_select(1, self.kept)

    def join(self, out: Tensor, dense: Tensor, kept: Tensor) -> None:
        """``out`` (a row) from its dense columns' values and its kept ones'."""
        out.index_copy_(0, self.dense, dense)
        out.index_copy_(0, self.kept, kept)
