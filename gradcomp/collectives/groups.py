"""Process groups gradcomp creates, each bounded by the timeout of the group it derives from.

``torch.distributed.new_group`` without a timeout takes the backend's default (30 minutes on
gloo), whatever the user gave ``init_process_group``: a frozen or failed peer would then block the
engine's collectives for half an hour. Every group gradcomp creates goes through :func:`subgroup`,
so every wait on it is bounded by the user's timeout (rule "bounded waits", ``docs/architecture.md``).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence

import torch.distributed as dist

from gradcomp.errors import PeerError


def as_timeout(value: datetime.timedelta | float | None, what: str = "timeout") -> datetime.timedelta | None:
    """A timeout as given by a user: a ``timedelta`` or a number of seconds, positive and finite
    (None: the group's own). Anything else is refused here, naming ``what``, rather than failing
    later as an AttributeError or as a peer that seems not to answer (a zero timeout)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (datetime.timedelta, int, float)):
        raise TypeError(f"{what} must be a datetime.timedelta or a number of seconds, got {value!r}")
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{what} must be a positive, finite time, got {value!r}")
    return value if isinstance(value, datetime.timedelta) else datetime.timedelta(seconds=seconds)


def rank_of(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world), also for a group that
    ``torch.distributed`` does not know (one a library made and reconfigures itself: torchft's)."""
    if group is None:
        return dist.get_rank()
    # torchft's reconfigurable groups wrap the group of the current quorum (``parent``) and answer
    # size() from it, but not rank(): theirs is the base class's, 0 on every rank
    inner = getattr(group, "parent", None)
    return (inner if isinstance(inner, dist.ProcessGroup) else group).rank()


def size_of(group: dist.ProcessGroup | None = None) -> int:
    """How many ranks ``group`` (default: the world) has, as :func:`rank_of` reads it."""
    return dist.get_world_size() if group is None else group.size()


def registered(group: dist.ProcessGroup | None) -> bool:
    """Whether ``torch.distributed`` knows ``group`` (the world, or a group ``new_group`` made): its
    functions that map group ranks to global ones (point-to-point, ``get_global_rank``) need it."""
    return group is None or group in dist.distributed_c10d._world.pg_map


def timeout_of(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """The timeout every operation on ``group`` (default: the world) is bounded by."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "no default process group: call torch.distributed.init_process_group first"
    try:
        # torch keeps it in the backend's options; there is no public accessor (torch 2.3-2.13)
        timeout: datetime.timedelta = pg._get_backend(pg._device_types[0]).options._timeout
        return timeout
    except (AttributeError, IndexError, RuntimeError):
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(pg))


def subgroup(
    parent: dist.ProcessGroup | None,
    ranks: Sequence[int] | None = None,
    *,
    timeout: datetime.timedelta | float | None = None,
    purpose: str = "gradcomp's collectives",
) -> dist.ProcessGroup:
    """A new process group of ``ranks`` (global ranks; None: every rank of ``parent``, default the
    world), with ``timeout`` or else ``parent``'s. Every rank of the world must call it in the same
    order when ``ranks`` is None (torch's rule for ``new_group``); otherwise only the members
    synchronize. A member that never comes is a :class:`PeerError` after the timeout, which says
    what the group was for (``purpose``)."""
    if ranks is None and parent is not None:
        ranks = [dist.get_global_rank(parent, r) for r in range(dist.get_world_size(parent))]
    timeout = as_timeout(timeout) or timeout_of(parent)
    try:
        return dist.new_group(
            list(ranks) if ranks is not None else None, timeout=timeout, use_local_synchronization=ranks is not None
        )
    except RuntimeError as error:  # DistError and gloo's timeouts are RuntimeErrors
        members = list(ranks) if ranks is not None else list(range(dist.get_world_size()))
        raise PeerError(
            f"creating a process group of ranks {members} for {purpose} failed (timeout "
            f"{timeout.total_seconds():g} s): "
            "each of them must create it, in the same order; a rank running another hook (noop creates "
            f"none), or a frozen or failed rank? {error}"
        ) from error


_private: dict[tuple[str, float], dist.ProcessGroup] = {}


def private(parent: dist.ProcessGroup | None, timeout: datetime.timedelta | float | None = None) -> dist.ProcessGroup:
    """gradcomp's own group with the ranks of ``parent`` (default: the world), created once per parent
    and timeout and shared by every engine on it: its collectives never interleave with the user's
    (DDP's) on ``parent``, and among themselves they are ordered by the one executor.

    Shared rather than one per engine: a process that makes many hooks makes no more groups, and no
    group is ever destroyed and made again (torch names a group of some ranks after those ranks, so
    a new one would find the old one's keys in the store).
    """
    pg = parent if parent is not None else dist.group.WORLD
    assert pg is not None, "no default process group: call torch.distributed.init_process_group first"
    timeout = as_timeout(timeout) or timeout_of(parent)
    key = (dist.distributed_c10d._get_process_group_name(pg), timeout.total_seconds())
    if key not in _private or _private[key] not in dist.distributed_c10d._world.pg_map:  # (a new world)
        world = pg is dist.group.WORLD  # all ranks: created by all, named by a counter
        _private[key] = subgroup(None if world else parent, timeout=timeout, purpose="gradcomp's hooks")
    return _private[key]
