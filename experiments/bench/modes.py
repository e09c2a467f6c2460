"""How ``gradcomp bench ddp``, ``fsdp`` and ``hsdp`` spread the model over the ranks: DDP's replicas
(:data:`DDP`), FSDP2's shards (:data:`FSDP`) or FSDP2's shards inside each node, replicated across
nodes (:data:`HSDP`), small classes behind one interface (:class:`Mode`). A mode says what its
table is anchored on, what it measures by default, how it reads a spec, which networks it can run
on, and how it builds and hooks one variant's model; the rest of the benchmark is the same for all."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks
from gradcomp.experiments.training import parallel
from gradcomp.hooks import torch_hooks
from gradcomp.hooks.torch_hooks import TorchHookSpec, is_torch_spec
from gradcomp.state import TrainingHookState

NOOP = "noop"
"""The variant without communication: the compute floor, measured in every run."""
TORCH_ALLREDUCE = "torch:allreduce"
"""DDP's built-in C++ all-reduce: the anchor of ``gradcomp bench ddp``."""
"""What hooking a variant returns: it records what every step sent and where its time went."""


class Mode(Protocol):
    """How the benchmark spreads the model over the ranks, and what it measures by default."""

    @property
    def name(self) -> str:
        """The command (``gradcomp bench <name>``), and ``parallel`` in its JSON report."""

    @property
    def anchor(self) -> str:
        """torch's own way of averaging, against which every speedup is taken."""

    @property
    def torch_hooks(self) -> tuple[str, ...]:
        """torch's other ways measured by default (``--torch-hooks``)."""

    @property
    def hooks(self) -> str:
        """gradcomp's specs measured by default (``--hooks``), in the command line's list syntax."""

    def canonical(self, spec: str) -> str:
        """A variant's canonical text: ``noop``, a ``torch:`` spec, or a gradcomp spec (a bad one fails)."""

    def torch_canonical(self, spec: str) -> str:
        """One of torch's own (it must start with ``torch:``), in its canonical text (a bad one fails)."""

    def make(
        self, build: Callable[[], nn.Module], variant: str, seed: int, device: torch.device
    ) -> tuple[nn.Module, TrainingHookState]:
        """A fresh model for ``variant`` on ``device``, spread and hooked (the same initial weights for
        every variant)."""

    def isolated(self, variant: str) -> bool:
        """Whether ``variant`` runs in ranks of its own (one that may hang or abort its ranks)."""

    def check(self, network: str, ranks: int) -> None:
        """Refuse a network or rank count the mode cannot run on (before any rank starts)."""

    def local_size(self, variant: str) -> int:
        """Ranks per node of ``variant`` (its ``local_size``; 0: flat), checked against the ranks
        before any starts."""
        ...


@dataclasses.dataclass(frozen=True)
class Replicas:
    """DDP's replicas (``gradcomp bench ddp``): DDP communication hooks, gradcomp's or torch's."""

    name: str = "ddp"
    anchor: str = TORCH_ALLREDUCE
    torch_hooks: tuple[str, ...] = ("torch:allreduce_hook", "torch:fp16", "torch:powersgd:rank=4")
    """torch's own hooks measured beside the two anchors (noop and torch's all-reduce) by default."""
    hooks: str = (
        "allreduce;fp16;bf16;randomk:ratio=0.01,scale=false,ef=true;powersgd:rank=1;powersgd:rank=4,ef=true;"
        "sign:ef=true;topk:ratio=0.01,ef=true;quantize:bits=4"
    )
    """What ``gradcomp bench ddp`` measures when ``--hooks`` is not given."""

    def canonical(self, spec: str) -> str:
        return str(hooks.parse(spec))

    def torch_canonical(self, spec: str) -> str:
        return str(TorchHookSpec.parse(spec))

    def make(
        self, build: Callable[[], nn.Module], variant: str, seed: int, device: torch.device
    ) -> tuple[nn.Module, TrainingHookState]:
        torch.manual_seed(seed)
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(build().to(device), device_ids=ids)  # DDP broadcasts rank 0's weights
        if is_torch_spec(variant):
            return model, torch_hooks.register(model, variant, seed=seed)
        return model, hooks.register(model, variant, seed=seed)

    def isolated(self, variant: str) -> bool:
        """torch's PowerSGD: on gloo it would hang whenever the model has more than one bucket (it
        issues its second all-reduce from the first one's callback); gradcomp's wrapper refuses that
        case, and in ranks of its own the refusal becomes its row's status, not the others' end."""
        return is_torch_spec(variant) and TorchHookSpec.parse(variant).name == "powersgd"

    def check(self, network: str, ranks: int) -> None:
        pass

    def local_size(self, variant: str) -> int:
        return 0 if variant == NOOP else int(getattr(hooks.parse(variant), "local_size", 0))


