"""Reduction operators: how two partial results combine, in place."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import Tensor


class ReduceOp(str, enum.Enum):
    """The reductions every gradcomp all-reduce supports. ``avg`` sums, then divides once."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"

    @classmethod
    def parse(cls, op: ReduceOp | str | dist.ReduceOp) -> ReduceOp:
        if isinstance(op, cls):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(o.value for o in cls)}") from None
        for ours, theirs in _TORCH.items():
            if op == theirs:
                return ours
        raise ValueError(f"unsupported reduce op {op!r}; valid: {', '.join(o.value for o in cls)}")

    def combine(self, accumulator: Tensor, incoming: Tensor) -> None:
        """accumulator <- accumulator (op) incoming, element-wise and in place."""
        if self in (ReduceOp.SUM, ReduceOp.AVG):
            accumulator.add_(incoming)
        elif self is ReduceOp.PRODUCT:
            accumulator.mul_(incoming)
        elif self is ReduceOp.MIN:
            torch.minimum(accumulator, incoming, out=accumulator)
        else:
            torch.maximum(accumulator, incoming, out=accumulator)

    def finish(self, result: Tensor, world_size: int) -> None:
        """What follows the reduction: ``avg`` divides by the number of contributions, once."""
        if self is ReduceOp.AVG:
            result.div_(world_size)

    def check(self, tensor: Tensor) -> None:
        if self is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"avg needs a floating-point tensor, got {tensor.dtype}; use sum and divide yourself")

    def to_torch(self) -> dist.ReduceOp.RedOpType:
        """The backend's operator (``avg`` is computed as ``sum`` and a division, which gloo needs)."""
        return _TORCH[ReduceOp.SUM if self is ReduceOp.AVG else self]


_TORCH: dict[ReduceOp, dist.ReduceOp.RedOpType] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}
