"""All-gather (equal and variable sizes), all-to-all (equal and variable splits) and broadcast.

All-gather runs the ring (p - 1 steps, (p - 1) / p of the output sent per rank); all-to-all runs p - 1
pairwise steps (at step s, rank r sends to r + s and receives from r - s), which never deadlock and
keep every link busy; broadcast is the binomial tree (ceil(lg p) whole-tensor messages).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.collectives import ring
from gradcomp.collectives.link import Link


def offsets(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) of consecutive blocks of the given sizes."""
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def all_gather_into(link: Link, output: Tensor, mine: Tensor, sizes: Sequence[int]) -> None:
    """Fill the flat ``output`` with every rank's block (``sizes`` elements each, rank order)."""
    bounds = offsets(sizes)
    start, stop = bounds[link.rank]
    output[start:stop].copy_(mine.reshape(-1))
    ring.all_gather(link, output, bounds)


def gather_sizes(link: Link, numel: int, device: torch.device) -> list[int]:
    """Every rank's element count (one int64 per rank on the wire)."""
    counts = torch.zeros(link.size, dtype=torch.int64, device=device)
    counts[link.rank] = numel
    ring.all_gather(link, counts, offsets([1] * link.size))
    return host.values(counts)


def all_to_all_into(
    link: Link, output: Tensor, flat_input: Tensor, input_sizes: Sequence[int], output_sizes: Sequence[int]
) -> None:
    """Block j of ``flat_input`` goes to rank j; block i of ``output`` comes from rank i."""
    p, r = link.size, link.rank
    sends, receives = offsets(input_sizes), offsets(output_sizes)
    own_in, own_out = sends[r], receives[r]
    output[own_out[0] : own_out[1]].copy_(flat_input[own_in[0] : own_in[1]])
    for step in range(1, p):
        to, source = (r + step) % p, (r - step) % p
        send_start, send_stop = sends[to]
        recv_start, recv_stop = receives[source]
        link.exchange(send=flat_input[send_start:send_stop], to=to, receive=output[recv_start:recv_stop], source=source)


def exchange_split_sizes(link: Link, input_sizes: Sequence[int], device: torch.device) -> list[int]:
    """How many elements each rank will send to this one (one int64 per rank pair on the wire)."""
    counts = torch.tensor(list(input_sizes), dtype=torch.int64, device=device)
    received = torch.empty(link.size, dtype=torch.int64, device=device)
    all_to_all_into(link, received, counts, [1] * link.size, [1] * link.size)
    return host.values(received)
