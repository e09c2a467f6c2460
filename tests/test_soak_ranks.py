"""The long run (``make soak``, not in ``make test``): 2000 steps at 2 ranks for each compressor
family, with error feedback where it applies. Past the statistics' cap (the engine keeps its latest
10,000 bucket records; the toy model has 6 buckets, so the cap is reached at step 1667), memory
stays flat; and a hook leaves no thread, open file or process group behind (gradcomp's executor
thread and its one process group per parent group are made by the first hook of a process). The
same for ``auto`` (compressing, deciding again every 200 steps), FSDP2's reduce-scatter and DiLoCo
(2 fragments in flight 2 steps)."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.hooks import HookState
from gradcomp.sync import DiLoCo
from tests.distributed import Failures, run_checks
from tests.toy_ddp import Batch, sgd_steps, toy_batches, toy_model, wrap

pytestmark = pytest.mark.soak

FAMILIES = [
    "allreduce", "fp16", "bf16", "fp8", "quantize:bits=4,ef=true", "qsgd", "terngrad", "sign:ef=true",
    "topk:ratio=0.01,ef=true", "randomk:ratio=0.05,scale=false,ef=true", "threshold:tau=0.5,ef=true",
    "powersgd:rank=2,ef=true",
]  # fmt: skip
"""Every family, with error feedback where it is contractive (random-k unscaled: docs/compressors.md)."""
STEPS, CAPPED = 2000, 1700
RSS_GROWTH_LIMIT = 4 << 20
"""Bytes the resident set may grow between step 1700 and step 2000 (allocator noise, not a leak: a
leak of one tensor per bucket would be 300 steps x 6 buckets of them)."""


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resources() -> tuple[int, int, int]:
    """Threads, open files and process groups of this process (after a garbage collection)."""
    gc.collect()
    return threading.active_count(), len(os.listdir("/proc/self/fd")), len(dist.distributed_c10d._world.pg_map)


def memory_grew(capped: int) -> list[str]:
    """The resident memory's growth since ``capped``, if past its allowance (call it while the state
    under test is still held: what it leaks is freed with it)."""
    grown = resident_bytes() - capped
    if grown < RSS_GROWTH_LIMIT:
        return []
    return [f"resident memory grew {grown / 2**20:.1f} MiB in {STEPS - CAPPED} steps"]


def left_behind(before: tuple[int, int, int]) -> list[str]:
    """More threads, open files or process groups than ``before`` (fewer is fine: e.g. a socket closed
    late); call it once the state under test is released."""
    after = resources()
    if all(a <= b for a, b in zip(after, before, strict=True)):
        return []
    return [f"threads, files, groups {before} before, {after} after"]


def train(spec: str, batches: list[Batch], steps: int) -> tuple[int, HookState]:
    """``steps`` steps with a fresh hook; the resident bytes once the statistics' cap was reached."""
    ddp, state = wrap(toy_model(), spec, bucket_cap_mb=1e-5)  # a bucket per parameter: 6
    assert state is not None
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    capped = 0
    for step in range(0, steps, len(batches)):
        sgd_steps(ddp, optimizer, batches)
        if step + len(batches) == CAPPED:
            capped = resident_bytes()
    if not all(bool(torch.isfinite(p).all()) for p in ddp.parameters()):
        raise AssertionError(f"{spec}: diverged")
    return capped, state


def soak(rank: int, world: int, spec: str) -> Failures:
    failures = Failures()
    batches = toy_batches(rank, 50)
    train(spec, batches, 50)  # what a process makes once: gradcomp's executor thread and process group
    before = resources()
    capped, state = train(spec, batches, STEPS)
    grew = memory_grew(capped)
    assert state.engine is not None
    failures.expect(len(state.engine.records) == 10_000, f"{spec}: {len(state.engine.records)} records kept")
    del state
    failures += [f"{spec}: {what}" for what in grew + left_behind(before)]
    return failures


@pytest.mark.timeout(900)
@pytest.mark.parametrize("spec", FAMILIES)
def test_2000_steps_leave_nothing_behind(spec: str) -> None:
    run_checks(2, soak, (spec,), timeout=300)


# -- the newer surfaces: auto, FSDP2's reduce-scatter, DiLoCo ---------------------------------------

SURFACES = ["auto", "fsdp", "diloco"]


def surface(name: str, rank: int) -> tuple[Callable[[int], None], Callable[[], None], object]:
    """A fresh training setup of ``name``: its step (given the step's number), its end (a
    synchronizer's flush), and its state (held until the check of what is left behind)."""
    batches = toy_batches(rank, 50)
    if name == "fsdp":
        from gradcomp import hooks
        from tests.test_fsdp import batch, sharded

        net = sharded()
        state: object = hooks.fsdp(net, "quantize:bits=4,ef=true")
        optimizer = torch.optim.SGD(net.parameters(), lr=0.001)

        def sharded_step(step: int) -> None:
            optimizer.zero_grad()
            net(batch(rank, step % 50)).square().mean().backward()
            optimizer.step()

        return sharded_step, lambda: None, state
    if name == "diloco":
        model = toy_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        outer = DiLoCo(model, inner, every=10, spec="quantize:bits=4,ef=true", fragments=2, delay=2)
        return (lambda step: local_step(model, inner, outer, batches[step % 50])), outer.flush, outer
    # auto, compressing (a dear link), deciding again every 200 steps between two lossy candidates
    spec = "auto:candidates=topk:ratio=0.05,ef=true|quantize:bits=4,ef=true,measure_at=2,check_every=200"
    ddp, hook_state = wrap(toy_model(), spec, bucket_cap_mb=1e-5, link=LinkCosts(1e-3, 1e-6))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    return (lambda step: sgd_steps(ddp, optimizer, batches[step % 50 : step % 50 + 1])), lambda: None, hook_state


def local_step(model: torch.nn.Module, inner: torch.optim.Optimizer, outer: DiLoCo, batch: Batch) -> None:
    inner.zero_grad()
    torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    inner.step()
    outer.step()


def soak_surface(rank: int, world: int, name: str) -> Failures:
    """2000 steps of ``name`` after a warm-up run: memory flat over the last 300, nothing left behind."""
    failures = Failures()
    step, end, _ = surface(name, rank)
    for i in range(50):  # what a process makes once: gradcomp's executor thread and process groups
        step(i)
    end()
    before = resources()
    step, end, state = surface(name, rank)
    capped = 0
    for i in range(STEPS):
        step(i)
        if i + 1 == CAPPED:
            capped = resident_bytes()
    end()
    grew = memory_grew(capped)
    del step, end, state
    failures += [f"{name}: {what}" for what in grew + left_behind(before)]
    return failures


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SURFACES)
def test_2000_steps_of_auto_fsdp2_and_diloco_leave_nothing_behind(name: str) -> None:
    run_checks(2, soak_surface, (name,), timeout=300)
