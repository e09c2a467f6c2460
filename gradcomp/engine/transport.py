"""Moving a bucket's payloads: packed into one byte buffer per destination, sizes first.

Payloads of several tensors (and of variable shapes: sparse payloads, shards of different sizes)
travel in two collectives per exchange: an int64 header of their shapes, then the packed bytes
(:mod:`gradcomp.engine.packing`). The receiver unpacks with the dtypes of its own payloads (the
same structure on every rank).

The collectives come from an :class:`Exchange`: :class:`GroupExchange` on a process group (what the
engine uses), or any object with the same two methods (the tests run p ranks as threads of one
process through one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives
from gradcomp.collectives.link import Traffic
from gradcomp.compressors import Payload
from gradcomp.engine import packing

Meter = Callable[[Traffic | None], None]
"""Receives the traffic of every collective (None where the backend does not report it)."""


class Exchange(Protocol):
    """The two collectives payload transport needs, among ``world`` ranks (this one is ``rank``)."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def all_gatherv(self, tensor: Tensor, sizes: Sequence[int]) -> list[Tensor]:
        """Every rank's flat ``tensor`` (``sizes[r]`` elements from rank r), in rank order."""
        ...

    def all_to_allv(self, tensor: Tensor, splits: Sequence[int], incoming: Sequence[int]) -> list[Tensor]:
        """Send ``splits[j]`` elements of the flat ``tensor`` (in order) to rank j; return what each
        rank s sent here (``incoming[s]`` elements), in rank order."""
        ...


class GroupExchange:
    """:class:`Exchange` over a process group through gradcomp's collectives (on the calling thread,
    which is the ordered executor's when the engine calls), reporting their traffic to ``meter``."""

    def __init__(self, group: dist.ProcessGroup, meter: Meter) -> None:
        self.group, self.meter = group, meter
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def all_gatherv(self, tensor: Tensor, sizes: Sequence[int]) -> list[Tensor]:
        handle = collectives.all_gatherv(tensor, sizes, group=self.group)
        self.meter(handle.traffic)
        return handle.wait()

    def all_to_allv(self, tensor: Tensor, splits: Sequence[int], incoming: Sequence[int]) -> list[Tensor]:
        handle = collectives.all_to_allv(tensor, splits, incoming, group=self.group)
        self.meter(handle.traffic)
        received, pieces, offset = handle.wait(), [], 0
        for size in incoming:
            pieces.append(received[offset : offset + size])
            offset += size
        return pieces


def all_gather_payloads(payloads: list[Payload], device: torch.device, exchange: Exchange) -> list[list[Payload]]:
    """Every rank's ``payloads``, rank-major: ``result[rank][i]`` is rank's i-th payload."""
    tensors = [t for payload in payloads for t in payload]
    mine = packing.header(tensors)
    headers = exchange.all_gatherv(torch.tensor(mine, dtype=torch.int64, device=device), [len(mine)] * exchange.world)
    shapes = [packing.shapes(h.tolist(), tensors) for h in headers]
    packed = exchange.all_gatherv(packing.pack(tensors, device), [packing.packed_bytes(s, tensors) for s in shapes])
    return [regroup(payloads, packing.unpack(raw, s, tensors)) for raw, s in zip(packed, shapes, strict=True)]


def all_to_all_payloads(outgoing: list[list[Payload]], device: torch.device, exchange: Exchange) -> list[list[Payload]]:
    """``outgoing[j]``: the payloads for rank j (the same structure for every j, not the same shapes).
    Returns ``received[s]``: the payloads rank s sent here."""
    world = exchange.world
    tensors = [[t for payload in payloads for t in payload] for payloads in outgoing]
    mine = [packing.header(ts) for ts in tensors]
    sizes = [len(h) for h in mine]
    flat = torch.tensor([size for h in mine for size in h], dtype=torch.int64, device=device)
    headers = exchange.all_to_allv(flat, sizes, sizes)
    shapes = [packing.shapes(h.tolist(), tensors[0]) for h in headers]  # shapes[s]: what rank s sends here
    splits = [packing.packed_bytes([t.shape for t in ts], ts) for ts in tensors]
    incoming = [packing.packed_bytes(shapes[s], tensors[0]) for s in range(world)]
    data = torch.cat([packing.pack(ts, device) for ts in tensors])
    pieces = exchange.all_to_allv(data, splits, incoming)
    return [regroup(outgoing[0], packing.unpack(pieces[s], shapes[s], tensors[0])) for s in range(world)]


def regroup(payloads: list[Payload], flat: list[Tensor]) -> list[Payload]:
    """Cut a flat list of tensors back into payloads shaped like ``payloads``."""
    grouped, index = [], 0
    for payload in payloads:
        grouped.append(tuple(flat[index : index + len(payload)]))
        index += len(payload)
    return grouped
