"""HSDP: FSDP2 sharded inside each node, the gradients averaged across nodes compressed.

>>> from torch.distributed.device_mesh import init_device_mesh
>>> from torch.distributed.fsdp import fully_shard
>>> mesh = init_device_mesh("cuda", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
>>> for layer in model.layers:
...     fully_shard(layer, mesh=mesh["shard"])        # shards inside the node only
>>> fully_shard(model, mesh=mesh["shard"])
>>> state = gradcomp.hooks.hsdp(model, "quantize:bits=4,ef=true", replicate=mesh.get_group("replicate"))

Hybrid sharding keeps a whole copy of the model in every node, sharded over the node's ranks, and
averages the node's reduce-scattered gradient shards across the nodes, rank by rank. Inside the node
the links are fast and FSDP2's own reduce-scatter does the work uncompressed; across nodes, where the
links are slow and shared, :func:`hsdp` averages each shard through a gradcomp engine (any spec
that works on a flat shard, error feedback kept per module), installed as FSDP2's all-reduce hook
(``FSDPModule.set_all_reduce_hook``). FSDP2's native HSDP (a 2-D mesh given to ``fully_shard``)
all-reduces across nodes itself, uncompressed, before any hook runs; for gradcomp the model is sharded
over the mesh's ``shard`` dimension (a 1-D mesh of the node) and the hook does the replicas' average.

Each rank sends ``(L - 1) / L`` of the gradient inside its node (FSDP2's ring reduce-scatter) and
its shard, compressed, across nodes: ``L`` times fewer bytes across nodes than DDP's flat all-reduce
before compression. Statistics (``state.steps()``) count both: ``intra_node_bytes`` what the node's
reduce-scatter sends by a ring's count, ``inter_node_bytes`` what the engine sent across nodes.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradcomp.collectives.groups import as_timeout
from gradcomp.collectives.hierarchical import subgroups
from gradcomp.engine import Engine, rules, sharded
from gradcomp.engine.spec import SHARDED_NAMES, HookSpec, HookSpecLike
from gradcomp.hooks.auto_spec import is_auto_spec
from gradcomp.hooks.ddp import HookState, check_saved
from gradcomp.hooks.fsdp2 import available, shard_group, sharded_modules
from gradcomp.hooks.torch_fsdp import native_replicas
from gradcomp.hooks.torch_hooks import is_torch_spec

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # pragma: no cover - torch without FSDP2's custom collectives
    DeviceMesh = DefaultReduceScatter = None  # type: ignore[assignment,misc]


class HSDPState(HookState):
    """What the HSDP hook keeps: the spec, the engine across nodes (over the replicate group, one
    rank per node), and the step's bookkeeping. ``world`` counts the replicas (nodes), ``local``
    the ranks sharding each of them; statistics and checkpoints as every hook state's."""

    def __init__(self, spec: HookSpec, engine: Engine | None, world: int, local: int) -> None:
        super().__init__(spec, engine, world)
        self.local = local
        self._calls = 0  # the step's all-reduce calls so far (0: the step has not begun)

    def reduce(self, key: str, shard: Tensor, inside: NodeReduceScatter) -> None:
        """Average the module ``key``'s shard across nodes in place (returns when it is there), and
        count in its record the node's reduce-scatter that made it."""
        engine = self.engine
        assert isinstance(engine, Engine)
        if self._calls == 0:  # the step ends with backward: FSDP2's last module reduces before that
            torch.autograd.Variable._execution_engine.queue_callback(self._end_step)
            if self.loss_scale is not None:
                self.follow_scale()
        bucket, self._calls = self._calls, self._calls + 1
        engine.reduce(shard, [(key, shard.numel())], [shard.shape], bucket, last=False).wait()
        record = engine.records[-1]  # the hook waits: the newest record is this call's
        sent, spans = inside.taken()
        record.add_traffic(None, native=sent)  # FSDP2's collective: unobserved, a ring's count
        record.intra_node_bytes = sent
        for start, end in spans:
            record.add_span("communicate", start, end)

    def _end_step(self) -> None:
        assert isinstance(self.engine, Engine)
        self.engine.end_step()
        self._calls = 0

    def state_dict(self) -> dict[str, Any]:
        """As a DDP hook's, and the ranks per node (a shard's residuals fit only its node's layout)."""
        return {**super().state_dict(), "local_size": self.local}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_saved(state, str(self.spec), self.world, "gradcomp")
        if state.get("local_size") != self.local:
            raise ValueError(
                f"this hook state was saved with {state.get('local_size')} ranks per node; this HSDP has {self.local}"
            )
        super().load_state_dict(state)


