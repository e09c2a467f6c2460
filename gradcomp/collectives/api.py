"""The public collectives: argument checks in the caller's thread, the work on the ordered executor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp.collectives import exchange, halving_doubling, hierarchical, ring, tree
from gradcomp.collectives.executor import Handle, executor
from gradcomp.collectives.groups import rank_of, size_of
from gradcomp.collectives.link import Link, Traffic
from gradcomp.collectives.ops import ReduceOp
from gradcomp.errors import backend_failure

FlatAllReduce = Callable[[Link, Tensor, ReduceOp, int], None]
"""An all-reduce over one flat group of ranks: ``(link, flat tensor, op, segment bytes)``, in place."""

FLAT_ALGORITHMS: dict[str, FlatAllReduce] = {
    "ring": ring.all_reduce,
    "tree": tree.all_reduce,
    "halving_doubling": halving_doubling.all_reduce,
}
"""gradcomp's own all-reduce algorithms over one flat group, by name; ``hierarchical`` runs one of
them across groups (its ``inter``)."""

ALGORITHMS = ("native", *FLAT_ALGORITHMS, "hierarchical")
"""Every all-reduce algorithm, by name: the backend's own, gradcomp's flat ones, and hierarchical."""

T = TypeVar("T")
Group = dist.ProcessGroup | None


def _run(operation: Callable[[], tuple[T, Traffic | None]], async_op: bool) -> Handle[T]:
    return executor().submit(operation, wait=not async_op)


def _check_tensor(tensor: object, name: str = "tensor") -> Tensor:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _check_blocks(name: str, whole: Tensor, block: Tensor, world: int) -> None:
    if whole.numel() != world * block.numel() or whole.dtype != block.dtype:
        raise ValueError(
            f"{name} needs {world} blocks of {block.numel()} elements in the whole tensor and one dtype; "
            f"got {whole.numel()} {whole.dtype} elements for blocks of {block.dtype}"
        )


def _in_place(tensor: Tensor, body: Callable[[Tensor], None]) -> None:
    """Run ``body`` on a contiguous flat view of ``tensor`` (a copy, written back, if need be)."""
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    body(flat)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))


def all_reduce(
    tensor: Tensor,
    op: ReduceOp | str = "sum",
    *,
    algo: str = "ring",
    group: Group = None,
    async_op: bool = False,
    local_size: int | None = None,
    inter: str = "ring",
    segment_bytes: int = ring.SEGMENT_BYTES,
) -> Handle[Tensor]:
    """Reduce ``tensor`` over every rank of ``group``, in place; the handle's ``wait()`` returns it.

    Args:
        op: sum, avg (floating tensors), min, max or product.
        algo: one of :data:`ALGORITHMS`. ``hierarchical`` needs ``local_size`` (ranks per group,
            dividing the world size) and all-reduces across groups with ``inter`` (ring,
            halving_doubling or tree).
        async_op: return at once; otherwise the returned handle has completed.
        segment_bytes: message size of ring and halving-doubling (large tensors travel in segments,
            so that reductions overlap transfers).
    """
    _check_tensor(tensor)
    reduce_op = ReduceOp.parse(op)
    reduce_op.check(tensor)
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algo!r}; valid: {', '.join(ALGORITHMS)}")
    if segment_bytes < 1:
        raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
    world = size_of(group)
    if algo == "hierarchical":
        if local_size is None:
            raise ValueError("algo='hierarchical' needs local_size, the number of ranks per group")
        hierarchical.check_local_size(world, local_size)
        if inter not in FLAT_ALGORITHMS:
            raise ValueError(f"unknown inter-group algorithm {inter!r}; valid: {', '.join(FLAT_ALGORITHMS)}")

    def operation() -> tuple[Tensor, Traffic | None]:
        link = Link(group)
        traffic: Traffic | None = link.traffic

        def body(flat: Tensor) -> None:
            nonlocal traffic
            if algo == "native":
                try:
                    dist.all_reduce(flat, op=reduce_op.to_torch(), group=group)
                except RuntimeError as error:
                    raise backend_failure("the backend's all-reduce", link.rank, link.size, error) from error
                traffic = None
            elif algo == "hierarchical":
                assert local_size is not None
                hierarchical.all_reduce(link, flat, reduce_op, local_size, FLAT_ALGORITHMS[inter], segment_bytes)
            else:
                FLAT_ALGORITHMS[algo](link, flat, reduce_op, segment_bytes)
            reduce_op.finish(flat, world)

        _in_place(tensor, body)
        return tensor, traffic

    return _run(operation, async_op)


def reduce_scatter(
    output: Tensor, input: Tensor, op: ReduceOp | str = "sum", *, group: Group = None, async_op: bool = False
) -> Handle[Tensor]:
    """``output`` (n elements) receives this rank's n-element block of the reduction of ``input``
    (p * n elements, rank order). Ring: (p - 1) / p of the input sent per rank. ``input`` is unchanged."""
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    reduce_op = ReduceOp.parse(op)
    reduce_op.check(input)
    world = size_of(group)
    _check_blocks("reduce_scatter", whole=input, block=output, world=world)

    def operation() -> tuple[Tensor, Traffic | None]:
        link = Link(group)
        work = input.reshape(-1).clone()
        bounds = exchange.offsets([output.numel()] * world)
        ring.reduce_scatter(link, work, reduce_op, bounds)
        start, stop = bounds[link.rank]
        mine = work[start:stop]
        reduce_op.finish(mine, world)
        output.copy_(mine.view(output.shape))
        return output, link.traffic

    return _run(operation, async_op)


def all_gather(output: Tensor, input: Tensor, *, group: Group = None, async_op: bool = False) -> Handle[Tensor]:
    """``output`` (p * n elements) receives every rank's ``input`` (n elements), in rank order."""
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    world = size_of(group)
    _check_blocks("all_gather", whole=output, block=input, world=world)

    def operation() -> tuple[Tensor, Traffic | None]:
        link = Link(group)
        _in_place(output, lambda flat: exchange.all_gather_into(link, flat, input, [input.numel()] * world))
        return output, link.traffic

    return _run(operation, async_op)


