"""Hierarchical compressed DDP (``local_size``): uncompressed inside a node, compressed across nodes,
on 4 gloo ranks as 2 nodes of 2; against DDP's own all-reduce, with ranks bitwise identical."""

from __future__ import annotations

import math
import os

import pytest
import torch

from gradcomp.engine.hierarchical import NodeShards, check_local_size, gather, scatter
from gradcomp.engine.spec import HookSpec
from gradcomp.flat import views
from tests.distributed import Failures, parameters_identical_on_all_ranks, run_checks
from tests.test_hooks import resume
from tests.toy_ddp import train

KINDS = [
    "fp16:algo=native",  # a cast: the bucket whole
    "sign:ef=true",  # gathered, error feedback
    "quantize:bits=4",  # gathered, stochastic
    "topk:ratio=0.1,ef=true,momentum=0.9,warmup=2",  # sparse, momentum correction, a warm-up (flat)
    "randomk:ratio=0.1,scale=false,ef=true",  # summed sparse
    "powersgd:rank=2,ef=true",  # two rounds, on row blocks of the matrices
    "threshold:tau=0.001,ef=true",  # payloads sized by their values
    "sign:ef=true,vectors=dense,pieces=2",  # the policy's vectors flat and dense, the rest across nodes, in pieces
    "fp16:min_numel=100",  # a cast's small tensors dense: runs of the bucket across nodes
]


def against_ddp(rank: int, world: int) -> Failures:
    failures = Failures()
    reference, _ = train(rank, None, 5)
    exact, state = train(rank, "allreduce:local_size=2", 5)
    assert state is not None
    failures.expect(
        all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(reference, exact, strict=True)),
        "allreduce:local_size=2 is not DDP's average",
    )
    step = state.steps()[-1]
    # each rank compresses its node's half of the gradient: its payload is half the bucket's bytes
    failures.expect(2 * step.payload_bytes == step.input_bytes, f"payload {step.payload_bytes} of {step.input_bytes}")
    # inside the node, a ring reduce-scatter and all-gather of the bucket: (L - 1) / L of it each;
    # across nodes, an all-reduce of the half between 2 nodes: a ring's 2 (2 - 1) / 2 of it
    failures.expect(step.intra_node_bytes == step.input_bytes, f"{step.intra_node_bytes} bytes inside the node")
    failures.expect(step.inter_node_bytes == step.input_bytes / 2, f"{step.inter_node_bytes} bytes across nodes")
    failures.expect(parameters_identical_on_all_ranks(exact), "allreduce:local_size=2: ranks differ")
    for spec in KINDS:
        hierarchical, state = train(rank, f"{spec},local_size=2", 5)
        flat, _ = train(rank, spec, 5)
        failures.expect(parameters_identical_on_all_ranks(hierarchical), f"{spec}: ranks differ")
        distance = max(float((a - b).abs().max()) for a, b in zip(hierarchical, reference, strict=True))
        drift = max(float((a - b).abs().max()) for a, b in zip(flat, reference, strict=True))
        # compressing half as many contributions (a node's sum) strays from DDP no more than flat does
        failures.expect(distance <= 2 * drift + 1e-6, f"{spec}: {distance:.2e} from DDP, flat {drift:.2e}")
    return failures


def test_hierarchical_hooks_average_as_ddp_does_with_identical_ranks() -> None:
    run_checks(4, against_ddp, timeout=240)


@pytest.mark.parametrize("spec", ["sign:ef=true,local_size=2", "powersgd:rank=2,ef=true,local_size=2"])
def test_checkpoint_and_resume_continue_exactly_across_nodes(spec: str) -> None:
    run_checks(4, resume, (spec,), timeout=240)


@pytest.mark.parametrize(
    "shapes", [[(64, 32), (64,)], [(3, 5), (1,), ()], [(7,), (10, 2, 3)], [(0, 4), (5, 5)]]
)
@pytest.mark.parametrize("local", [1, 2, 3, 4])
def test_node_shards_hold_every_piece_once_and_scatter_back(shapes: list[tuple[int, ...]], local: int) -> None:
    sizes = [torch.Size(s) for s in shapes]
    shards = NodeShards(tuple(sizes), local)
    numel = sum(math.prod(s) for s in sizes)
    assert shards.bounds[-1][1] == numel and len(shards.bounds) == local
    for j, (start, stop) in enumerate(shards.bounds):
        assert stop - start == sum(math.prod(s) for s in shards.shard_shapes(j))
    bucket = torch.arange(numel, dtype=torch.float32)
    layout, back = torch.empty(numel), torch.empty(numel)
    scatter(shards.pairs(views(bucket, sizes), layout), 2.0)
    assert sorted(layout.tolist()) == sorted((bucket / 2).tolist()), "every element once, divided"
    layout.mul_(2)
    gather(shards.pairs(views(back, sizes), layout))
    assert torch.equal(back, bucket)


def test_local_size_is_checked_against_the_world_and_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="divide the world size 6, got 4"):
        check_local_size(4, 6)
    monkeypatch.setitem(os.environ, "LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="launcher started 4 ranks per node"):
        check_local_size(2, 8)
    check_local_size(4, 8)
    for bad, message in [("sign:local_size=-1", "whole number"), ("noop:local_size=2", "no nodes")]:
        with pytest.raises(ValueError, match=message):
            HookSpec.parse(bad)
    for combined in ("sign:local_size=2,pieces=2", "sign:local_size=2,vectors=dense", "fp16:local_size=2,min_numel=9"):
        assert HookSpec.parse(combined).local_size == 2  # planned (tests/test_plan.py), not refused
    assert str(HookSpec.parse("sign:ef=true,local_size=2")).endswith("local_size=2")
