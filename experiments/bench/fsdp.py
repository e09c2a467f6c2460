"""``gradcomp bench fsdp``: FSDP2 step time with gradcomp's reduce-scatter beside FSDP2's own, per network.

    gradcomp bench fsdp --model mlp --ranks 2 --net loopback,1gbit --hooks "quantize:bits=4,ef=true;sign:ef=true"

``gradcomp bench ddp`` for sharded training (:mod:`gradcomp.experiments.bench.ddp` says how it
measures: the same rounds, medians and tables). Every variant shards its own copy of the model with
FSDP2, as training runs do (:mod:`gradcomp.experiments.training.parallel`: each layer and the root).
The anchors: ``noop`` (no reduce-scatter: each rank keeps its own shard of the gradient, the compute
floor; FSDP2 still all-gathers parameters) and ``torch:reduce_scatter`` (FSDP2's default, in float32);
by default also ``torch:bf16`` (FSDP2 with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``).
gradcomp's variants are sharded specs (``docs/fsdp.md``). Wire bytes per rank and step: measured by
gradcomp's all-to-all, else (FSDP2's and the casts' reduce-scatters) what a ring reduce-scatter sends,
(p - 1) / p of the payload.
"""

from __future__ import annotations

import argparse

from gradcomp.experiments.bench.command import add_parser
from gradcomp.experiments.bench.modes import FSDP


def add_command(commands: argparse._SubParsersAction) -> None:
    """``gradcomp bench fsdp`` (an entry point of the ``gradcomp.bench`` group)."""
    add_parser(commands, FSDP, "FSDP2 step time: gradcomp's reduce-scatter beside FSDP2's own, per network")
