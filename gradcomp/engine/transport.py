"""Moving a bucket's payloads: packed into one byte buffer per destination, sizes first.

Payloads of several tensors (and of variable size, for sparse compressors) travel in two
collectives per exchange: an int64 header of element counts, then the packed bytes. The receiver
unpacks with the dtypes and trailing dimensions of its own payloads (the same structure on every
rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives
from gradcomp.collectives.link import Traffic
from gradcomp.compressors import Payload
from gradcomp.engine import packing

Meter = Callable[[Traffic | None], None]
"""Receives the traffic of every collective (None where the backend does not report it)."""


def all_gather_payloads(
    payloads: list[Payload], device: torch.device, group: dist.ProcessGroup, meter: Meter
) -> list[list[Payload]]:
    """Every rank's ``payloads``, rank-major: ``result[rank][i]`` is rank's i-th payload."""
    world = dist.get_world_size(group)
    tensors = [t for payload in payloads for t in payload]
    header = torch.tensor([t.numel() for t in tensors], dtype=torch.int64, device=device)
    headers = torch.empty(world * len(tensors), dtype=torch.int64, device=device)
    meter(collectives.all_gather(headers, header, group=group).traffic)
    counts = headers.view(world, len(tensors)).tolist()
    totals = [packing.packed_bytes(row, tensors) for row in counts]
    handle = collectives.all_gatherv(packing.pack(tensors, device), totals, group=group)
    meter(handle.traffic)
    return [
        regroup(payloads, packing.unpack(raw, row, tensors)) for raw, row in zip(handle.wait(), counts, strict=True)
    ]


def all_to_all_payloads(
    outgoing: list[list[Payload]], device: torch.device, group: dist.ProcessGroup, meter: Meter
) -> list[list[Payload]]:
    """``outgoing[j]``: the payloads for rank j (the same structure for every j). Returns
    ``received[s]``: the payloads rank s sent here."""
    world = dist.get_world_size(group)
    tensors = [[t for payload in payloads for t in payload] for payloads in outgoing]
    count = len(tensors[0])
    header = torch.tensor([t.numel() for ts in tensors for t in ts], dtype=torch.int64, device=device)
    headers = torch.empty_like(header)
    meter(collectives.all_to_all(headers, header, group=group).traffic)
    numels = headers.view(world, count).tolist()  # numels[s]: the sizes of what rank s sends here
    splits = [packing.packed_bytes([t.numel() for t in ts], ts) for ts in tensors]
    incoming = [packing.packed_bytes(numels[s], tensors[0]) for s in range(world)]
    data = torch.cat([packing.pack(ts, device) for ts in tensors])
    handle = collectives.all_to_allv(data, splits, incoming, group=group)
    meter(handle.traffic)
    raw, received, offset = handle.wait(), [], 0
    for s in range(world):
        received.append(regroup(outgoing[0], packing.unpack(raw[offset : offset + incoming[s]], numels[s], tensors[0])))
        offset += incoming[s]
    return received


def regroup(payloads: list[Payload], flat: list[Tensor]) -> list[Payload]:
    """Cut a flat list of tensors back into payloads shaped like ``payloads``."""
    grouped, index = [], 0
    for payload in payloads:
        grouped.append(tuple(flat[index : index + len(payload)]))
        index += len(payload)
    return grouped
