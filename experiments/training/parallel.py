"""How a run spreads its model over the ranks: DDP's replicas, FSDP2's shards, or replicas that
synchronize every few steps (local SGD, DiLoCo).

``--parallel ddp`` (the default): every rank holds the whole model and optimizer state, and DDP
averages gradients through the hook (a DDP communication hook spec). ``--parallel fsdp``: FSDP2
shards parameters, gradients and optimizer state; the model is cut into units (:func:`units`),
each all-gathered for its forward and backward and its gradients reduce-scattered through the hook,
here a sharded spec (gradcomp's compressed reduce-scatter, or FSDP2's own: ``torch:reduce_scatter``,
``torch:bf16``, ``torch:fp16``). ``--parallel hsdp``: FSDP2 shards inside each node (the launcher's
``LOCAL_WORLD_SIZE`` ranks: an emulated cluster's or torchrun's), and the hook, a DDP hook spec,
averages the node's gradient shards across nodes (:func:`gradcomp.hooks.hsdp`); FSDP2's own HSDP
(its 2-D mesh, all-reduced uncompressed) as ``torch:reduce_scatter`` and the like.
``--sync localsgd:...`` or ``diloco:...``: every rank trains its own replica, no DDP, and a
:class:`gradcomp.sync.Synchronizer` averages outer gradients through the hook spec every few steps
(:class:`Local`). :func:`make` builds any of them; the training loop and
checkpoints talk to all through the same few methods.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks, netem
from gradcomp.collectives.hierarchical import subgroups
from gradcomp.engine.hierarchical import LAUNCHER_LAYOUT, check_local_size
from gradcomp.experiments.tasks.base import Batch, batches
from gradcomp.hooks import torch_hooks
from gradcomp.hooks.torch_hooks import TorchHookSpec
from gradcomp.state import TrainingHookState
from gradcomp.sync import Synchronizer, SyncSpec

PARALLELS = ("ddp", "fsdp", "hsdp")
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.TransformerEncoder, nn.TransformerDecoder)
"""Modules that only hold others: FSDP2 units are cut inside them, not around them."""


class Placement:
    """How the model is placed over the ranks; what every placement shares: nothing to do after an
    optimizer step, and the model itself to evaluate."""

    module: nn.Module

    def after_step(self, last: bool) -> None:
        """Called after every optimizer step (``last``: the run's final one)."""

    def evaluated(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The model to evaluate, for the ``with`` block."""
        return contextlib.nullcontext(self.module)


class Replicated(Placement):
    """DDP: the model on every rank; the hook averages gradients."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.module = model
        self.forward = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)

    def register(self, spec: Any, seed: int, optimizer: torch.optim.Optimizer) -> TrainingHookState:
        if isinstance(optimizer, hooks.CompressedAdamW):  # its own hook: ``spec`` until the freeze, then none
            return optimizer.attach(self.forward, spec)
        if isinstance(spec, TorchHookSpec):
            return torch_hooks.register(self.forward, spec, seed=seed)
        return hooks.register(self.forward, spec)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Backward without communication (the compute-only step time)."""
        return self.forward.no_sync()

    def model_state(self) -> dict[str, Any]:
        return self.module.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load(self, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        self.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    def eval_batches(self, x: Tensor, y: Tensor, size: int, total: int) -> Iterator[Batch]:
        return batches(x, y, size)


class Sharded(Placement):
    """FSDP2: each unit of the model (:func:`units`) and the root sharded over the ranks of ``mesh``
    (default: all of them); the hook reduce-scatters gradients. Forwards are collectives (each unit
    all-gathers its parameters), so every rank runs as many as every other, evaluation included
    (:meth:`eval_batches`). With ``replicate`` (HSDP: ``mesh`` a node's), the hook averages the
    node's shards across that group (:func:`gradcomp.hooks.hsdp`)."""

    def __init__(self, model: nn.Module, policy: Any = None, mesh: Any = None, replicate: Any = None) -> None:
        self.module = self.forward = shard(model, policy, mesh)
        self.replicate = replicate

    def register(self, spec: Any, seed: int, optimizer: torch.optim.Optimizer) -> TrainingHookState:
        if self.replicate is not None:
            return hooks.hsdp(self.module, spec, replicate=self.replicate)
        return hooks.register(self.module, spec)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return _without_gradient_sync(self.module)

    def model_state(self) -> dict[str, Any]:
        """The whole model's state on rank 0, on the CPU (a collective: all ranks call it)."""
        return _whole_model(self.module)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return _whole_optimizer(self.module, optimizer)

    def load(self, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Every rank takes its shards of the saved whole states (each rank read the file)."""
        _load_whole(self.module, optimizer, saved["model"], saved["optimizer"])

    def eval_batches(self, x: Tensor, y: Tensor, size: int, total: int) -> Iterator[Batch]:
        """This rank's share of ``total`` samples in as many batches as every other rank's (the
        largest share's count of ``size``, the last ones possibly shorter or empty)."""
        count = math.ceil(math.ceil(total / torch.distributed.get_world_size()) / size)
        return zip(x.tensor_split(count), y.tensor_split(count), strict=True)


class Local(Placement):
    """Infrequent synchronization (``gradcomp.sync``): each rank trains its own replica, and the
    synchronizer (the run's hook state) averages outer gradients through the hook spec every few
    steps. Replicas differ between synchronizations, so checkpoints hold every rank's model and
    optimizer; evaluation uses the global parameters, the same on every rank. With the sync spec's
    ``local_size``, a replica per node: DDP inside it, or FSDP2 (``sharded``: each rank synchronizes
    its shard, and checkpoints hold each node's whole replica)."""

    def __init__(self, model: nn.Module, sync: SyncSpec, device: torch.device, sharded: bool = False) -> None:
        self.module: nn.Module = model
        self.forward: nn.Module = model
        self.sync = sync
        self.synchronizer: Synchronizer | None = None
        self.across: torch.distributed.ProcessGroup | None = None
        self.local = sync.local_size if sync.local_size > 1 else 1
        self.sharded = sharded
        if sharded:  # a replica per node, FSDP2 inside: each rank synchronizes its shard across nodes
            mesh = node_mesh(device, self.local)
            self.module = self.forward = shard(model, None, mesh["shard"])
            self.across = mesh.get_group("replicate")
        elif self.local > 1:  # a replica per node: DDP inside it, the synchronizer across nodes
            check_local_size(self.local, torch.distributed.get_world_size())
            node, self.across = subgroups(None, self.local)
            self.forward = DistributedDataParallel(model, process_group=node)

    def register(self, spec: Any, seed: int, optimizer: torch.optim.Optimizer) -> Synchronizer:
        self.synchronizer = Synchronizer(self.module, self.sync, spec, optimizer=optimizer, group=self.across)
        return self.synchronizer

    def after_step(self, last: bool) -> None:
        assert self.synchronizer is not None, "register the synchronizer first"
        self.synchronizer.step()
        if last:  # what is still in flight lands in the final model
            self.synchronizer.flush()

    def evaluated(self) -> contextlib.AbstractContextManager[nn.Module]:
        assert self.synchronizer is not None, "register the synchronizer first"
        return self.synchronizer.global_model()

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        if isinstance(self.forward, DistributedDataParallel):  # a node's DDP accumulates
            return self.forward.no_sync()
        if self.sharded:  # a node's FSDP2 accumulates
            return _without_gradient_sync(self.module)
        return contextlib.nullcontext()  # nothing communicates in backward

    def model_state(self) -> dict[str, Any]:
        """Every rank's replica, on rank 0 (a collective: all ranks call it); sharded inside a node,
        each node's whole replica (on the node's first rank; the others hold none)."""
        if self.sharded:
            return {"replicas": _every_rank(self._node_first(_whole_model(self.module, everywhere=True)))}
        return {"replicas": _every_rank(self.module.state_dict())}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.sharded:
            whole = _whole_optimizer(self.module, optimizer, everywhere=True)
            return {"replicas": _every_rank(self._node_first(whole))}
        return {"replicas": _every_rank(optimizer.state_dict())}

    def _node_first(self, whole: dict[str, Any]) -> dict[str, Any]:
        """A node's whole state from its first rank, on the CPU (the others, which hold the same, none)."""
        return {} if torch.distributed.get_rank() % self.local else _on_cpu(whole)

    def load(self, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        rank = torch.distributed.get_rank()
        if self.sharded:  # the node's replica, from its first rank's entry
            model, state = (saved[part]["replicas"][rank // self.local * self.local] for part in ("model", "optimizer"))
            _load_whole(self.module, optimizer, model, state)
            return
        self.module.load_state_dict(saved["model"]["replicas"][rank])
        optimizer.load_state_dict(saved["optimizer"]["replicas"][rank])

    def eval_batches(self, x: Tensor, y: Tensor, size: int, total: int) -> Iterator[Batch]:
        return batches(x, y, size)


def _on_cpu(value: Any) -> Any:
    """``value`` (tensors in dicts and lists) with every tensor on the CPU."""
    if isinstance(value, Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value


@contextlib.contextmanager
def _without_gradient_sync(module: nn.Module) -> Iterator[None]:
    """FSDP2's backward without its reduce-scatter (gradients accumulate, unsharded)."""
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]


def shard(model: nn.Module, policy: Any = None, mesh: Any = None) -> nn.Module:
    """``model`` with each unit (:func:`units`) and the root sharded by FSDP2 over ``mesh`` (default:
    every rank), in ``policy``'s mixed precision."""
    from torch.distributed.fsdp import fully_shard

    options: dict[str, Any] = {} if policy is None else {"mp_policy": policy}
    if mesh is not None:
        options["mesh"] = mesh
    for unit in units(model):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


def _whole_model(module: nn.Module, everywhere: bool = False) -> dict[str, Any]:
    """An FSDP2 model's whole state (a collective of its ranks): on rank 0, on the CPU, or with
    ``everywhere`` on every rank of its mesh, on its device."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_full(offload=not everywhere))


def _whole_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, everywhere: bool = False) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_full(offload=not everywhere))


def _load_whole(module: nn.Module, optimizer: torch.optim.Optimizer, model: Any, optimizer_state: Any) -> None:
    """Every rank takes its shards of the whole states :func:`_whole_model` and :func:`_whole_optimizer` made."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(module, model, options=_full(offload=False))
    set_optimizer_state_dict(module, optimizer, optimizer_state, options=_full(offload=False))


def _every_rank(value: Any) -> Any:
    """Every rank's ``value`` on rank 0 (None elsewhere)."""
    from gradcomp.experiments.training.checkpoint import gather  # it imports the config, which imports this

    return gather(value)


def _full(offload: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=offload)


def units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards on their own, besides the root: every module holding parameters
    that is not a container (:data:`CONTAINERS`, whose members are units: the MLP's layers, a
    transformer's blocks), outermost first; the root takes the parameters of its own that are left."""
    found: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, CONTAINERS):
            found += units(child)
        elif any(True for _ in child.parameters()):
            found.append(child)
    return found


AnyPlacement = Replicated | Sharded | Local
"""Any way of spreading the model over the ranks."""


def make(
    parallel: str, model: nn.Module, device: torch.device, spec: Any, sync: SyncSpec | None = None
) -> AnyPlacement:
    """The model spread over the ranks as ``parallel`` and ``sync`` say (the hook not registered yet)."""
    if sync is not None:
        return Local(model, sync, device, sharded=parallel == "fsdp")
    if parallel == "ddp":
        return Replicated(model, device)
    policy = spec.policy() if isinstance(spec, hooks.TorchFSDPSpec) else None
    if parallel == "fsdp":
        return Sharded(model, policy)
    local = launched_local_size()
    if local is None:
        raise ValueError(f"HSDP shards inside a node: the launcher says no node size ({LAUNCHER_LAYOUT} is not set)")
    mesh = node_mesh(device, local)
    if isinstance(spec, hooks.TorchFSDPSpec):  # FSDP2's own HSDP: the 2-D mesh, all-reduced uncompressed
        return Sharded(model, policy, mesh)
    return Sharded(model, policy, mesh["shard"], mesh.get_group("replicate"))


def node_mesh(device: torch.device, local: int) -> Any:
    """The world as a 2-D mesh of nodes (``replicate``) by their ``local`` ranks each (``shard``),
    node-major (as the launchers place ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    check_local_size(local, world)
    return init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))


def launched_local_size() -> int | None:
    """The ranks per node the launcher started (torchrun's, or an emulated cluster's, ``LOCAL_WORLD_SIZE``)."""
    value = os.environ.get(LAUNCHER_LAYOUT, "").strip()
    return int(value) if value else None


def node_size(network: str) -> int | None:
    """The ranks per node a run on ``network`` has: an emulated cluster's (``nodes=NxL,...``), else the
    launcher's (:func:`launched_local_size`); None: not said (one switch)."""
    parsed = netem.parse(network)
    return parsed.per_node if isinstance(parsed, netem.Cluster) else launched_local_size()


def check_nodes(network: str, ranks: int, what: str) -> int:
    """The node size of HSDP (``what``: the command or setting that asks) on ``network`` at ``ranks``
    ranks: two nodes or more of it, or a ValueError saying how to give them."""
    local = node_size(network)
    if local is None:
        raise ValueError(
            f"{what} shards inside each node and averages across nodes: give it nodes, an emulated cluster "
            "(nodes=2x2,intra=10gbit,inter=100mbit) or torchrun's LOCAL_WORLD_SIZE"
        )
    check_local_size(local, ranks)
    if local == ranks:
        raise ValueError(f"{what}: all {ranks} ranks are one node; shard them with fsdp")
    return local