def all_gatherv(
    input: Tensor, sizes: Sequence[int] | None = None, *, group: Group = None, async_op: bool = False
) -> Handle[list[Tensor]]:
    """Every rank's ``input`` (any number of elements each), flattened, as a list in rank order.

    Unless every rank's element count is given as ``sizes``, the sizes travel first (one int64 per
    rank), then the data around the ring. For sparse payloads, whose size differs between ranks.
    """
    _check_tensor(input, "input")
    if sizes is not None:
        world = size_of(group)
        if len(sizes) != world or min(sizes) < 0:
            raise ValueError(f"sizes must be {world} non-negative element counts, got {list(sizes)}")
        if sizes[rank_of(group)] != input.numel():
            raise ValueError(
                f"sizes says this rank has {sizes[rank_of(group)]} elements, input has {input.numel()}"
            )

    def operation() -> tuple[list[Tensor], Traffic | None]:
        link = Link(group)
        counts = list(sizes) if sizes is not None else exchange.gather_sizes(link, input.numel(), input.device)
        output = torch.empty(sum(counts), dtype=input.dtype, device=input.device)
        exchange.all_gather_into(link, output, input, counts)
        return [output[start:stop] for start, stop in exchange.offsets(counts)], link.traffic

    return _run(operation, async_op)


def all_to_all(output: Tensor, input: Tensor, *, group: Group = None, async_op: bool = False) -> Handle[Tensor]:
    """Block j of ``input`` (p equal blocks) goes to rank j; block i of ``output`` comes from rank i."""
    _check_tensor(output, "output")
    _check_tensor(input, "input")
    world = size_of(group)
    if input.numel() != output.numel() or input.numel() % world or input.dtype != output.dtype:
        raise ValueError(
            f"all_to_all needs input and output of the same dtype and size, a multiple of {world}; "
            f"got {input.numel()} {input.dtype} and {output.numel()} {output.dtype}"
        )
    block = input.numel() // world

    def operation() -> tuple[Tensor, Traffic | None]:
        link = Link(group)
        source = input.reshape(-1).contiguous()
        _in_place(output, lambda flat: exchange.all_to_all_into(link, flat, source, [block] * world, [block] * world))
        return output, link.traffic

    return _run(operation, async_op)


def all_to_allv(
    input: Tensor,
    input_splits: Sequence[int],
    output_splits: Sequence[int] | None = None,
    *,
    group: Group = None,
    async_op: bool = False,
) -> Handle[Tensor]:
    """Send ``input_splits[j]`` elements of the flat ``input`` to rank j (in order); return the
    concatenation of what every rank sent here. Without ``output_splits`` the sizes travel first."""
    _check_tensor(input, "input")
    world = size_of(group)
    splits = [int(s) for s in input_splits]
    if len(splits) != world or min(splits, default=0) < 0 or sum(splits) != input.numel():
        raise ValueError(
            f"input_splits must be {world} non-negative sizes adding up to input's {input.numel()} elements, "
            f"got {list(input_splits)}"
        )
    if output_splits is not None and (len(output_splits) != world or min(output_splits, default=0) < 0):
        raise ValueError(f"output_splits must be {world} non-negative sizes, got {list(output_splits)}")

    def operation() -> tuple[Tensor, Traffic | None]:
        link = Link(group)
        incoming = (
            exchange.exchange_split_sizes(link, splits, input.device)
            if output_splits is None
            else [int(s) for s in output_splits]
        )
        output = torch.empty(sum(incoming), dtype=input.dtype, device=input.device)
        exchange.all_to_all_into(link, output, input.reshape(-1).contiguous(), splits, incoming)
        return output, link.traffic

    return _run(operation, async_op)


def broadcast(tensor: Tensor, src: int = 0, *, group: Group = None, async_op: bool = False) -> Handle[Tensor]:
    """Every rank's ``tensor`` becomes rank ``src``'s (a group rank), by binomial tree."""
    _check_tensor(tensor)
    world = size_of(group)
    if not 0 <= src < world:
        raise ValueError(f"src must be a rank of the group, 0..{world - 1}, got {src}")

    def operation() -> tuple[Tensor, Traffic | None]:
        link = Link(group)
        _in_place(tensor, lambda flat: tree.broadcast(link, flat, src))
        return tensor, link.traffic

    return _run(operation, async_op)
