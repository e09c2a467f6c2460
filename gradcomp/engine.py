"""The per-bucket pipeline: (error feedback) -> compress -> communicate -> decompress -> average.

One :class:`Engine` per process group and compressor spec. ``reduce(tensor, key)`` averages a
tensor over the group in place, asynchronously, on the collectives' ordered executor, so every
round of every bucket runs in the same order on every rank and nothing communicates from a
backend's callback thread (design rule 3).

- ``sum`` compressors: the payload is all-reduced (``algo``: native or any gradcomp algorithm), then
  decompressed into the tensor. Multi-round compressors (PowerSGD) all-reduce every round.
- ``gather`` compressors: every payload tensor is all-gathered with variable sizes, then
  ``decompress_sum`` adds every rank's contribution into the tensor, in rank order.
- The tensor is divided by the world size *before* compression, so that low-precision sums cannot
  overflow (design rule 5) and the average is taken exactly once.
- The first call checks that every rank uses the same spec, and fails with both specs named.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives
from gradcomp.collectives.executor import Handle, executor
from gradcomp.compressors import Aggregation, Compressor, Key, Payload, make_compressor, parse_spec
from gradcomp.compressors.registry import SpecLike

logger = logging.getLogger(__name__)

ALGORITHMS = tuple(a for a in collectives.ALGORITHMS if a != "hierarchical")
"""All-reduce algorithms for ``sum`` payloads (hierarchical needs a local size: not yet offered)."""


class Engine:
    """Averages tensors over a process group through one compressor.

    Args:
        spec: a compressor spec (``"topk:ratio=0.01,ef=true"``).
        group: the process group (default: the world).
        algo: all-reduce algorithm for ``sum`` payloads.
        seed: seed of the compressor's generators; the same on every rank.
    """

    def __init__(
        self, spec: SpecLike, *, group: dist.ProcessGroup | None = None, algo: str = "native", seed: int = 0
    ) -> None:
        if algo not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algo!r}; valid: {', '.join(ALGORITHMS)}")
        parsed = parse_spec(spec)
        self.spec = str(parsed)
        self.group = group
        self.algo = algo
        self.world = dist.get_world_size(group)
        self.compressor: Compressor = make_compressor(parsed, seed=seed, rank=dist.get_rank(group))
        self._checked = False

    def reduce(self, tensor: Tensor, key: Key, shapes: Sequence[torch.Size] | None = None) -> Handle[Tensor]:
        """Replace ``tensor`` (flat, contiguous, floating) by its average over the group, compressed.

        ``key`` identifies the tensor across steps (state is kept per key); ``shapes`` lists the
        tensors it concatenates (PowerSGD compresses each matrix). Returns at once.
        """
        if not tensor.is_floating_point():
            raise TypeError(f"gradients must be floating-point, got {tensor.dtype}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("the engine reduces flat, contiguous tensors (a DDP bucket's buffer)")
        return executor().submit(lambda: (self._reduce(tensor, key, shapes), None))

    def _reduce(self, tensor: Tensor, key: Key, shapes: Sequence[torch.Size] | None) -> Tensor:
        if not self._checked:
            self._check_same_spec(tensor.device)
            self._checked = True
        compressor = self.compressor
        tensor.div_(self.world)
        payload, ctx = compressor.compress(tensor, key, shapes)
        for _ in range(1, compressor.rounds):
            payload, ctx = compressor.next_round(self._sum(payload), ctx)
        if compressor.aggregation is Aggregation.SUM:
            compressor.decompress(self._sum(payload), ctx, out=tensor)
        else:
            compressor.decompress_sum(self._gather(payload), ctx, out=tensor)
        return tensor

    def _sum(self, payload: Payload) -> Payload:
        for part in payload:
            collectives.all_reduce(part, "sum", algo=self.algo, group=self.group)
        return payload

    def _gather(self, payload: Payload) -> list[Payload]:
        """Every rank's payload, in rank order (parts may differ in length between ranks)."""
        gathered = []
        for part in payload:
            pieces = collectives.all_gatherv(part.contiguous(), group=self.group).wait()
            gathered.append([p.view(-1, *part.shape[1:]) if part.dim() > 1 else p for p in pieces])
        return [tuple(parts) for parts in zip(*gathered, strict=True)]

    def _check_same_spec(self, device: torch.device) -> None:
        mine = torch.tensor(list(self.spec.encode()), dtype=torch.uint8, device=device)
        specs = [bytes(p.tolist()).decode() for p in collectives.all_gatherv(mine, group=self.group).wait()]
        if len(set(specs)) > 1:
            listing = "; ".join(f"rank {r}: {s!r}" for r, s in enumerate(specs))
            raise ValueError(f"ranks were given different compressor specs: {listing}")
