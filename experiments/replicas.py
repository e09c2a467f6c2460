"""A replica group of one rank on torchft, as the fault study, the fault-tolerant benchmark and the
tests make them (the ``torchft`` extra).

Each group's manager serves a store of its own and advertises ``address``: where its peers reach it
(``localhost`` on loopback; its namespace's address on an emulated network, where the machine's host
name, torchft's default, would point a healing peer back at itself). Every group starts from the same
seeded model, so nothing heals at step 0 (``init_sync=False``).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist


def one_rank_group(replica_id: str, lighthouse: str, *, min_groups: int, timeout: float, synchronous: bool,
                   address: str = "localhost") -> Any:  # fmt: skip
    """torchft's ``Manager`` of a replica group of one rank under ``lighthouse``: its collectives,
    quorums and healing bounded by ``timeout`` seconds; ``synchronous`` quorums for local SGD and
    DiLoCo (a group healed at a quorum takes part in it), asynchronous for DDP (formed while the
    step's forward runs). The store lives as long as the manager (``manager.kept_store``)."""
    import torchft

    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
    seconds = datetime.timedelta(seconds=timeout)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=seconds), min_replica_size=min_groups, load_state_dict=None,
        state_dict=None, replica_id=replica_id, store_addr=address, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, hostname=address, timeout=seconds, quorum_timeout=seconds, connect_timeout=seconds,
        checkpoint_transport=_checkpoint_transport(address, seconds), use_async_quorum=not synchronous,
        init_sync=False,
    )  # fmt: skip
    manager.kept_store = store
    return manager


def _checkpoint_transport(address: str, timeout: datetime.timedelta) -> Any:
    """torchft's HTTP checkpoint transport, serving healing groups at ``address``."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Addressed(HTTPTransport):
        def address(self) -> str:
            return f"http://{address}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Addressed(timeout=timeout, num_chunks=0)