class NodeReduceScatter(DefaultReduceScatter if DefaultReduceScatter is not None else object):  # type: ignore[misc]
    """FSDP2's own reduce-scatter inside the node, unchanged; what it sent and when, kept until the
    module's next all-reduce call (several, when gradients accumulate without the all-reduce)."""

    def __init__(self) -> None:
        super().__init__()
        self._sent = 0.0
        self._spans: list[tuple[float, float]] = []

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, op: Any, async_op: bool = False
    ) -> Any:
        start = time.perf_counter()
        result = super().__call__(output_tensor, input_tensor, group, op, async_op)
        self._spans.append((start, time.perf_counter()))
        self._sent += (group.size() - 1) * output_tensor.numel() * output_tensor.element_size()
        return result

    def taken(self) -> tuple[float, list[tuple[float, float]]]:
        """What was sent and when since the last call, and forget it."""
        sent, spans = self._sent, self._spans
        self._sent, self._spans = 0.0, []
        return sent, spans


class CompressedAllReduce:
    """FSDP2's all-reduce hook of one module (``key``: its name): the shard averaged across nodes.

    FSDP2 calls it after every reduce-scatter of a 1-D mesh, even where ``set_requires_all_reduce(False)``
    asks to accumulate without the all-reduce (which only native HSDP honours): then the shard is
    summed here and handed to FSDP2 as zeros, and the next call sends the sum across once, as native
    HSDP does (``reduce_output += partial``, the same order)."""

    def __init__(self, state: HSDPState, key: str, inside: NodeReduceScatter, group: Any) -> None:
        self.state, self.key, self.inside, self.group = state, key, inside, group
        self._partial: Tensor | None = None

    def __call__(self, reduce_output: Tensor) -> None:
        try:
            if not self.group.all_reduce_grads:
                if self._partial is None:
                    self._partial = reduce_output.clone()
                else:
                    self._partial += reduce_output
                reduce_output.zero_()  # FSDP2 accumulates it into the gradient: nothing yet
                return
            if self._partial is not None:
                reduce_output += self._partial
                self._partial = None
            self.state.reduce(self.key, reduce_output, self.inside)
        except Exception as error:
            self.state.error = self.state.error or error  # the first is the cause; later ones its consequences
            raise


