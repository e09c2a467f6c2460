"""Moving a bucket's payloads: packed into one byte buffer per destination, sizes first.

Payloads of several tensors (and of variable shapes: sparse payloads, shards of different sizes)
travel in two collectives per exchange: an int64 header of their shapes, then the packed bytes
(:mod:`gradcomp.engine.packing`). The receiver unpacks with the dtypes of its own payloads (the
same structure on every rank).

:func:`all_gather_padded` does an all-gather in one of the backend's own equal-size all-gathers
instead: header and bytes in one frame per rank, padded to a capacity that every rank derives from
the same gathered frames (a second round, at a larger capacity, when a payload outgrew it).

The collectives come from a :class:`Transport`: :class:`GroupTransport` on a process group (what the
engines use), or any object with the same methods (the tests run p ranks as threads of one process
through one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp import collectives, host
from gradcomp.collectives.exchange import offsets
from gradcomp.collectives.groups import rank_of, registered, size_of
from gradcomp.collectives.link import Traffic
from gradcomp.compressors import Payload
from gradcomp.engine import packing
from gradcomp.errors import backend_failure

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (kept, deprecated); older
# releases have only the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Meter(Protocol):
    """Receives the traffic of every collective: None where the backend does not report it, and
    ``native`` is then what its algorithm sends by its own count (``BucketRecord.add_traffic``)."""

    def __call__(self, traffic: Traffic | None, native: float = 0.0) -> None: ...


class Transport(Protocol):
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

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's flat ``tensor`` (the same size on every rank), in rank order: the backend's
        own all-gather (one fused collective on NCCL)."""
        ...

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        """Block ``rank`` of the sum over the ranks of the flat ``tensor`` (``world`` equal blocks),
        summed in ``tensor``'s dtype."""
        ...


