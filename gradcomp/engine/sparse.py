"""Sparse gradients: what the engine does with a bucket whose buffer is a sparse COO tensor.

An ``nn.Embedding(sparse=True)`` or ``nn.EmbeddingBag(sparse=True)`` gives its weight a sparse
gradient (the rows a batch touched); DDP hands each such parameter to the hook in a bucket of its
own, whose ``buffer()`` is that sparse tensor. Its averaged result is what torch's ``allreduce_hook``
and DDP's default make of it: divided by the world size, then the backend's sparse all-reduce (gloo
all-gathers every rank's indices and values and sums them; the result is coalesced). Specs that send
the gradient as it is (``allreduce``, the casts) average a sparse bucket so, bitwise DDP's default;
the casts do not cast it (gloo's sparse sum is not implemented for fp16 and, measured here with
torch 2.13, doubles a bf16 sum), so it travels at the gradient's own precision: exact, at the bytes
of the rows touched. A compressor (top-k, quantizers, PowerSGD, ...) and error feedback work on dense
buffers: they are refused, at registration where the hook sees the model (``gradcomp.hooks``), else
at the first sparse bucket, by :func:`refusal`'s message.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp.engine.spec import HookSpec
from gradcomp.errors import backend_failure

AVERAGES_SPARSE = ("none", "fp16", "bf16")
"""The compressors whose hooks average a sparse gradient (``none`` is ``allreduce``'s): as it is."""


def refusal(spec: object, where: str = "") -> str | None:
    """Why ``spec`` cannot average a sparse gradient (None: it can), as one line that says what to
    do; ``where`` names the modules that make one (``nn.Embedding(sparse=True) at 'embed'``). Only a
    DDP hook's spec (:class:`HookSpec`) that sends gradients as they are can: any other (``auto``,
    a sharded spec) is refused."""
    if isinstance(spec, HookSpec):
        compressor = spec.compressor
        if compressor is None or (compressor.name in AVERAGES_SPARSE and compressor.feedback.variant is None):
            return None
    source = f" ({where})" if where else ""
    return (
        f"this model has sparse gradients{source}, and {str(spec)!r} cannot average them: it compresses "
        "dense buffers. Use 'allreduce' (or 'fp16' / 'bf16', which send a sparse gradient as 'allreduce' "
        "does), or make the embedding dense (sparse=False) to compress it"
    )


def payload_bytes(gradient: Tensor) -> int:
    """What this rank's sparse gradient puts on the wire: its indices and its values."""
    indices, values = gradient._indices(), gradient._values()
    return indices.numel() * indices.element_size() + values.numel() * values.element_size()


def all_reduce(gradient: Tensor, group: dist.ProcessGroup, rank: int, world: int) -> Tensor:
    """The average of every rank's sparse ``gradient`` over ``group``, as DDP's default makes it:
    divided by the world size (in place, as DDP does), then the backend's sparse all-reduce (a
    collective: call it on the ordered executor)."""
    gradient.div_(world)
    try:
        work = dist.all_reduce(gradient, group=group, async_op=True)
        work.wait()
    except RuntimeError as error:
        raise backend_failure("the backend's sparse all-reduce of a bucket", rank, world, error) from error
    (summed,) = work.get_future().value()
    assert isinstance(summed, torch.Tensor)
    return summed
