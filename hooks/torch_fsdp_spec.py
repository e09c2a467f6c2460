"""The ``torch:NAME`` specs of sharded runs (FSDP2's own reductions), parsed without importing FSDP2:
checking a spec costs nothing a DDP user does not need (:mod:`gradcomp.hooks.torch_fsdp` runs them)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gradcomp.engine.spec import add_hook_names
from gradcomp.hooks.torch_hooks import PREFIX, is_torch_spec
from gradcomp.options import did_you_mean

REDUCE_DTYPES: dict[str, torch.dtype | None] = {"reduce_scatter": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""FSDP2's reductions by name (after ``torch:``), with the reduce dtype each sets (None: the gradient's)."""

add_hook_names({PREFIX + name: f"FSDP2's own reduce-scatter, {'uncompressed' if dtype is None else 'in ' + name}"
                for name, dtype in REDUCE_DTYPES.items()}, sharded=True)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TorchFSDPSpec:
    """A parsed ``torch:`` spec of a sharded run: FSDP2's own reduce-scatter, in a reduce dtype."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in REDUCE_DTYPES:
            valid = [PREFIX + n for n in REDUCE_DTYPES]
            hint = did_you_mean(PREFIX + self.name, valid)
            raise ValueError(
                f"unknown FSDP2 reduction {PREFIX + self.name!r}{hint}; valid in sharded runs: {', '.join(valid)}"
            )

    @classmethod
    def parse(cls, text: str) -> TorchFSDPSpec:
        if not is_torch_spec(text):
            raise ValueError(f"an FSDP2 reduction spec starts with {PREFIX!r}, got {text!r}")
        return cls(text.strip()[len(PREFIX) :])

    def __str__(self) -> str:
        return PREFIX + self.name

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return REDUCE_DTYPES[self.name]

    def policy(self) -> Any:
        """The ``MixedPrecisionPolicy`` to shard the model with (None: FSDP2's default)."""
        if self.reduce_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy  # FSDP2 itself: when a model is sharded

        return MixedPrecisionPolicy(reduce_dtype=self.reduce_dtype)
