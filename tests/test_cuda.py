"""On a CUDA device (``make gpu-check``; skipped with the reason elsewhere): no compressor synchronizes
the host with the device in steady state (CUDA's own sync check, set to raise) or allocates device
memory (the caching allocator's count of cudaMalloc calls), results match the
CPU's, and work queued on the caller's stream stays correct; with two GPUs, DDP over NCCL under every
fixed-size hook makes no host read."""

from __future__ import annotations

import pytest
import torch

from gradcomp.compressors import make_compressor, simulate
from tests.distributed import Failures, run_checks

pytestmark = pytest.mark.cuda

FIXED = [
    "fp16", "bf16", "fp8", "quantize:bits=4", "quantize:bits=2,ef=true,momentum=0.9", "qsgd", "terngrad",
    "sign:ef=true", "sign:ef=ef21", "topk:ratio=0.01,ef=true", "topk:ratio=0.01,ef=true,momentum=0.9,mask=true",
    "randomk:ratio=0.01,scale=false,ef=true", "powersgd:rank=4,ef=true", "powersgd:rank=1",
]  # fmt: skip
"""Every fixed-size payload, with and without error feedback and momentum correction."""
DETERMINISTIC = [
    "fp16", "bf16", "fp8", "quantize:bits=4,rounding=nearest", "sign:ef=true", "topk:ratio=0.01",
    "quantize:bits=4", "quantize:bits=2,ef=true", "qsgd", "terngrad",
]  # fmt: skip
"""Specs whose result is the same on every device: the input's function, or stochastic rounding's
noise from counters (integer arithmetic); no torch.Generator draw, whose streams differ by device."""


def gradients(device: str, steps: int = 4) -> list[list[torch.Tensor]]:
    """Per step, two ranks' gradients of a bucket: a 1024 x 512 matrix and a vector, flat."""
    generator = torch.Generator().manual_seed(0)
    return [[torch.randn(1024 * 512 + 512, generator=generator).to(device) for _ in range(2)] for _ in range(steps)]


SHAPES = [torch.Size([1024, 512]), torch.Size([512])]


@pytest.mark.parametrize("spec", FIXED)
def test_steady_state_steps_never_synchronize_the_host(spec: str) -> None:
    ranks = [make_compressor(spec, rank=r) for r in range(2)]
    steps = gradients("cuda")
    simulate(ranks, steps[0], key="w", shapes=SHAPES)  # the first step allocates state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        for step in steps[1:]:
            simulate(ranks, step, key="w", shapes=SHAPES)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("spec", FIXED)
def test_steady_state_steps_take_no_new_device_memory(spec: str) -> None:
    """A steady step allocates the same sizes every time (``tests/test_allocations.py``, on the CPU):
    CUDA's caching allocator serves them all from its cache, with no device allocation (cudaMalloc)."""
    ranks = [make_compressor(spec, rank=r) for r in range(2)]
    steps = gradients("cuda", 6)
    for step in steps[:2]:  # state, workspaces and the cache settle
        simulate(ranks, step, key="w", shapes=SHAPES)
    torch.cuda.synchronize()
    segments = torch.cuda.memory_stats()["segment.all.allocated"]  # device allocations so far
    for step in steps[2:]:
        simulate(ranks, step, key="w", shapes=SHAPES)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["segment.all.allocated"] == segments


@pytest.mark.parametrize("spec", DETERMINISTIC)
def test_results_match_the_cpu(spec: str) -> None:
    on_cpu = simulate([make_compressor(spec, rank=r) for r in range(2)], gradients("cpu", 1)[0], "w", SHAPES)
    on_gpu = simulate([make_compressor(spec, rank=r) for r in range(2)], gradients("cuda", 1)[0], "w", SHAPES)
    for cpu, gpu in zip(on_cpu, on_gpu, strict=True):
        assert torch.allclose(gpu.cpu(), cpu, rtol=1e-5, atol=1e-6), spec


def test_counter_noise_is_the_cpus_bitwise() -> None:
    """Stochastic rounding's bytes and offsets from the same counters, on the GPU and on the CPU."""
    from gradcomp.compressors import counter
    from gradcomp.compressors.affine import noise
    from gradcomp.workspace import Workspace

    firsts = torch.arange(500, dtype=torch.int64).mul_(counter.signed(counter.GOLDEN * 129)).add_(12345)
    cpu, gpu = noise(firsts, 1000, Workspace()), noise(firsts.cuda(), 1000, Workspace())
    assert torch.equal(gpu.bytes.cpu(), cpu.bytes) and torch.equal(gpu.offsets.cpu(), cpu.offsets)


@pytest.mark.parametrize("spec", ["sign:ef=true", "powersgd:rank=4,ef=true", "quantize:bits=4"])
def test_work_on_the_callers_stream_is_correct(spec: str) -> None:
    """Compressed on a side stream (as a caller overlapping its own work would), the results are the
    default stream's: nothing the compressors queue reads a buffer another stream still writes."""
    steps = gradients("cuda", 3)
    expected = [simulate([make_compressor(spec, rank=r) for r in range(2)], s, "w", SHAPES) for s in steps]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    ranks = [make_compressor(spec, rank=r) for r in range(2)]
    with torch.cuda.stream(side):
        results = [simulate(ranks, s, "w", SHAPES) for s in steps]
    side.synchronize()
    for got, want in zip(results, expected, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), spec


def nccl_reads(rank: int, world: int) -> list[str]:
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import hooks

    failures = Failures()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    for spec in ["allreduce", *FIXED]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
        ddp = DistributedDataParallel(model, device_ids=[rank])
        state = hooks.register(ddp, spec)
        x, y = torch.randn(32, 512, device=device), torch.randint(0, 10, (32,), device=device)
        for _ in range(3):
            F.cross_entropy(ddp(x), y).backward()
        torch.cuda.synchronize()
        first = len(state.steps())
        for _ in range(2):
            F.cross_entropy(ddp(x), y).backward()
        torch.cuda.synchronize()
        reads = sum(step.host_reads or 0 for step in state.steps_since(first))
        failures.expect(reads == 0, f"{spec}: {reads} host reads in 2 steps")
    return failures


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over NCCL needs two GPUs")
@pytest.mark.timeout(280)
def test_ddp_over_nccl_reads_nothing_on_the_host() -> None:
    run_checks(2, nccl_reads, timeout=250, backend="nccl", fresh=True)
