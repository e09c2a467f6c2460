"""``gradcomp bench hsdp``: HSDP step time with gradcomp's all-reduce across nodes beside FSDP2's own HSDP.

    gradcomp bench hsdp --model mlp --ranks 4 --net "nodes=2x2,intra=10gbit,inter=100mbit" \
        --hooks "quantize:bits=4,ef=true"

``gradcomp bench ddp`` for hybrid sharding (:mod:`gradcomp.experiments.bench.ddp` says how it
measures). Every variant shards its own copy of the model with FSDP2 over each node's ranks, as
training runs do (``--parallel hsdp``); gradcomp's variants average the node's shards across nodes
through a hook spec (:func:`gradcomp.hooks.hsdp`), the anchor ``torch:reduce_scatter`` is FSDP2's own
HSDP (its 2-D mesh: the shards all-reduced across nodes in float32), ``torch:bf16`` the same in
bf16. ``noop`` reduce-scatters inside the node and sends nothing across. The nodes are an emulated
cluster's (``--net nodes=NxL,...``) or the launcher's (``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import argparse

from gradcomp.experiments.bench.command import add_parser
from gradcomp.experiments.bench.modes import HSDP


def add_command(commands: argparse._SubParsersAction) -> None:
    """``gradcomp bench hsdp`` (an entry point of the ``gradcomp.bench`` group)."""
    add_parser(commands, HSDP, "HSDP step time: gradcomp's all-reduce across nodes beside FSDP2's own HSDP")
