"""The per-tensor policy of hook specs (``min_numel``, ``vectors=dense``): the tensors it leaves out
travel uncompressed (the all-reduce hook's average, bitwise), the others compressed as before, for every
kind of route; counted in the statistics and priced by the cost model."""

from __future__ import annotations

import pytest
import torch

from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.kernels import KernelCost
from gradcomp.cost.step import BucketCost, bucket_cost, method_of
from gradcomp.engine.spec import HookSpec
from tests.distributed import Failures, run_checks
from tests.toy_ddp import gradients, toy_model

SHAPES = [tuple(p.shape) for p in toy_model().parameters()]
"""The toy MLP's: three weight matrices (2048, 4096, 640 elements) and three biases (64, 64, 10)."""


def test_the_policy_parses_prints_and_picks_tensors() -> None:
    spec = HookSpec.parse("sign:ef=true,min_numel=1000,vectors=dense")
    assert str(spec) == "sign:chunk=1024,ef=true,min_numel=1000,vectors=dense"
    assert HookSpec.parse(str(spec)) == spec
    assert [spec.uncompressed(s) for s in SHAPES] == [False, True, False, True, True, True]
    assert not HookSpec.parse("sign:ef=true").keeps_some_dense
    for text, message in (
        ("sign:vectors=some", "vectors must be one of compressed, dense"),
        ("sign:min_numel=-1", "min_numel must be an integer >= 0"),
        ("noop:vectors=dense", "noop"),
    ):
        with pytest.raises(ValueError, match=message):
            HookSpec.parse(text)


SPECS = [
    "topk:ratio=0.1,ef=true,vectors=dense",
    "sign:ef=true,min_numel=1000",
    "fp16:vectors=dense",  # element-wise: its bucket compressed tensor by tensor
    "powersgd:rank=2,ef=true,vectors=dense",  # a sum compressor of two rounds
    "topk:ratio=0.1,ef=true,aggregation=two_phase,vectors=dense",
    "sign:ef=true,min_numel=100000",  # every tensor: the all-reduce hook itself
]


def policy_against_allreduce(rank: int, world: int) -> Failures:
    failures = Failures()
    exact, _ = gradients(rank, "allreduce")
    for text in SPECS:
        spec = HookSpec.parse(text)
        ours, state = gradients(rank, text)
        assert state is not None
        for shape, a, b in zip(SHAPES, ours, exact, strict=True):
            if spec.uncompressed(shape):
                failures.expect(torch.equal(a, b), f"{text}: an uncompressed {shape} differs from the all-reduce's")
            else:
                failures.expect(not torch.equal(a, b), f"{text}: a compressed {shape} came back exact")
        step = state.steps()[-1]
        dense = 4 * sum(torch.Size(s).numel() for s in SHAPES if spec.uncompressed(s))
        failures.expect(step.uncompressed_bytes == dense, f"{text}: {step.uncompressed_bytes} uncompressed bytes")
        failures.expect(step.payload_bytes >= dense, f"{text}: payload {step.payload_bytes} < {dense}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_tensors_left_uncompressed_get_the_all_reduce_average(world: int) -> None:
    """At 2 ranks bitwise the all-reduce hook's (each rank's share summed); at 3 the sum's order
    may differ from gloo's for a bucket of another layout, so 3 ranks check the compressed ones only."""
    if world == 2:
        run_checks(2, policy_against_allreduce, timeout=120)
    else:
        run_checks(3, policy_stays_in_step, timeout=120)


def policy_stays_in_step(rank: int, world: int) -> Failures:
    from tests.distributed import parameters_identical_on_all_ranks

    failures = Failures()
    for text in SPECS:
        ours, _ = gradients(rank, text)
        failures.expect(parameters_identical_on_all_ranks(ours), f"{text}: ranks differ")
    return failures


def test_the_cost_model_prices_left_out_tensors_as_an_all_reduce() -> None:
    cluster = Cluster(2, LinkCosts(alpha=1e-4, beta=1e-8))

    def kernel(spec: str) -> KernelCost:
        return KernelCost((1,), (1e-5,), (0.0,), (1e-5,), (0.0,))

    def cost(shapes: list[tuple[int, ...]], spec: str) -> BucketCost:
        return bucket_cost(shapes, method_of(spec), cluster, kernel)

    vectors, matrices = [s for s in SHAPES if len(s) == 1], [s for s in SHAPES if len(s) > 1]
    policy = cost(SHAPES, "sign:ef=true,vectors=dense")
    parts = [cost(vectors, "allreduce"), cost(matrices, "sign:ef=true")]
    for field in ("payload", "sent", "communicate", "compress", "decompress", "link"):
        assert getattr(policy, field) == pytest.approx(sum(getattr(p, field) for p in parts)), field
    assert policy.payload > cost(SHAPES, "sign:ef=true").payload
    assert cost(SHAPES, "sign:ef=true,min_numel=100000") == cost(SHAPES, "allreduce")
