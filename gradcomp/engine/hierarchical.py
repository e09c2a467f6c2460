"""Hierarchical compressed averaging: uncompressed inside a node, compressed across nodes.

With ``HookSpec.local_size = L`` the world is nodes of L consecutive ranks (torchrun's numbering).
Compression pays only on the slow hop between nodes, so a bucket takes three steps:

1. **Inside the node**, an uncompressed reduce-scatter: local rank j receives the node's sum of
   *shard j*, which holds piece j of every tensor of the bucket (each tensor cut into L pieces of
   its rows, :class:`NodeShards`), so that a shard is made of whole pieces of tensors, the same ones
   whichever bucket DDP puts a tensor in.
2. **Across nodes**, local rank j compresses its shard's pieces (each keyed ``StateKey.of_node(j)``: its
   error-feedback residual and PowerSGD memory follow the piece) and averages them with the local
   rank j of every other node, through the spec's route (:mod:`gradcomp.engine.routes`) on that
   group of ``world / L`` ranks: a node sends 1 / L of its compressed gradient per local rank, the
   whole compressed gradient through its uplink in all, L times less than every rank compressing
   and sending everything.
3. **Inside the node**, an uncompressed all-gather of the shards, back into the bucket.

The bucket is divided by L before the reduce-scatter and by ``world / L`` in the compression, so the
average is taken once and sums cannot overflow (rule "divide before sum"). Ranks end bitwise
identical: every local rank j decompresses the same payloads, and the all-gather copies. The intra-
node steps run gradcomp's ring (point to point, every byte counted as inside the node); the whole
bucket runs on the ordered executor (compression needs the reduce-scattered shard).

Cost per bucket of n elements: 2 (L - 1) / L n elements sent inside the node (the ring's
reduce-scatter and all-gather), and the compressor's payload of n / L elements across nodes per
local rank; two copies of the bucket (into the shard layout and back), through views made once per
bucket.

The bucket's plan says it (:attr:`gradcomp.engine.plan.Route.NODES`, its inner part the shard's),
:class:`gradcomp.engine.routes.NodesRoute` runs it; this module holds the layout.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp.collectives import hierarchical
from gradcomp.flat import views

LAUNCHER_LAYOUT = "LOCAL_WORLD_SIZE"
"""The environment variable in which torchrun (and ``gradcomp.launch`` on an emulated cluster) gives
the ranks per node."""


def check_local_size(local_size: int, world: int) -> None:
    """``local_size`` divides ``world`` (:func:`gradcomp.collectives.hierarchical.check_local_size`)
    and matches the launcher's layout, if the launcher gave one."""
    hierarchical.check_local_size(world, local_size)
    launched = os.environ.get(LAUNCHER_LAYOUT)
    if launched is not None and launched.strip() and int(launched) != local_size:
        raise ValueError(
            f"local_size={local_size}, but the launcher started {launched} ranks per node ({LAUNCHER_LAYOUT}): "
            "a node's ranks must share its fast links"
        )


@dataclasses.dataclass(frozen=True)
class NodeShards:
    """A bucket's tensors cut into ``local`` pieces of their rows (a 0-d tensor as one row), and the
    shard layout: shard j holds piece j of every tensor, in order (:meth:`shard_shapes`)."""

    shapes: tuple[torch.Size, ...]
    local: int

    @functools.cached_property
    def pieces(self) -> list[list[torch.Size]]:
        """Per tensor, its L pieces' shapes (the first ones a row larger; empty ones where it has
        fewer rows than L)."""
        out = []
        for shape in self.shapes:
            rows, rest = (shape[0], tuple(shape[1:])) if len(shape) else (1, ())
            base, extra = divmod(rows, self.local)
            out.append([torch.Size((base + (j < extra), *rest)) for j in range(self.local)])
        return out

    @functools.cached_property
    def bounds(self) -> list[tuple[int, int]]:
        """Each shard's [start, stop) in the shard layout."""
        sizes = [sum(math.prod(p[j]) for p in self.pieces) for j in range(self.local)]
        starts = [0, *itertools.accumulate(sizes)]
        return list(itertools.pairwise(starts))

    def shard_shapes(self, j: int) -> list[torch.Size]:
        return [p[j] for p in self.pieces]

    def pairs(self, tensors: Sequence[Tensor], layout: Tensor) -> Pairs:
        """(piece of a tensor, its place in the layout), as flat views: :func:`scatter` and
        :func:`gather` copy between them."""
        in_tensors = [
            list(torch.split(tensor.reshape(-1), [math.prod(p) for p in parts]))
            for tensor, parts in zip(tensors, self.pieces, strict=True)
        ]
        pairs = []
        for j, (start, stop) in enumerate(self.bounds):
            flat = views(layout[start:stop], [(math.prod(parts[j]),) for parts in self.pieces])
            pairs += [(tensor_pieces[j], place) for tensor_pieces, place in zip(in_tensors, flat, strict=True)]
        return pairs


Pairs = list[tuple[Tensor, Tensor]]
"""Pieces of a bucket and their places in its shard layout (:meth:`NodeShards.pairs`)."""


def scatter(pairs: Pairs, divisor: float) -> None:
    """Each piece of the bucket, divided by ``divisor``, into its place in the shard layout."""
    for source, destination in pairs:
        torch.div(source, divisor, out=destination)


def gather(pairs: Pairs) -> None:
    """The shard layout back into the bucket's order."""
    for home, averaged in pairs:
        home.copy_(averaged)
