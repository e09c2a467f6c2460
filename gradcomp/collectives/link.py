"""Point-to-point transfers inside a process group, with exact byte accounting.

Every exchange posts its receive and its send as non-blocking operations and then waits for both,
so two ranks that send to each other at the same step never block each other (no blocking send
against a blocking send), on any backend. Zero-element transfers are skipped on both sides: every
rank derives the same sizes.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import Tensor

TAG = 0x67C0
"""Tag of gradcomp's point-to-point messages, apart from a user's own (default tag 0)."""


@dataclasses.dataclass
class Traffic:
    """Bytes this rank sent and received in one operation (payload bytes, not protocol overhead)."""

    sent: int = 0
    received: int = 0

    def __iadd__(self, other: Traffic) -> Traffic:
        self.sent += other.sent
        self.received += other.received
        return self


class Link:
    """This rank's view of a process group for point-to-point exchanges.

    Ranks are group ranks; ``traffic`` accumulates every byte sent and received through this link.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.traffic = Traffic()

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def exchange(
        self,
        send: Tensor | None = None,
        to: int | None = None,
        receive: Tensor | None = None,
        source: int | None = None,
    ) -> None:
        """Send ``send`` to rank ``to`` while receiving ``receive`` from rank ``source``; wait for both."""
        self.wait(self.start(send, to, receive, source))

    def start(
        self,
        send: Tensor | None = None,
        to: int | None = None,
        receive: Tensor | None = None,
        source: int | None = None,
    ) -> list[dist.Work]:
        """Post the receive, then the send, without waiting; :meth:`wait` on what it returns."""
        works = []
        if receive is not None and receive.numel() and source is not None:
            works.append(dist.irecv(receive, src=self._global(source), group=self.group, tag=TAG))
            self.traffic.received += receive.numel() * receive.element_size()
        if send is not None and send.numel() and to is not None:
            works.append(dist.isend(send, dst=self._global(to), group=self.group, tag=TAG))
            self.traffic.sent += send.numel() * send.element_size()
        return [w for w in works if w is not None]

    @staticmethod
    def wait(works: list[dist.Work]) -> None:
        for work in works:
            work.wait()


def segments(numel: int, element_size: int, segment_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) of consecutive pieces of at most ``segment_bytes`` (at least one element)."""
    per_segment = max(1, segment_bytes // element_size)
    return [(s, min(s + per_segment, numel)) for s in range(0, numel, per_segment)]
