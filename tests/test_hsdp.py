"""HSDP with gradcomp's all-reduce across nodes, on 4 real gloo ranks as 2 nodes of 2, against
FSDP2's own HSDP (its 2-D mesh).

The model of ``tests/test_fsdp.py`` (padded shards, a frozen bias, a wholly frozen layer, a
root's own parameter), sharded over each node's 2 ranks. Checked: ``allreduce`` gives FSDP2's own
HSDP gradients bitwise, and so do accumulated gradients (``set_requires_all_reduce``); steps end at
backward's end (a frozen layer's module never reduces) and count the bytes inside the node and
across it; FSDP2's own HSDP is recorded the same way; lossy compression stays close and leaves the
ranks holding a shard identical across nodes, bitwise; two runs agree bitwise; a hook state saved
and loaded continues bitwise; noop averages only inside the node; layouts and specs that cannot
work are refused before anything is sent.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradcomp import hooks
from gradcomp.hooks import fsdp2, hybrid
from tests.distributed import Failures, run_checks
from tests.test_fsdp import Net, batch, close, equal, relative_error, train_with_scaler

pytestmark = pytest.mark.skipif(not fsdp2.available(), reason="this torch has no FSDP2 custom collectives")

STEPS = 3
NODES, LOCAL = 2, 2


def mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (NODES, LOCAL), mesh_dim_names=("replicate", "shard"))


def sharded(over: Any) -> Net:
    """The net with the same initial weights on every rank, each layer and the root sharded over ``over``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    for layer in net.layers:
        fully_shard(layer, mesh=over)
    fully_shard(net, mesh=over)
    return net


def gradients(net: Net, rank: int, steps: int = STEPS, first: int = 0, accumulate: bool = False) -> list[torch.Tensor]:
    """Each trainable parameter's gradient shard after ``steps`` backwards (fixed weights: error
    feedback carries over and every step compares); with ``accumulate``, each step two backwards,
    the first without the all-reduce across nodes."""
    for step in range(first, first + steps):
        net.zero_grad()
        if accumulate:
            net.set_requires_all_reduce(False)
            net(batch(rank, step + 50)).square().sum().backward()
            net.set_requires_all_reduce(True)
        net(batch(rank, step)).square().sum().backward()
    return [p.grad.to_local().clone() for p in net.parameters() if p.requires_grad]


def native(rank: int, accumulate: bool = False) -> tuple[list[torch.Tensor], Any]:
    """FSDP2's own HSDP: the 2-D mesh, its all-reduce recorded."""
    net = sharded(mesh())
    state = hooks.register(net, "torch:reduce_scatter")
    return gradients(net, rank, accumulate=accumulate), state


def hybrid_run(spec: str, rank: int, accumulate: bool = False, **options: Any) -> tuple[list[torch.Tensor], Any]:
    """gradcomp's HSDP: sharded over the node, ``spec`` across nodes."""
    grid = mesh()
    net = sharded(grid["shard"])
    state = hooks.hsdp(net, spec, replicate=grid.get_group("replicate"), **options)
    return gradients(net, rank, accumulate=accumulate), state


def same_across_nodes(shards: list[torch.Tensor]) -> bool:
    """Whether the ranks holding this shard in every node hold it bitwise alike (gathered across
    nodes: a node's ranks hold shards of different sizes)."""
    flat = torch.cat([s.reshape(-1) for s in shards])
    across = mesh().get_group("replicate")
    peers = [torch.empty_like(flat) for _ in range(NODES)]
    dist.all_gather(peers, flat, group=across)
    return all(torch.equal(peer, flat) for peer in peers)


def against_native_hsdp(rank: int, world: int) -> Failures:
    failures = Failures()
    reference, recorded = native(rank)

    mine, state = hybrid_run("allreduce", rank)
    failures.expect(equal(mine, reference), "allreduce: not FSDP2's own HSDP gradients bitwise")
    steps = state.steps()
    # four modules reduce (the frozen layer's does not): the step ends with backward, not at a count
    failures.expect(len(steps) == STEPS and all(s.buckets == 4 for s in steps), f"allreduce: steps {steps}")
    step = steps[-1]
    shard_bytes = sum(r.numel() * 4 for r in reference)
    handed = step.input_bytes
    failures.expect(handed >= shard_bytes, f"allreduce: {handed} bytes handed, shards {shard_bytes}")
    # inside the node a ring reduce-scatter of 2 ranks sends the other rank its shard; across 2 nodes
    # a ring all-reduce sends the shard once
    failures.expect(
        step.intra_node_bytes == step.input_bytes and step.inter_node_bytes == step.input_bytes,
        f"allreduce: bytes inside {step.intra_node_bytes}, across {step.inter_node_bytes}, shard {step.input_bytes}",
    )
    theirs = recorded.steps()[-1]
    failures.expect(
        len(recorded.steps()) == STEPS
        and theirs.intra_node_bytes == step.intra_node_bytes
        and theirs.inter_node_bytes == step.inter_node_bytes,
        f"FSDP2's own HSDP recorded {theirs}, gradcomp's allreduce {step}",
    )

    accumulated, _ = native(rank, accumulate=True)
    mine, state = hybrid_run("allreduce", rank, accumulate=True)
    failures.expect(equal(mine, accumulated), "allreduce after accumulation: not FSDP2's own HSDP bitwise")
    failures.expect(len(state.steps()) == STEPS, f"accumulation: {len(state.steps())} steps recorded, {STEPS} taken")

    mine, state = hybrid_run("quantize:bits=8,ef=true", rank)
    error = relative_error(mine, reference)
    failures.expect(error < 0.02, f"quantize:bits=8,ef=true: relative error {error:.4f}")
    failures.expect(same_across_nodes(mine), "quantize:bits=8,ef=true: a shard differs across nodes")
    step = state.steps()[-1]
    failures.expect(
        step.compression_ratio > 2 and step.inter_node_bytes < step.intra_node_bytes / 2,
        f"quantize:bits=8: step {step}",
    )
    first, _ = hybrid_run("quantize:bits=4,ef=true", rank)
    again, _ = hybrid_run("quantize:bits=4,ef=true", rank)
    failures.expect(equal(first, again), "quantize:bits=4,ef=true: two runs differ")
    failures.expect(same_across_nodes(first), "quantize:bits=4,ef=true: a shard differs across nodes")
    mine, _ = hybrid_run("topk:ratio=1", rank, algo="ring")
    failures.expect(close(mine, reference, rtol=1e-6, atol=1e-7), "topk:ratio=1 over a ring: not the average")

    # noop: the node's own average, nothing across (the compute floor)
    grid = mesh()
    net = sharded(grid["shard"])
    state = hooks.hsdp(net, "noop")
    node_only = gradients(net, rank)
    fsdp_in_node = sharded(grid["shard"])  # FSDP2 over the node alone averages the node's gradients
    failures.expect(state.engine is None and equal(node_only, gradients(fsdp_in_node, rank)), "noop: not the node's")
    return failures


