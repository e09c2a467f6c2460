"""Handing a tensor over: everything an engine's compressor holds of one tensor, in the tensor's shape.

The engine cuts a tensor before compressing it, and its compressor keeps state per part, each part
keyed by a :class:`~gradcomp.compressors.keys.StateKey`: pieces of its rows (``HookSpec.pieces``),
the rows a local rank compresses across nodes (``HookSpec.local_size``), the shards two-phase
compresses for every rank, and the reduced shard it compresses again. A caller that averages the
tensor another way from now on (the ``auto`` hook switching its method) asks for all of it at once
(:func:`take_residual`): every part's unsent residual, put back where the part lies in the tensor, and
every other state of it (EF21's estimates, momentum's velocities) forgotten.

Units: the engine's, the gradient over the world size. Added to the next gradient times the world
size (the engine divides by it), a part's residual then reaches the average exactly once:

- a shard's residual (two-phase's first compression) is what this rank's share of that shard lost;
- a reduced shard's residual is what the second compression lost of the shard's *average*, held by
  the one rank that reduces the shard: that rank adds it at the shard's place;
- across nodes, a node's part is held by the local rank that compressed it, zeros elsewhere, so that
  every node's residual is sent once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable

import torch
from torch import Tensor

from gradcomp.collectives.ring import chunk_bounds
from gradcomp.compressors import Compressor
from gradcomp.compressors.keys import StateKey, of_parameter
from gradcomp.engine import pieces
from gradcomp.engine.hierarchical import NodeShards


@dataclasses.dataclass(frozen=True)
class Cuts:
    """How an engine cuts a tensor before compressing it: what places a part's state in the tensor."""

    pieces: int = 1
    """``HookSpec.pieces``: pieces of rows per large tensor (1: whole)."""
    multiple: int = 1
    """Elements a piece holds a multiple of (the compressor's chunk)."""
    smallest: int = 0
    """``HookSpec.min_numel``: a piece holds at least this many elements."""
    local: int = 1
    """Ranks per node (``HookSpec.local_size``; 1: flat)."""
    shards: int = 1
    """Ranks the two-phase route shards a tensor for (the group it runs on)."""

    def region(self, key: StateKey, shape: torch.Size) -> tuple[int, int]:
        """Where the part ``key`` of a tensor of ``shape`` lies in it, flat: ``[start, stop)``."""
        if key.hop is not None:
            raise ValueError(f"{key}: the sharded reduce-scatter's parts are not a DDP tensor's")
        start, part = 0, shape
        if key.piece is not None:
            _, cut = pieces.cut([0], [shape], self.pieces, self.multiple, self.smallest)
            start, part = start + sum(math.prod(s) for s in cut[: key.piece]), cut[key.piece]
        if key.node is not None:
            (rows,) = NodeShards((part,), self.local).pieces
            start, part = start + sum(math.prod(s) for s in rows[: key.node]), rows[key.node]
        if key.shard is None:
            return start, start + math.prod(part)
        first, stop = chunk_bounds(math.prod(part), self.shards)[key.shard]
        return start + first, start + stop


def take_residual(compressor: Compressor, cuts: Cuts, parameter: Hashable, shape: torch.Size) -> Tensor | None:
    """What ``compressor`` had not sent yet of tensor ``parameter`` (of ``shape``), every part in its
    place, summed where parts overlap (a reduced shard over this rank's own shard); every state of
    the tensor is forgotten (``Compressor.take_residual`` of each part). None: nothing is owed."""
    full: Tensor | None = None
    for key in of_parameter(compressor.state_keys(), parameter):
        residual = compressor.take_residual(key)
        if residual is None:
            continue
        if full is None:
            full = residual.new_zeros(shape)
        start, stop = cuts.region(StateKey.parse(key), shape)
        full.view(-1)[start:stop].add_(residual.reshape(-1))
    return full
