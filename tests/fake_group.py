"""p ranks as threads of one process, exchanging tensors through memory: a fake group for the
engine's transport (``gradcomp.engine.transport.Transport``), so that packing, transport and
two-phase aggregation are tested in one process, fast, against what real collectives would deliver."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from torch import Tensor


class ThreadGroup:
    """Shared by the p threads; each thread talks through its own :class:`ThreadTransport`."""

    def __init__(self, world: int, timeout: float = 30.0) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout)  # a bug is a BrokenBarrierError, not a hang
        self.slots: list[Any] = [None] * world

    def swap(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective: every rank must call it)."""
        self.slots[rank] = value
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return everyone


class ThreadTransport:
    """One rank's view of a :class:`ThreadGroup`. Tensors are copied, as a receiver's buffer would be,
    and every call checks the sizes its caller claims against what the peers really sent."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, group.world
        self.sent_elements = 0
        self.collectives = 0

    def all_gatherv(self, tensor: Tensor, sizes: Sequence[int]) -> list[Tensor]:
        assert tensor.dim() == 1 and tensor.numel() == sizes[self.rank], (tensor.shape, sizes, self.rank)
        self.sent_elements += tensor.numel() * (self.world - 1)
        everyone = self.group.swap(self.rank, tensor.clone())
        assert [t.numel() for t in everyone] == list(sizes), "all_gatherv: sizes differ from what ranks sent"
        return everyone

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        assert tensor.dim() == 1
        self.sent_elements += tensor.numel() * (self.world - 1)
        self.collectives += 1
        everyone = self.group.swap(self.rank, tensor.clone())
        assert len({t.numel() for t in everyone}) == 1, "all_gather: ranks sent different sizes"
        return everyone

    def all_to_allv(self, tensor: Tensor, splits: Sequence[int], incoming: Sequence[int]) -> list[Tensor]:
        assert tensor.dim() == 1 and sum(splits) == tensor.numel() and len(splits) == self.world
        pieces = list(tensor.clone().split(list(splits)))
        self.sent_elements += sum(p.numel() for j, p in enumerate(pieces) if j != self.rank)
        everyone = self.group.swap(self.rank, pieces)
        received = [everyone[s][self.rank] for s in range(self.world)]
        assert [t.numel() for t in received] == list(incoming), "all_to_allv: sizes differ from what ranks sent"
        return received

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        assert tensor.dim() == 1 and tensor.numel() % self.world == 0
        blocks = tensor.clone().view(self.world, -1)
        self.sent_elements += blocks[0].numel() * (self.world - 1)
        self.collectives += 1
        everyone = self.group.swap(self.rank, blocks)
        assert len({t.shape for t in everyone}) == 1, "reduce_scatter: ranks sent different sizes"
        total = everyone[0][self.rank].clone()
        for blocks_of_rank in everyone[1:]:  # in rank order, in the tensor's dtype, as a backend would
            total += blocks_of_rank[self.rank]
        return total


def on_threads(world: int, body: Callable[[ThreadTransport], Any]) -> list[Any]:
    """Run ``body(exchange)`` on ``world`` threads, one per rank; return the results in rank order
    (an exception in any thread is raised here)."""
    group = ThreadGroup(world)
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(body, ThreadTransport(group, rank)) for rank in range(world)]
        wait(futures, timeout=60, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and f.exception() is not None]
        if failed or not all(f.done() for f in futures):
            group.barrier.abort()  # release the threads still waiting for the one that failed
            raise failed[0].exception() if failed else TimeoutError(f"{world} threads did not finish in 60 s")
        return [future.result() for future in futures]