def hsdp(
    model: nn.Module,
    spec: HookSpecLike,
    *,
    replicate: dist.ProcessGroup | Any | None = None,
    algo: str | None = None,
    aggregation: str | None = None,
    seed: int | None = None,
    timeout: datetime.timedelta | float | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> HSDPState:
    """Average an FSDP2 model's gradient shards across its replicas through ``spec`` (HSDP with a
    compressed all-reduce across nodes). Call it after ``fully_shard`` over each node's ranks (a 1-D
    mesh, ``mesh["shard"]``), on every rank; a bad spec or layout fails here, before any rank
    communicates.

    Args:
        model: the root of an FSDP2 model sharded over a node's ranks.
        spec: a hook spec (``docs/hooks.md``) that works on a flat shard: ``allreduce``, the casts,
            quantizers, sign, sparsifiers, with error feedback and the engine's ``algo``,
            ``aggregation``, ``seed``, ``warmup``; ``noop`` averages nothing (each node trains on
            its own: the compute floor, for benchmarks). Not PowerSGD (a shard is not a matrix),
            ``pieces``, ``min_numel``, ``vectors`` nor ``local_size`` (the node is the model's mesh).
        replicate: the ranks holding the same shard in the other nodes (``mesh.get_group("replicate")``,
            or that 1-D ``DeviceMesh``); default: derived from FSDP2's shard group, which must then be
            a block of consecutive ranks (node-major ranks, as torchrun and ``init_device_mesh`` lay out).
        algo, aggregation, seed: defaults for the spec's options where its text sets none.
        timeout: what any collective of the hook may take before it fails, naming the peer.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision run: error feedback's residuals
            then follow its loss scale (:meth:`~gradcomp.hooks.ddp.HookState.follow`).
    """
    timeout = as_timeout(timeout)  # a number of seconds, or refused here
    if not available():
        raise RuntimeError(f"torch {torch.__version__} has no FSDP2 custom collectives")
    given = {"algo": algo, "aggregation": aggregation, "seed": seed}
    parsed = parse(spec, **{key: value for key, value in given.items() if value is not None})
    modules = sharded_modules(model)
    check_not_native(modules)
    inside = shard_group(modules[0][1])
    local, world = dist.get_world_size(inside), dist.get_world_size()
    across = _replicate_group(replicate, inside, local, world)
    engine = None if parsed.noop else Engine(parsed, group=across, timeout=timeout)
    state = HSDPState(parsed, engine, dist.get_world_size(across), local)
    if scaler is not None:
        state.follow(scaler)
    if engine is not None:
        for name, module in modules:
            reduce_scatter = NodeReduceScatter()
            module.set_custom_reduce_scatter(reduce_scatter)
            (group,) = module._get_fsdp_state()._fsdp_param_groups  # one mesh per module: its flags
            module.set_all_reduce_hook(CompressedAllReduce(state, name, reduce_scatter, group))
    return state


register = hsdp


def parse(spec: HookSpecLike, **defaults: Any) -> HookSpec:
    """An HSDP spec: a hook spec that works on a flat shard (ValueError naming what is wrong)."""
    if isinstance(spec, str) and (is_torch_spec(spec) or is_auto_spec(spec)):
        raise ValueError(
            f"{spec.strip()!r}: HSDP takes a gradcomp spec for its all-reduce across nodes; FSDP2's own HSDP "
            "needs no hook (fully_shard with the 2-D mesh), and auto chooses among DDP hooks"
        )
    names = [*SHARDED_NAMES, *sharded.valid_names()]  # an unknown name's message lists what HSDP takes
    parsed = HookSpec.parse_among(spec, defaults, names)
    rules.check(parsed, rules.Surface.HSDP)
    return parsed


def _replicate_group(given: Any, inside: dist.ProcessGroup, local: int, world: int) -> dist.ProcessGroup:
    """The group across nodes: ``given`` (a process group or 1-D device mesh), checked, or derived
    from the shard group ``inside`` when it is this rank's block of ``local`` consecutive ranks."""
    if local == world:
        raise ValueError(
            f"the model is sharded over all {world} ranks: nothing is replicated across nodes. Shard it over "
            "a node's ranks (fully_shard(..., mesh=mesh['shard'])), or use gradcomp.hooks.fsdp"
        )
    if given is None:
        members = dist.get_process_group_ranks(inside)
        first = dist.get_rank() // local * local
        if members != list(range(first, first + local)):
            raise ValueError(
                f"FSDP2 shards over ranks {members}, not a block of consecutive ranks: give the group "
                "across nodes (replicate=mesh.get_group('replicate'))"
            )
        return subgroups(None, local)[1]
    group = given.get_group() if DeviceMesh is not None and isinstance(given, DeviceMesh) else given
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"replicate is a process group or a 1-D device mesh, got {type(given).__name__}")
    if dist.get_world_size(group) * local != world:
        raise ValueError(
            f"{dist.get_world_size(group)} replicas of {local} shards do not make the world's {world} ranks: "
            "replicate is the group of the ranks holding this rank's shard in every node"
        )
    return group


def check_not_native(modules: Sequence[tuple[str, Any]]) -> None:
    """Refuse a model FSDP2 shards over a 2-D mesh (native HSDP, which all-reduces across replicas itself)."""
    if native_replicas(modules[0][1]) > 1:
        raise ValueError(
            "this model is sharded over a 2-D mesh: FSDP2 all-reduces across its replicas itself (native "
            "HSDP), uncompressed, before any hook runs. Shard it over the mesh's shard dimension "
            "(fully_shard(..., mesh=mesh['shard'])) and give hsdp the replicate group"
        )
