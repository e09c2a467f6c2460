"""The step model against hand-computed schedules; DDP's buckets; payload bytes; kernels; compute."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.compressors import make_compressor
from gradcomp.cost import kernels as kernel_costs
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.compute import measure
from gradcomp.cost.kernels import FREE, KernelCost, KernelTable, Sample
from gradcomp.cost.step import Workload, method_of, payload_bytes, predict
from gradcomp.experiments.models import MLP, ResNet18

LINK = LinkCosts(alpha=0.1, beta=0.001)  # round numbers: every step below is computed by hand
TWO = Cluster(2, LINK)


def constant(compress: float, decompress: float, later: float = 0.0, overhead: float = 0.0) -> KernelCost:
    """Kernels that cost the same at every size below 10^9 elements (interpolation clamps below)."""
    return KernelCost((10**9,), (compress,), (later,), (decompress,), (0.0,), (10**9,), (overhead,))


def free(_: str) -> KernelCost:
    return FREE


def test_one_bucket_after_backward() -> None:
    workload = Workload(((1000,),), (1.0,), forward_s=1.0, backward_s=2.0, optimizer_s=0.5)
    step = predict(workload, method_of("allreduce"), TWO, free)
    # forward 1 + backward 2, then the ring: 2 (p-1) alpha + 2 (p-1)/p n beta = 0.2 + 4000 * 0.001
    assert step.communicate_s == pytest.approx(4.2)
    assert step.step_s == pytest.approx(1 + 2 + 4.2 + 0.5)
    assert step.payload_bytes == 4000 and step.sent_bytes == 4000
    assert step.exposed_s == pytest.approx(4.2)


def test_buckets_overlap_backward_and_queue_on_the_link() -> None:
    workload = Workload(((1000,), (1000,)), (0.5, 1.0), 1.0, 2.0, 0.5, bucket_caps=(4000, 4000))
    assert workload.buckets() == [[0], [1]]
    step = predict(workload, method_of("allreduce"), TWO, free)
    # bucket 0 ready at 2, on the link until 6.2; bucket 1 ready at 3 waits for the link: 6.2 -> 10.4
    assert step.step_s == pytest.approx(10.4 + 0.5)
    slow_backward = Workload(((1000,), (1000,)), (0.5, 1.0), 1.0, 20.0, 0.0, bucket_caps=(4000, 4000))
    # bucket 0 lands (at 15.2) long before backward ends (at 21): only bucket 1's 4.2 s stay exposed
    assert predict(slow_backward, method_of("allreduce"), TWO, free).step_s == pytest.approx(21 + 4.2)


def test_compression_delays_backward_and_decompression_follows_the_collective() -> None:
    workload = Workload(((1000,),), (1.0,), 1.0, 2.0, 0.5)
    step = predict(workload, method_of("fp16"), TWO, lambda _: constant(0.3, 0.2, overhead=0.05))
    # 3 (forward + backward) + 0.3 compress; fp16's 2000 bytes: 0.2 + 2.0; + 0.05 engine overhead;
    # + 0.2 decompress; + 0.5 optimizer
    assert step.payload_bytes == 2000
    assert step.step_s == pytest.approx(3.3 + 2.2 + 0.05 + 0.2 + 0.5)
    assert step.compress_s == pytest.approx(0.3) and step.decompress_s == pytest.approx(0.2)


def test_multi_round_and_gather_compressors() -> None:
    workload = Workload(((64, 64),), (1.0,), 0.0, 1.0)
    costs = constant(0.1, 0.1, later=0.4)
    powersgd = predict(workload, method_of("powersgd:rank=2"), TWO, lambda _: costs)
    rounds = payload_bytes("powersgd:rank=2,warm_start=true", (64, 64))
    assert rounds == (64 * 2 * 4, 64 * 2 * 4)  # P, then Q
    # two all-reduces (0.2 + 512 * 0.001 each), the second round's compute between them
    assert powersgd.step_s == pytest.approx(1 + 0.1 + 2 * (0.2 + 0.512) + 0.4 + 0.1)
    four = Cluster(4, LINK)
    topk = predict(workload, method_of("topk:ratio=0.25"), four, lambda _: KernelCost((1,), (0,), (0,), (1.0,), (0.5,)))
    wire = payload_bytes("topk:ratio=0.25,method=exact,tolerance=0.2", (64, 64))[0]
    per_element = 1 / 1 * 4096  # interpolation above the largest size (1 element) scales per element
    assert topk.sent_bytes == 3 * wire
    assert topk.step_s == pytest.approx(1 + 3 * (0.1 + wire * 0.001) + per_element * (1 + 3 * 0.5))


def test_a_hierarchical_hook_is_priced_inside_and_across_nodes() -> None:
    """``local_size``: the node's ring reduce-scatter and all-gather of the bucket on the fast link,
    the spec's route among one rank per node on each tensor's half on the link's clock, the shard's
    kernels on backward's (they share the rank's compute)."""
    fast, slow = LinkCosts(alpha=0.0, beta=1e-6), LinkCosts(alpha=0.1, beta=0.001)
    cluster = Cluster(4, slow, local_size=2, intra=fast)
    workload = Workload(((1000,),), (1.0,), 1.0, 2.0, 0.5)
    exact = predict(workload, method_of("allreduce:local_size=2"), cluster, free)
    # inside: a ring all-reduce among 2 of 4000 bytes (4000 * 1e-6); across: the backend's ring among
    # 2 nodes of the 500-element half: 2 (2 - 1) 0.1 + 2 (2 - 1) / 2 2000 * 0.001
    assert exact.communicate_s == pytest.approx(0.004 + 0.2 + 2.0)
    assert exact.step_s == pytest.approx(3 + 0.004 + 2.2 + 0.5)
    assert exact.step_s == pytest.approx(3 + cluster.all_reduce("hierarchical", 4000) + 0.5)
    # sent: inside, 2 (2 - 1) / 2 of 4000 bytes; across, as much of the 2000-byte half
    assert exact.payload_bytes == 2000 and exact.sent_bytes == 4000 + 2000
    # a compressor pays its kernels on backward's clock, for its half of each tensor
    halves = predict(workload, method_of("fp16:local_size=2"), cluster, lambda _: constant(0.3, 0.2))
    flat = predict(workload, method_of("fp16"), cluster, lambda _: constant(0.3, 0.2))
    assert halves.compress_s == pytest.approx(0.3) and halves.decompress_s == pytest.approx(0.2)
    assert halves.payload_bytes == 1000
    assert halves.step_s == pytest.approx(3 + 0.004 + 0.3 + (0.2 + 1.0) + 0.2 + 0.5)
    assert halves.step_s < flat.step_s
    with pytest.raises(ValueError, match="does not divide"):
        predict(workload, method_of("fp16:local_size=3"), cluster, free)
    # on a shared uplink both local ranks cross at once: the backend's fitted all-gather at half speed
    gather = LinkCosts(alpha=0.05, beta=0.002)
    shared = Cluster(4, slow, local_size=2, intra=fast, native_all_gather=gather, shared_uplink=True)
    quantized = predict(workload, method_of("quantize:bits=8,local_size=2"), shared, free)
    payload = quantized.payload_bytes  # the half's codes and its scales, from one rank to the other node
    assert quantized.communicate_s == pytest.approx(0.004 + 0.05 + payload * 0.002 * 2)


def test_payload_bytes_are_the_compressors_own() -> None:
    for spec, shape in (
        ("fp16", (100,)),
        ("sign:chunk=1024", (33, 7)),
        ("quantize:chunk=1024,bits=4,rounding=stochastic", (1000,)),
    ):
        compressor = make_compressor(spec)
        expected = compressor.wire_bytes(compressor.compress(torch.randn(shape), key=0)[0])
        assert payload_bytes(spec, shape) == (expected,)


@pytest.mark.parametrize("model", [MLP(1024, [2048, 2048], 10), ResNet18()], ids=["mlp", "resnet18"])
def test_buckets_are_ddps(model: torch.nn.Module) -> None:
    parameters = list(model.parameters())
    workload = Workload.uniform([p.shape for p in parameters], 1.0)
    ready_order = list(reversed(parameters))
    expected, _ = dist._compute_bucket_assignment_by_size(ready_order, [1 << 20, 25 << 20])  # what DDP rebuilds
    assert workload.buckets() == expected


def test_uniform_workloads_and_their_checks() -> None:
    workload = Workload.uniform([(10, 10), (10,)], 0.3, backward_share=2 / 3)
    assert workload.shapes == ((10,), (10, 10)) and workload.ready == pytest.approx((10 / 110, 1.0))
    assert workload.forward_s == pytest.approx(0.1) and workload.backward_s == pytest.approx(0.2)
    assert workload.compute_s == pytest.approx(0.3)
    with pytest.raises(ValueError, match="ascending"):
        Workload(((1,), (1,)), (1.0, 0.5), 0, 0)
    with pytest.raises(ValueError, match="at least one gradient"):
        Workload((), (), 0, 0)
    with pytest.raises(ValueError, match="backward_share"):
        Workload.uniform([(1,)], 1.0, backward_share=0)
    # noop and a single rank: the compute alone
    assert predict(workload, method_of("noop"), TWO, free).step_s == pytest.approx(0.3)
    assert predict(workload, method_of("topk:ratio=0.1"), Cluster(1, LINK), free).step_s == pytest.approx(0.3)


def test_kernel_costs_interpolate_and_fit() -> None:
    cost = KernelCost((100, 1000), (1.0, 4.0), (0.0, 0.0), (2.0, 2.0), (0.5, 1.5))
    assert cost.compress(50) == 1.0  # the smallest's below the sizes
    assert cost.compress(550) == pytest.approx(2.5)  # linear between them
    assert cost.compress(2000) == pytest.approx(8.0)  # in proportion above them
    assert cost.decompress(1000, payloads=3) == pytest.approx(2.0 + 2 * 1.5)
    assert cost.overhead(10**6) == 0.0
    samples = [
        *(Sample("compress", 100, 1, 1.0), Sample("decompress", 100, 1, 2.0), Sample("decompress", 100, 4, 5.0)),
        *(Sample("compress", 1000, 1, 3.0), Sample("decompress", 1000, 1, 4.0), Sample("decompress", 1000, 4, 4.0)),
    ]
    fitted = kernel_costs.fit(samples)
    assert fitted.numel == (100, 1000) and fitted.extra_payload_s == (1.0, 0.0)
    assert KernelCost.from_dict(fitted.as_dict()) == fitted
    with pytest.raises(ValueError, match="no compress"):
        kernel_costs.fit(samples[1:3])
    with pytest.raises(ValueError, match="ascending"):
        KernelCost((10, 5), (1.0, 1.0), (0.0, 0.0), (1.0, 1.0), (0.0, 0.0))


def test_kernels_are_timed_on_real_compressors() -> None:
    samples = kernel_costs.measure("powersgd:rank=2", sides=(16, 32), repeats=1)
    assert {s.phase for s in samples} == {"compress", "next_round", "decompress"}
    gathered = kernel_costs.measure("topk:ratio=0.1", sides=(16, 32), repeats=1)
    assert {(s.phase, s.payloads) for s in gathered} == {("compress", 1), ("decompress", 1), ("decompress", 4)}
    assert all(s.seconds > 0 for s in samples + gathered)
    table = KernelTable({"fp16": constant(1.0, 1.0)}, repeats=1)
    assert table("fp16").compress(10) == 1.0 and table.timed_here == []
    table("sign")
    assert table.timed_here == ["sign:chunk=1024"]


def test_compute_is_measured_with_when_each_gradient_is_ready() -> None:
    torch.manual_seed(0)
    model = MLP(16, [32, 32], 4)
    inputs = torch.randn(8, 16)
    workload = measure(model, lambda m: m(inputs).square().mean(), torch.optim.SGD(model.parameters(), lr=0.1), 3)
    parameters = list(model.parameters())
    assert sorted(workload.shapes) == sorted(tuple(p.shape) for p in parameters)
    assert workload.ready[-1] == 1.0 and list(workload.ready) == sorted(workload.ready)
    assert {workload.shapes[0], workload.shapes[1]} == {(4,), (4, 32)}  # the last layer's gradients come first
    assert min(workload.forward_s, workload.backward_s, workload.optimizer_s) > 0
    assert math.isclose(workload.compute_s, workload.forward_s + workload.backward_s + workload.optimizer_s)


def test_a_compressor_that_takes_a_whole_part_pays_its_fixed_costs_once() -> None:
    """Kernels with a fixed cost per call (100 us, then 1 ns per element): priced per tensor for a
    compressor that runs tensor by tensor, once for the part for one that compresses it whole."""
    from gradcomp.bench.launches import gpt_shapes
    from gradcomp.cost.cluster import Cluster
    from gradcomp.cost.kernels import KernelCost
    from gradcomp.cost.step import bucket_cost, method_of

    fixed = KernelCost((1, 10**6), (1e-4, 1e-4 + 1e-3), (0.0, 0.0), (1e-4, 1e-4 + 1e-3), (0.0, 0.0))
    shapes = [tuple(s) for s in gpt_shapes()]
    numel = sum(math.prod(s) for s in shapes)
    link = Cluster(2, LinkCosts(1e-4, 1e-8))

    def compress_s(spec: str, layout: list[tuple[int, ...]]) -> float:
        return bucket_cost(layout, method_of(spec), link, lambda _: fixed).compress

    one = [(numel,)]
    assert compress_s("sign:ef=true", shapes) == pytest.approx(compress_s("sign:ef=true", one))
    assert compress_s("topk:ratio=0.01,ef=true", shapes) > compress_s("topk:ratio=0.01,ef=true", one) + 100 * 1e-4
