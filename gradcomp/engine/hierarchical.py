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
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Hashable
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp.collectives import hierarchical, ring
from gradcomp.collectives.link import Link
from gradcomp.collectives.ops import ReduceOp
from gradcomp.compressors.keys import StateKey
from gradcomp.engine.routes import BucketWork, RouteSteps
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

    def pairs(self, bucket: Tensor, layout: Tensor) -> list[tuple[Tensor, Tensor]]:
        """(piece of the bucket, its place in the layout), as flat views: :func:`scatter` and
        :func:`gather` copy between them."""
        pieces = self.pieces
        in_bucket = [
            list(torch.split(tensor.reshape(-1), [math.prod(p) for p in parts]))
            for tensor, parts in zip(views(bucket, self.shapes), pieces, strict=True)
        ]
        pairs = []
        for j, (start, stop) in enumerate(self.bounds):
            shard = layout[start:stop]
            flat = views(shard, [(math.prod(parts[j]),) for parts in pieces])
            pairs += [(tensor_pieces[j], place) for tensor_pieces, place in zip(in_bucket, flat, strict=True)]
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


@dataclasses.dataclass
class _Layout:
    """A bucket's shard layout: its buffer, the shards (None when the bucket travels whole:
    element-wise compressors), the shards' bounds, and the views between bucket and layout (made
    for the bucket buffer they were made from)."""

    buffer: Tensor
    shards: NodeShards | None
    bounds: list[tuple[int, int]]
    pairs: Pairs
    bucket: Tensor


class HierarchicalRoute:
    """A bucket through a node's uncompressed reduce-scatter, ``inner`` (the spec's route, on the
    group of the local rank j of every node) on this rank's shard, and the node's all-gather."""

    issues_only = False

    def __init__(self, inner: RouteSteps, intra: dist.ProcessGroup, local: int, elementwise: bool) -> None:
        self.inner, self.intra, self.local, self.elementwise = inner, intra, local, elementwise
        self.rank = dist.get_rank(intra)
        self._layouts: dict[tuple[Hashable, ...], _Layout] = {}

    def prepare(self, work: BucketWork) -> None:
        """In the caller's thread: the bucket, divided by L, into its shard layout."""
        held = self._layout(work)
        with work.record.phase("compress"):
            if held.shards is None:
                torch.div(work.buffer, self.local, out=held.buffer)
            else:
                scatter(held.pairs, self.local)

    def send(self, work: BucketWork) -> Future[None] | None:
        held = self._layout(work)
        link = Link(self.intra)
        with work.record.phase("communicate"):
            ring.reduce_scatter(link, held.buffer, ReduceOp.SUM, held.bounds)
        start, stop = held.bounds[self.rank]
        shard = BucketWork(
            held.buffer[start:stop],
            [] if held.shards is None else [StateKey.of(key).of_node(self.rank) for key in work.keys],
            [] if held.shards is None else held.shards.shard_shapes(self.rank),
            work.record,
            work.ratio,
            work.settled,
        )
        self.inner.prepare(shard)
        landed = self.inner.send(shard)
        if landed is not None:
            landed.result()  # the all-gather below is issued here, on the executor, in order
        with work.record.phase("communicate"):
            ring.all_gather(link, held.buffer, held.bounds)
        work.record.add_traffic(link.traffic)
        work.record.intra_node_bytes = (work.record.intra_node_bytes or 0.0) + link.traffic.sent
        with work.record.phase("decompress"):
            if held.shards is None:
                work.buffer.copy_(held.buffer)
            else:
                gather(held.pairs)
        return None

    def _layout(self, work: BucketWork) -> _Layout:
        """The bucket's layout, made at its first step and kept per bucket (DDP waits for every
        bucket before the next backward, so the buffer is free when the next step needs it)."""
        key = tuple(work.keys) or (work.buffer.numel(),)
        held = self._layouts.get(key)
        if held is None or (held.buffer.numel(), held.buffer.dtype) != (work.buffer.numel(), work.buffer.dtype):
            buffer = torch.empty_like(work.buffer)
            shards = None if self.elementwise or not work.shapes else NodeShards(tuple(work.shapes), self.local)
            bounds = ring.chunk_bounds(buffer.numel(), self.local) if shards is None else shards.bounds
            held = self._layouts[key] = _Layout(buffer, shards, bounds, [], work.buffer)
        if held.shards is not None and (not held.pairs or held.bucket.data_ptr() != work.buffer.data_ptr()):
            held.pairs, held.bucket = held.shards.pairs(work.buffer, held.buffer), work.buffer  # a new bucket buffer
        return held
