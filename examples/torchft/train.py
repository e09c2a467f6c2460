"""Compressed, fault-tolerant data parallelism: gradcomp's hook on torchft's replica groups.

Run a lighthouse, then one ``torchrun`` per replica group (each with a store of its own); kill a
group at any time and start it again: the others go on, and it heals from them and rejoins.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 &
    REPLICA_GROUP_ID=0 TORCHFT_LIGHTHOUSE=http://localhost:29510 torchrun --nproc_per_node 1 \\
        --master_port 29600 examples/torchft/train.py --steps 200
    REPLICA_GROUP_ID=1 TORCHFT_LIGHTHOUSE=http://localhost:29510 torchrun --nproc_per_node 1 \\
        --master_port 29601 examples/torchft/train.py --steps 200

Each group trains on its own share of a synthetic classification task (generated, nothing
downloaded) and prints its step, loss and how many groups the step was averaged over. With
``--sync diloco:every=20,fragments=2,delay=1,early=true`` the groups train apart and synchronize
every ``every / fragments`` steps instead (gradcomp's DiLoCo on the manager, ``--spec`` the outer
gradients' compressor): a quorum at each synchronization only.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
import torchft
import torchft.optim
from torch import nn

from gradcomp.hooks.fault_tolerant import DistributedDataParallel
from gradcomp.sync import fault_tolerant


def command_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--spec", default="topk:ratio=0.01,ef=true", help="a gradcomp hook spec")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--min-groups", type=int, default=1, help="the fewest replica groups a step needs")
    parser.add_argument("--sync", help="a sync spec (DiLoCo, local SGD) instead of averaging every step")
    return parser


def main() -> None:
    args = command_parser().parse_args()
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))

    torch.manual_seed(0)  # the same initial model in every group (it is synced from a peer at step 0 too)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    teacher = nn.Linear(64, 10)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=args.min_groups,
                              load_state_dict=None, state_dict=None, replica_id=f"train_{group}",
                              use_async_quorum=args.sync is None)  # DiLoCo: a healed group syncs at once
    if args.sync is not None:
        diloco(manager, net, teacher, group, args)
        return
    model = DistributedDataParallel(manager, net, args.spec)
    optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.05))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optimizer.load_state_dict, optimizer.state_dict)

    data = torch.Generator().manual_seed(1000 + group)
    while manager.current_step() < args.steps:
        x = torch.randn(64, 64, generator=data)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        optimizer.zero_grad()  # the step's quorum
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # every bucket averaged by gradcomp over the quorum's groups
        optimizer.step()  # only where every group's averaging succeeded
        if manager.current_step() % 20 == 0:
            print(f"group {group} step {manager.current_step()} loss {loss.item():.4f} "
                  f"groups {manager.num_participants()}", flush=True)  # fmt: skip
    manager.shutdown()  # waits for its threads: a process that exits past them aborts


def diloco(manager: torchft.Manager, net: nn.Module, teacher: nn.Module, group: int, args: argparse.Namespace) -> None:
    """``--sync``: inner steps apart, a synchronization (and its quorum) every every / fragments steps."""
    inner = torch.optim.SGD(net.parameters(), lr=0.05)
    manager.register_state_dict_fn("model", net.load_state_dict, net.state_dict)
    manager.register_state_dict_fn("inner", inner.load_state_dict, inner.state_dict)
    outer = fault_tolerant.FaultTolerantSynchronizer(manager, net, args.sync, args.spec, optimizer=inner)
    period = outer.sync.every // outer.sync.fragments
    data = torch.Generator().manual_seed(1000 + group)
    while manager.current_step() * period + outer.phase < args.steps:  # inner steps, as the groups count them
        x = torch.randn(64, 64, generator=data)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        inner.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        inner.step()
        outer.step()  # every every / fragments steps: the quorum, then the outer gradient averaged
        if outer.phase == 0 and manager.current_step() % 5 == 0:
            print(f"group {group} step {manager.current_step() * period} loss {loss.item():.4f} "
                  f"groups {outer.world}", flush=True)  # fmt: skip
    outer.flush()
    manager.shutdown()


if __name__ == "__main__":
    main()
