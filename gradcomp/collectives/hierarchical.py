"""Hierarchical all-reduce for ranks grouped by machine (2D, as in Horovod and BlueConnect).

With groups of ``local_size`` consecutive ranks (one machine each, say): reduce-scatter inside each
group (ring), all-reduce each shard across groups among the ranks with the same local index, then
all-gather inside each group (ring). Only 1 / local_size of the data crosses between groups, where
links are usually slowest.

Cost with L = local_size, G = p / L groups, inter-group all-reduce by ring:
2 (L - 1) alpha_intra + 2 (L - 1) / L n beta_intra + 2 (G - 1) alpha_inter + 2 (G - 1) / G (n / L) beta_inter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from gradcomp.collectives import ring
from gradcomp.collectives.groups import subgroup
from gradcomp.collectives.link import Link
from gradcomp.collectives.ops import ReduceOp

_subgroups: dict[tuple[str, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def subgroups(group: dist.ProcessGroup | None, local_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(intra, inter) process groups of this rank, created once per (group, local_size).

    Every rank of ``group`` must reach the first call for a (group, local_size) at the same point of
    its program, as for any collective; only the members of each subgroup synchronize.
    """
    parent = group if group is not None else dist.group.WORLD
    assert parent is not None
    key = (dist.get_backend(parent) + ":" + parent.group_name, local_size)
    if key not in _subgroups:
        size, rank = dist.get_world_size(parent), dist.get_rank(parent)
        members = [dist.get_global_rank(parent, r) if group is not None else r for r in range(size)]
        machine, local = divmod(rank, local_size)
        intra_ranks = members[machine * local_size : (machine + 1) * local_size]
        inter_ranks = members[local::local_size]
        _subgroups[key] = (subgroup(group, intra_ranks), subgroup(group, inter_ranks))
    return _subgroups[key]


def check_local_size(world_size: int, local_size: int) -> None:
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"local_size must be >= 1 and divide the world size {world_size}, got {local_size}")


def all_reduce(
    link: Link,
    flat: Tensor,
    op: ReduceOp,
    local_size: int,
    inter: Callable[[Link, Tensor, ReduceOp, int], None],
    segment_bytes: int = ring.SEGMENT_BYTES,
) -> None:
    """In place; ``inter`` (a flat all-reduce: ring, tree or halving-doubling) all-reduces the shards
    across groups."""
    check_local_size(link.size, local_size)
    if link.size == 1:
        return
    intra_group, inter_group = subgroups(link.group, local_size)
    intra, across = Link(intra_group), Link(inter_group)
    bounds = ring.chunk_bounds(flat.numel(), local_size)
    ring.reduce_scatter(intra, flat, op, bounds, segment_bytes)
    start, stop = bounds[intra.rank]
    inter(across, flat[start:stop], op, segment_bytes)
    ring.all_gather(intra, flat, bounds, segment_bytes)
    link.traffic += intra.traffic
    link.traffic += across.traffic