@dataclasses.dataclass(frozen=True)
class Shards:
    """FSDP2's shards (``gradcomp bench fsdp``): gradcomp's reduce-scatter, or FSDP2's own reduction."""

    name: str = "fsdp"
    anchor: str = "torch:reduce_scatter"
    torch_hooks: tuple[str, ...] = ("torch:bf16",)
    """FSDP2's other reductions measured beside the two anchors by default."""
    hooks: str = (
        "none;fp16;bf16;quantize:bits=4,ef=true;quantize:bits=8,ef=true;sign:ef=true;topk:ratio=0.01,ef=true;"
        "randomk:ratio=0.01,scale=false,ef=true"
    )
    """What ``gradcomp bench fsdp`` measures when ``--hooks`` is not given."""

    def canonical(self, spec: str) -> str:
        return str(hooks.parse_sharded(spec))

    def torch_canonical(self, spec: str) -> str:
        return str(hooks.TorchFSDPSpec.parse(spec))

    def make(
        self, build: Callable[[], nn.Module], variant: str, seed: int, device: torch.device
    ) -> tuple[nn.Module, TrainingHookState]:
        torch.manual_seed(seed)
        spec = hooks.parse_sharded(variant, seed=seed)
        sharded = parallel.make("fsdp", build().to(device), device, spec)
        return sharded.forward, hooks.register(sharded.forward, spec)

    def isolated(self, variant: str) -> bool:
        return False

    def check(self, network: str, ranks: int) -> None:
        pass

    def local_size(self, variant: str) -> int:
        return 0 if variant == NOOP else int(getattr(hooks.parse_sharded(variant), "local_size", 0))


@dataclasses.dataclass(frozen=True)
class NodeShards(Shards):
    """HSDP (``gradcomp bench hsdp``): FSDP2 shards inside each node, gradcomp's all-reduce of the
    node's shards across nodes (:func:`gradcomp.hooks.hsdp`), or FSDP2's own HSDP (its 2-D mesh).
    ``noop`` still reduce-scatters inside the node: only the all-reduce across nodes is left out."""

    name: str = "hsdp"
    hooks: str = (
        "allreduce;fp16;bf16;quantize:bits=4,ef=true;quantize:bits=8,ef=true;sign:ef=true;topk:ratio=0.01,ef=true"
    )
    """What ``gradcomp bench hsdp`` measures when ``--hooks`` is not given."""

    def canonical(self, spec: str) -> str:
        return str(hooks.parse_hybrid(spec))

    def make(
        self, build: Callable[[], nn.Module], variant: str, seed: int, device: torch.device
    ) -> tuple[nn.Module, TrainingHookState]:
        torch.manual_seed(seed)
        spec = hooks.parse_hybrid(variant, seed=seed)
        sharded = parallel.make("hsdp", build().to(device), device, spec)
        assert isinstance(sharded, parallel.Sharded)
        if isinstance(spec, hooks.TorchFSDPSpec):
            return sharded.forward, hooks.register(sharded.forward, spec)
        return sharded.forward, hooks.hsdp(sharded.forward, spec, replicate=sharded.replicate)

    def check(self, network: str, ranks: int) -> None:
        """The nodes come from an emulated cluster (``nodes=NxL,...``) or the launcher (``LOCAL_WORLD_SIZE``)."""
        parallel.check_nodes(network, ranks, "bench hsdp")


DDP: Mode = Replicas()
FSDP: Mode = Shards()
HSDP: Mode = NodeShards()