def all_gather_into(out: Tensor, tensor: Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> Any:
    """Every rank's ``tensor`` into ``out`` (its ``world`` rows, in rank order) by the backend's
    all-gather, on ``group`` whether ``torch.distributed`` knows it or not (torchft's groups
    all-gather into a list only); the backend's work with ``async_op``."""
    if registered(group):
        return all_gather_single(out, tensor, group=group, async_op=async_op)
    return dist.all_gather(list(out.view(size_of(group), -1)), tensor, group=group, async_op=async_op)


class GroupTransport:
    """:class:`Transport` over a process group (on the calling thread, which is the ordered
    executor's when an engine calls), reporting the traffic to ``meter``. All-to-all and
    reduce-scatter are gradcomp's own (point-to-point: every byte counted) or, with ``native``, the
    backend's (one collective each, which NCCL runs on the device); all-gather is the backend's."""

    def __init__(self, group: dist.ProcessGroup, meter: Meter, native: bool = False) -> None:
        self.group, self.meter, self.native = group, meter, native
        self.rank, self.world = rank_of(group), size_of(group)

    def all_gatherv(self, tensor: Tensor, sizes: Sequence[int]) -> list[Tensor]:
        handle = collectives.all_gatherv(tensor, sizes, group=self.group)
        self.meter(handle.traffic)
        return handle.wait()

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        return self._issue_all_gather(tensor, async_op=False)[0]

    def all_gather_in_flight(self, tensor: Tensor) -> tuple[list[Tensor], torch.futures.Future[Any]]:
        """:meth:`all_gather` issued and left in flight: the rows it fills, and the backend's future,
        complete once they hold every rank's ``tensor`` (its ``value()`` raises the backend's error)."""
        rows, work = self._issue_all_gather(tensor, async_op=True)
        return rows, work.get_future()

    def _issue_all_gather(self, tensor: Tensor, async_op: bool) -> tuple[list[Tensor], Any]:
        out = torch.empty(self.world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        try:
            work = all_gather_into(out, tensor, self.group, async_op)
        except RuntimeError as error:
            raise backend_failure(ALL_GATHER, self.rank, self.world, error) from error
        # gloo's and NCCL's all-gathers are rings: each rank forwards p - 1 blocks and receives as many
        nbytes = (self.world - 1) * tensor.numel() * tensor.element_size()
        self.meter(Traffic(nbytes, nbytes))
        return list(out.view(self.world, -1)), work

    def all_to_allv(self, tensor: Tensor, splits: Sequence[int], incoming: Sequence[int]) -> list[Tensor]:
        if self.native:
            received = torch.empty(sum(incoming), dtype=tensor.dtype, device=tensor.device)
            try:
                dist.all_to_all_single(received, tensor, list(incoming), list(splits), group=self.group)
            except RuntimeError as error:
                raise backend_failure("the backend's all-to-all", self.rank, self.world, error) from error
            width = tensor.element_size()  # what travels is exactly the splits, less this rank's own
            sent, got = sum(splits) - splits[self.rank], sum(incoming) - incoming[self.rank]
            self.meter(Traffic(sent * width, got * width))
        else:
            handle = collectives.all_to_allv(tensor, splits, incoming, group=self.group)
            self.meter(handle.traffic)
            received = handle.wait()
        return list(received.split(list(incoming)))

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        out = torch.empty(tensor.numel() // self.world, dtype=tensor.dtype, device=tensor.device)
        if not self.native:
            handle = collectives.reduce_scatter(out, tensor, "sum", group=self.group)
            self.meter(handle.traffic)
            return handle.wait()
        try:
            reduce_scatter_single(out, tensor, group=self.group)
        except RuntimeError as error:
            raise backend_failure("the backend's reduce-scatter", self.rank, self.world, error) from error
        # not observable; a ring reduce-scatter forwards p - 1 blocks
        self.meter(None, native=(self.world - 1) * out.numel() * out.element_size())
        return out


def all_gather_payloads(payloads: list[Payload], device: torch.device, exchange: Transport) -> list[list[Payload]]:
    """Every rank's ``payloads``, rank-major: ``result[rank][i]`` is rank's i-th payload."""
    tensors = [t for payload in payloads for t in payload]
    mine = packing.header(tensors)
    headers = exchange.all_gatherv(torch.tensor(mine, dtype=torch.int64, device=device), [len(mine)] * exchange.world)
    shapes = [packing.shapes(row, tensors) for row in read_rows(headers)]
    packed = exchange.all_gatherv(packing.pack(tensors, device), [packing.packed_bytes(s, tensors) for s in shapes])
    return [regroup(payloads, packing.unpack(raw, s, tensors)) for raw, s in zip(packed, shapes, strict=True)]


def all_gather_alike(
    payloads: list[Payload], device: torch.device, exchange: Transport, native: bool = True
) -> list[list[Payload]]:
    """:func:`all_gather_payloads` for payloads of the same shapes on every rank
    (``Capabilities.same_shapes``: fixed-size codes, exact top-k): one equal-size all-gather (the
    backend's, or with ``native`` False gradcomp's own), no size or shape exchange, and nothing read
    on the host."""
    packed = packing.pack([t for payload in payloads for t in payload], device)
    if not packed.numel():  # empty payloads (tensors of no elements): every rank's are these
        return [payloads] * exchange.world
    frames = exchange.all_gather(packed) if native else exchange.all_gatherv(packed, [packed.numel()] * exchange.world)
    return unpack_alike(frames, payloads)


def all_gather_alike_in_flight(
    payloads: list[Payload], device: torch.device, exchange: GroupTransport
) -> tuple[list[torch.futures.Future[Any]], Callable[[], list[list[Payload]]]]:
    """:func:`all_gather_alike` on the backend's all-gather, issued and left in flight: the backend's
    futures (none when nothing travels) and what gives every rank's payloads once they complete."""
    packed = packing.pack([t for payload in payloads for t in payload], device)
    if not packed.numel():
        return [], lambda: [payloads] * exchange.world
    frames, future = exchange.all_gather_in_flight(packed)
    return [future], lambda: unpack_alike(frames, payloads)


def unpack_alike(frames: list[Tensor], payloads: list[Payload]) -> list[list[Payload]]:
    """Every rank's payloads from its gathered frame, all shaped as this rank's ``payloads``."""
    tensors = [t for payload in payloads for t in payload]
    shapes = [tuple(t.shape) for t in tensors]
    return [regroup(payloads, packing.unpack(frame, shapes, tensors)) for frame in frames]


def all_gather_sized(
    payloads: list[Payload], shapes_known: Sequence[Sequence[tuple[int, ...]]], device: torch.device,
    exchange: Transport,
) -> list[list[Payload]]:  # fmt: skip
    """:func:`all_gather_payloads` for payloads whose shapes every rank knows already
    (``shapes_known[rank][i]``: the shape of each tensor of rank's i-th payload, from counts
    exchanged before, ``Compressor.measure``): one all-gather at those sizes, nothing read on the host."""
    tensors = [t for payload in payloads for t in payload]
    shapes = [[shape for shape, payload in zip(row, payloads, strict=True) for _ in payload] for row in shapes_known]
    sizes = [packing.packed_bytes(s, tensors) for s in shapes]
    frames = exchange.all_gatherv(packing.pack(tensors, device), sizes)
    return [regroup(payloads, packing.unpack(frame, s, tensors)) for frame, s in zip(frames, shapes, strict=True)]


ALL_GATHER = "the backend's all-gather of a bucket"

FRAME_HEAD = 8
"""Bytes before a frame's header: the int64 size of the whole frame this rank needs."""


def all_gather_padded(
    payloads: list[Payload], device: torch.device, exchange: Transport, capacity: int
) -> tuple[list[list[Payload]], int]:
    """:func:`all_gather_payloads` in one equal-size all-gather while every rank's frame fits in
    ``capacity`` bytes; returns every rank's payloads (rank-major) and the capacity for next time.

    A frame is [its size: int64][the shapes header: int64s][the packed payloads], padded to the
    capacity. A rank whose frame does not fit sends its size alone; every rank then sees every size,
    so all agree to gather again at the largest (which the caller keeps: a payload of fixed size
    costs one collective per bucket from the second step on). Padding travels: for payloads whose
    size varies a lot between steps (``threshold``) the two-collective :func:`all_gather_payloads`
    sends less."""
    tensors = [t for payload in payloads for t in payload]
    head = torch.tensor(packing.header(tensors), dtype=torch.int64)
    data_bytes = packing.packed_bytes([t.shape for t in tensors], tensors)
    needed = FRAME_HEAD + 8 * head.numel() + data_bytes
    capacity = packing.aligned(max(capacity, FRAME_HEAD))  # frames start at multiples of 8 when gathered
    for _ in range(2):
        frame = torch.empty(capacity, dtype=torch.uint8, device=device)
        frame[:FRAME_HEAD].view(torch.int64).fill_(needed)
        fits = needed <= capacity
        if fits:
            frame[FRAME_HEAD : FRAME_HEAD + 8 * head.numel()].view(torch.int64).copy_(head)
            packing.pack_into(tensors, frame[FRAME_HEAD + 8 * head.numel() :])
        frame[needed if fits else FRAME_HEAD :].zero_()  # the padding: nothing uninitialized travels
        frames = exchange.all_gather(frame)
        end = min(capacity, FRAME_HEAD + 8 * head.numel())  # each frame's size and header, where it fits
        heads = read_rows([f[:end].view(torch.int64) for f in frames])
        sizes = [h[0] for h in heads]
        if max(sizes) <= capacity:
            return [_unframe(f, h[1:], payloads, tensors) for f, h in zip(frames, heads, strict=True)], capacity
        capacity = packing.aligned(max(sizes))
    raise AssertionError("every frame fits the largest size in the second round")


def _unframe(frame: Tensor, header: list[int], payloads: list[Payload], like: list[Tensor]) -> list[Payload]:
    shapes = packing.shapes(header, like)
    return regroup(payloads, packing.unpack(frame[FRAME_HEAD + 8 * len(header) :], shapes, like))


def read_rows(rows: Sequence[Tensor]) -> list[list[int]]:
    """Integer tensors (headers, sizes) as lists, in one host read for them all."""
    values = host.values(torch.cat(list(rows)))
    return [values[start:stop] for start, stop in offsets([row.numel() for row in rows])]


def all_to_all_payloads(
    outgoing: Sequence[list[Payload] | None], device: torch.device, exchange: Transport
) -> list[list[Payload] | None]:
    """``outgoing[j]``: the payloads for rank j (the same structure for every j, not the same shapes);
    ``outgoing[rank]`` may be None when this rank keeps its own part (nothing travels to itself).
    Returns ``received[s]``: the payloads rank s sent here (None for this rank's own, if it kept it)."""
    world, rank = exchange.world, exchange.rank
    like = next((payloads for payloads in outgoing if payloads is not None), None)
    if like is None:  # a single rank keeping its own part: nothing to exchange
        return [None] * world
    template = [t for payload in like for t in payload]
    keeps_own = outgoing[rank] is None
    tensors = [[] if payloads is None else [t for payload in payloads for t in payload] for payloads in outgoing]
    mine = [packing.header(ts) for ts in tensors]
    sizes = [len(h) for h in mine]
    expected = [len(packing.header(template))] * world  # every peer sends here (the same structure)
    expected[rank] = sizes[rank]
    flat = torch.tensor([size for h in mine for size in h], dtype=torch.int64, device=device)
    headers = exchange.all_to_allv(flat, sizes, expected)
    # shapes[s]: what rank s sends here; None for this rank's own part when it keeps it
    rows = read_rows(headers)
    shapes = [None if s == rank and keeps_own else packing.shapes(row, template) for s, row in enumerate(rows)]
    splits = [packing.packed_bytes([t.shape for t in ts], ts) for ts in tensors]
    incoming = [0 if s is None else packing.packed_bytes(s, template) for s in shapes]
    data = torch.cat([packing.pack(ts, device) for ts in tensors])
    pieces = exchange.all_to_allv(data, splits, incoming)
    return [None if s is None else regroup(like, packing.unpack(pieces[r], s, template)) for r, s in enumerate(shapes)]


def regroup(payloads: list[Payload], flat: list[Tensor]) -> list[Payload]:
    """Cut a flat list of tensors back into payloads shaped like ``payloads``."""
    grouped, index = [], 0
    for payload in payloads:
        grouped.append(tuple(flat[index : index + len(payload)]))
        index += len(payload)
    return grouped
