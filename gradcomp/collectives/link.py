"""Point-to-point transfers inside a process group, with exact byte accounting.

Every exchange posts its receive and its send as non-blocking operations and then waits for both,
so two ranks that send to each other at the same step never block each other (no blocking send
against a blocking send), on any backend. Zero-element transfers are skipped on both sides: every
rank derives the same sizes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch.distributed as dist
from torch import Tensor

from gradcomp.collectives.groups import rank_of, registered, size_of
from gradcomp.errors import PeerError

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


class Pending(NamedTuple):
    """A transfer in flight: the backend's work, and what it is (for the error if it fails)."""

    work: dist.Work
    sending: bool
    nbytes: int
    peer: int


class Link:
    """This rank's view of a process group for point-to-point exchanges.

    Ranks are group ranks; ``traffic`` accumulates every byte sent and received through this link.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = rank_of(group)
        self.size = size_of(group)
        self.traffic = Traffic()
        self._known = registered(group)  # else the group's own send and receive, by group rank

    def _global(self, rank: int) -> int:
        return rank if self.group is None or not self._known else dist.get_global_rank(self.group, rank)

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
    ) -> list[Pending]:
        """Post the receive, then the send, without waiting; :meth:`wait` on what it returns."""
        pending: list[Pending] = []
        if receive is not None and receive.numel() and source is not None:
            self.traffic.received += self._post(pending, receive, source, sending=False)
        if send is not None and send.numel() and to is not None:
            self.traffic.sent += self._post(pending, send, to, sending=True)
        return pending

    def _post(self, pending: list[Pending], tensor: Tensor, peer: int, *, sending: bool) -> int:
        """Post one transfer (appended to ``pending``); return its bytes."""
        nbytes = tensor.numel() * tensor.element_size()
        try:
            if self._known:
                post = dist.isend if sending else dist.irecv
                work = post(tensor, self._global(peer), group=self.group, tag=TAG)
            else:  # a group torch.distributed does not know (torchft's): its own methods
                assert self.group is not None
                post_own = self.group.send if sending else self.group.recv
                work = post_own([tensor], peer, TAG)
        except RuntimeError as error:
            raise self._peer_error(error, sending, nbytes, peer) from error
        if work is not None:
            pending.append(Pending(work, sending, nbytes, peer))
        return nbytes

    def wait(self, pending: list[Pending]) -> None:
        """Wait for every transfer; a failure (a peer that timed out, died or does something else)
        raises :class:`PeerError` naming this rank and the peer."""
        for transfer in pending:
            try:
                transfer.work.wait()
            except RuntimeError as error:
                raise self._peer_error(error, transfer.sending, transfer.nbytes, transfer.peer) from error

    def _peer_error(self, error: RuntimeError, sending: bool, nbytes: int, peer: int) -> PeerError:
        """The backend's error about a transfer (posting it or waiting for it), naming both ranks."""
        what, direction = ("sending", "to") if sending else ("receiving", "from")
        return PeerError(
            f"{self._name(self.rank)}: {what} {nbytes} bytes {direction} {self._name(peer)} failed: is that rank "
            f"frozen, dead, or running a different collective (ranks must issue the same ones in the same order)? "
            f"{error}"
        )

    def _name(self, rank: int) -> str:
        """``rank 1`` (``rank 1 (global 3)`` in a subgroup)."""
        global_rank = self._global(rank)
        return f"rank {rank}" if global_rank == rank else f"rank {rank} (global {global_rank})"


def segments(numel: int, element_size: int, segment_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) of consecutive pieces of at most ``segment_bytes`` (at least one element)."""
    per_segment = max(1, segment_bytes // element_size)
    return [(s, min(s + per_segment, numel)) for s in range(0, numel, per_segment)]
