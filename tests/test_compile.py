"""``torch.compile`` (Dynamo and Inductor's C++ backend) with gradcomp hooks, on 2 gloo ranks: the
compiled model trains as the eager one does under the same hook, the lossless hook as the compiled
model without one, and the replicas stay bitwise identical. Under compiled autograd's Python reducer
DDP calls hooks per parameter: refused with the reason, at registration and at the first call."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import Failures, run_checks

STEPS = 6


def train(hook: str | None, compiled: bool, rank: int) -> tuple[list[float], torch.Tensor]:
    """Losses and final flat parameters after STEPS SGD steps of the toy model under ``hook``, on one
    batch per rank (so that the loss falls)."""
    from tests.toy_ddp import toy_batches, toy_model, wrap

    torch._dynamo.reset()
    ddp, _state = wrap(toy_model(), hook, bucket_cap_mb=None)  # Dynamo's DDPOptimizer wants DDP's buckets
    model = torch.compile(ddp, backend="inductor") if compiled else ddp
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for x, y in toy_batches(rank, 1) * STEPS:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])


def compiled_training(rank: int, world: int) -> dict[str, Any]:
    from tests.distributed import identical_on_all_ranks

    failures = Failures()
    try:
        spec = "topk:ratio=0.3,ef=true"
        _, eager = train(spec, False, rank)
        losses, compiled = train(spec, True, rank)
        failures.expect(torch.allclose(compiled, eager, rtol=1e-4, atol=1e-6), f"{spec}: compiled != eager")
        failures.expect(identical_on_all_ranks(compiled), f"{spec}: replicas differ")
        failures.expect(losses[-1] < losses[0], f"{spec}: the loss did not fall: {losses}")
        _, plain = train(None, True, rank)
        _, lossless = train("allreduce", True, rank)
        failures.expect(torch.allclose(lossless, plain, rtol=1e-5, atol=1e-7), "allreduce hook != DDP's, compiled")
    finally:
        torch._dynamo.reset()
    return {"failures": failures}


@pytest.mark.timeout(280)
def test_a_compiled_model_trains_under_a_gradcomp_hook_as_the_eager_one() -> None:
    run_checks(2, compiled_training, timeout=250)


def python_reducer(rank: int, world: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import hooks
    from tests.toy_ddp import toy_model

    failures = Failures()
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        ddp = DistributedDataParallel(toy_model())
    try:
        hooks.register(ddp, "fp16")
        failures.append("registered on a DDP model whose hooks get parameters")
    except ValueError as error:
        failures.expect("optimize_ddp" in str(error), f"unclear: {error}")
    state, hook = hooks.make("fp16")
    try:
        hook(state, (torch.zeros(3), torch.nn.Parameter(torch.zeros(3))))  # type: ignore[arg-type]
        failures.append("a per-parameter call went through")
    except TypeError as error:
        failures.expect("python_reducer" in str(error), f"unclear: {error}")
    return failures


@pytest.mark.timeout(120)
def test_hooks_handed_parameters_by_the_python_reducer_are_refused() -> None:
    run_checks(2, python_reducer, timeout=90)


def auto_compiled(rank: int, world: int) -> dict[str, Any]:
    """``auto``'s forward hooks keep their bookkeeping out of the graph: after a warm-up the compiled
    model runs step after step without one recompilation (traced, a branch on their list's length
    recompiled at every step, up to dynamo's limit)."""
    from gradcomp import hooks
    from tests.toy_ddp import toy_batches, toy_model

    failures = Failures()
    torch._dynamo.reset()
    ddp = torch.nn.parallel.DistributedDataParallel(toy_model())
    hooks.register(ddp, "auto:candidates=topk:ratio=0.1,ef=true,measure_at=2")
    model = torch.compile(ddp, backend="inductor")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        for step, (x, y) in enumerate(toy_batches(rank, 1) * 10):
            torch._dynamo.config.error_on_recompile = step >= 5
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    except Exception as error:
        failures.append(f"{type(error).__name__}: {str(error)[:300]}")
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()
    return {"failures": failures}


@pytest.mark.timeout(280)
def test_auto_under_compile_does_not_recompile_at_every_step() -> None:
    run_checks(2, auto_compiled, timeout=250)