def test_hsdp_against_fsdp2s_own_hsdp() -> None:
    run_checks(NODES * LOCAL, against_native_hsdp, timeout=280)


def state_and_refusals(rank: int, world: int) -> Failures:
    failures = Failures()
    spec = "topk:ratio=0.2,ef=true"
    straight, _ = hybrid_run(spec, rank)
    grid = mesh()
    net = sharded(grid["shard"])
    state = hooks.hsdp(net, spec)  # the group across nodes derived from FSDP2's node-major shard group
    gradients(net, rank, STEPS - 1)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_net = sharded(grid["shard"])
    resumed = hooks.hsdp(resumed_net, spec, replicate=grid["replicate"])
    resumed.load_state_dict(saved)
    last = gradients(resumed_net, rank, 1, first=STEPS - 1)
    failures.expect(equal(last, straight), "the resumed hook's step differs from the straight run's")
    failures.expect(resumed.steps()[-1].step == STEPS - 1, f"a resumed hook goes on numbering: {resumed.steps()}")

    def refused(make: Any, words: str) -> None:
        try:
            make()
            failures.append(f"not refused ({words})")
        except (ValueError, TypeError) as error:
            failures.expect(words in str(error), f"unclear refusal: {error}")

    refused(lambda: hooks.hsdp(sharded(grid), "allreduce"), "2-D mesh")  # native HSDP all-reduces itself
    refused(lambda: hooks.hsdp(sharded(None), "allreduce"), "sharded over all 4 ranks")
    refused(lambda: hooks.hsdp(sharded(grid["shard"]), "allreduce", replicate=dist.group.WORLD), "do not make")
    refused(lambda: hooks.hsdp(sharded(grid["shard"]), "allreduce", replicate=3), "process group")
    refused(lambda: hooks.hsdp(sharded(grid["shard"]), spec).load_state_dict({**saved, "local_size": 4}), "per node")
    return failures


def test_hsdp_state_resumes_bitwise_and_bad_layouts_are_refused() -> None:
    run_checks(NODES * LOCAL, state_and_refusals, timeout=200)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("powersgd:rank=2", "needs each tensor's shape"),
        ("quantize:bits=4,local_size=2", "leave local_size out"),
        ("quantize:bits=4,pieces=2", "an HSDP shard is flat"),
        ("topk:ratio=0.01,min_numel=100", "an HSDP shard is flat"),
        ("torch:fp16", "FSDP2's own HSDP"),
        ("auto", "auto chooses among DDP hooks"),
        ("nonsense", "unknown compressor"),
    ],
)
def test_bad_hsdp_specs_are_refused_without_a_process_group(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hybrid.parse(spec)


def test_hsdp_specs_in_runs_take_gradcomp_or_fsdp2s_own() -> None:
    assert hooks.parse_hybrid("quantize:bits=4,ef=true", seed=3) == hooks.parse("quantize:bits=4,ef=true,seed=3")
    assert isinstance(hooks.parse_hybrid("torch:bf16"), hooks.TorchFSDPSpec)


def under_a_changing_scale(rank: int, world: int) -> Failures:
    """A GradScaler whose scale doubles every step, given to the HSDP hook (``scaler=``): 4-bit codes
    with error feedback across nodes train bitwise as without a scaler; not following it differs."""
    failures = Failures()

    def trained(scaled: bool, follow: bool) -> list[torch.Tensor]:
        grid = mesh()
        net = sharded(grid["shard"])
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1) if scaled else None
        hooks.hsdp(net, "quantize:bits=4,ef=true", replicate=grid.get_group("replicate"),
                   scaler=scaler if follow else None)  # fmt: skip
        train_with_scaler(net, rank, scaler, 5)
        return [p.to_local().detach().clone() for p in net.parameters()]

    plain = trained(scaled=False, follow=False)
    failures.expect(equal(trained(scaled=True, follow=True), plain), "under a changing scale: not the run without one")
    failures.expect(not equal(trained(scaled=True, follow=False), plain), "not following the scale changes nothing")
    return failures


def test_error_feedback_across_nodes_follows_the_loss_scale() -> None:
    run_checks(4, under_a_changing_scale, timeout=120)
