"""CompressedAdamW: AdamW itself until the freeze (bitwise, against torch's), a frozen variance and the
momentum averaged through the carrier after it, identical on every rank, resumed bitwise."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
from torch import nn

from gradcomp.hooks import CompressedAdamW, CompressedAdamWSpec
from tests.distributed import (
    Failures,
    identical_on_all_ranks,
    parameters_identical_on_all_ranks,
    run_checks,
    spawn_ranks,
)
from tests.toy_ddp import toy_batches, toy_model, wrap

LR, DECAY = 1e-2, 0.1


def _steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_until_the_freeze_it_is_torchs_adamw_bitwise() -> None:
    ours, theirs = toy_model(), toy_model()
    batches = toy_batches(0, 6)
    _steps(ours, CompressedAdamW(ours.parameters(), LR, weight_decay=DECAY, freeze=10), batches)
    _steps(theirs, torch.optim.AdamW(theirs.parameters(), LR, weight_decay=DECAY, foreach=False), batches)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("every", [0, 2])
def test_after_the_freeze_the_variance_is_frozen_or_averaged_every_few_steps(every: int) -> None:
    """``every`` 0: the variance and its bias correction stay as they were at the freeze. 2: the rank
    goes on learning it, and every 2 steps after the freeze the rank's own (one process: itself)
    becomes the one it divides by, with the bias correction of that step."""
    model, freeze, steps = toy_model(), 3, 8
    optimizer = CompressedAdamW(model.parameters(), LR, weight_decay=DECAY, freeze=freeze, variance_every=every)
    reference = copy.deepcopy(model)
    m = [torch.zeros_like(p) for p in reference.parameters()]
    v = [torch.zeros_like(p) for p in reference.parameters()]
    used = [torch.zeros_like(p) for p in reference.parameters()]  # the variance divided by
    used_at = 0
    for t, (x, y) in enumerate(toy_batches(0, steps), start=1):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert optimizer.compressing == (t > freeze)
        optimizer.step()
        reference.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        learns = t <= freeze or every > 0
        if t <= freeze or (every and (t - freeze) % every == 0):
            used_at = t
        with torch.no_grad():
            for p, mi, vi, ui in zip(reference.parameters(), m, v, used, strict=True):
                assert p.grad is not None
                mi.mul_(0.9).add_(p.grad, alpha=0.1)
                if learns:
                    vi.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                if used_at == t:
                    ui.copy_(vi)
                p.mul_(1 - LR * DECAY)
                denominator = (ui / (1 - 0.999**used_at)).sqrt() + 1e-8
                update = (mi / (1 - 0.9**t)) / denominator
                p.sub_(LR * (update if t <= freeze else update.clamp(-1, 1)))  # the bound after it
    assert optimizer.steps_done == steps and optimizer.variance_step() == (freeze if not every else 7)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_spec_reads_its_carriers_options_and_prints_its_canonical_text() -> None:
    spec = CompressedAdamWSpec.parse("compressed-adamw:freeze=30,carrier=topk:ratio=0.01,ef=true,beta2=0.99")
    assert (spec.freeze, spec.beta2) == (30, 0.99)
    assert spec.carrier == "topk:ratio=0.01,method=exact,tolerance=0.2,ef=true"
    assert CompressedAdamWSpec.parse(str(spec)) == spec
    assert str(CompressedAdamWSpec.parse("compressed-adamw")) == "compressed-adamw"
    assert str(CompressedAdamWSpec.parse("compressed-adamw:carrier=sign:ef=true")) == "compressed-adamw"
    both = CompressedAdamWSpec.parse(
        "compressed-adamw:carrier=sign:ef=true,vectors=dense,variance_every=16,variance_carrier=quantize:bits=8,chunk=64"
    )
    assert both.carrier == "sign:chunk=1024,ef=true,vectors=dense" and both.variance_every == 16
    assert both.variance_carrier == "quantize:chunk=64,bits=8,rounding=stochastic"
    assert CompressedAdamWSpec.parse(str(both)) == both


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("compressed-adamw:freeze=0", "freeze must be an integer >= 1"),
        ("compressed-adamw:carrier=noop", "noop would let them drift apart"),
        ("compressed-adamw:carrier=topk:ratio=0.01,ef=true,momentum=0.9", "momentum correction would apply a second"),
        ("compressed-adamw:beta1=1", "beta1 must be in"),
        ("compressed-adamw:variance_every=-1", "variance_every must be an integer >= 0"),
        ("compressed-adamw:variance_every=4,variance_carrier=noop", "noop would let them drift apart"),
        ("compressed-adamw:lr=3", "unknown compressed-adamw option 'lr=3'"),
        ("compressed-adamw:freeze=3,freeze=4", "given twice"),
        ("adamw:freeze=3", "starts with 'compressed-adamw'"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompressedAdamWSpec.parse(text)


def test_parameters_of_two_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="one dtype and device"):
        CompressedAdamW([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))])


def test_attach_refuses_a_model_that_is_not_ddp() -> None:
    """Issue 48, item 8: one line saying what it takes, not an ``AttributeError`` from inside."""
    net = nn.Linear(2, 2)
    optimizer = CompressedAdamW(net.parameters())
    with pytest.raises(ValueError, match=r"attach takes the DistributedDataParallel model .* got Linear"):
        optimizer.attach(net)  # type: ignore[arg-type]
    assert optimizer.hook_state is None


# -- among ranks -------------------------------------------------------------------------------------


def _train(
    rank: int, carrier: str, freeze: int, steps: int, warmup: str = "allreduce", every: int = 0
) -> tuple[nn.Module, CompressedAdamW, object]:
    ddp, _ = wrap(toy_model(), None)
    optimizer = CompressedAdamW(
        ddp.parameters(), LR, weight_decay=DECAY, freeze=freeze, carrier=carrier, variance_every=every
    )
    state = optimizer.attach(ddp, warmup)
    _steps(ddp, optimizer, toy_batches(rank, steps))
    return ddp, optimizer, state


def ranks_stay_identical(rank: int, world: int, carrier: str, every: int) -> Failures:
    failures = Failures()
    ddp, optimizer, state = _train(rank, carrier, freeze=3, steps=8, every=every)
    failures.expect(parameters_identical_on_all_ranks(list(ddp.parameters())), "parameters differ between ranks")
    momenta = [optimizer.state[p]["exp_avg"] for p in ddp.parameters()]
    variances = [optimizer.state[p]["exp_avg_sq"] for p in ddp.parameters()]
    failures.expect(parameters_identical_on_all_ranks(momenta + variances), "optimizer states differ between ranks")
    steps = state.steps()  # type: ignore[attr-defined]
    gradient = 4 * sum(p.numel() for p in ddp.parameters())
    failures.expect([s.step for s in steps] == list(range(8)), f"steps recorded: {[s.step for s in steps]}")
    failures.expect(all(s.payload_bytes == gradient for s in steps[:3]), "warm-up steps send the gradient")
    for t, s in enumerate(steps[3:], start=4):
        averaged = every and (t - 3) % every == 0  # the variances too, in bf16: half a gradient
        expected = gradient * (2 if averaged else 1)
        failures.expect(s.input_bytes == expected, f"step {t} handed over {s.input_bytes} bytes, not {expected}")
        low = gradient / 2 if averaged else 0
        failures.expect(low < s.payload_bytes < low + gradient / 20, f"step {t}'s payload: {s.payload_bytes}")
    return failures


@pytest.mark.parametrize(("world", "every"), [(2, 0), (3, 0), (2, 2)])
def test_every_rank_ends_with_the_same_parameters_and_optimizer_state(world: int, every: int) -> None:
    run_checks(world, ranks_stay_identical, ("sign:ef=true", every), timeout=120)


def exact_carrier(rank: int, world: int) -> list[torch.Tensor]:
    ddp, _, _ = _train(rank, "allreduce", freeze=2, steps=6)
    return [p.detach().clone() for p in ddp.parameters()]


def test_an_exact_carrier_is_adamw_on_the_averaged_gradient() -> None:
    """With an exact carrier (allreduce), the average of the ranks' momenta is the momentum of the
    averaged gradient: the run is one process's on the whole batch, to rounding."""
    world = 2
    ranks = spawn_ranks(world, exact_carrier, timeout=120)
    model = toy_model()
    optimizer = CompressedAdamW(model.parameters(), LR, weight_decay=DECAY, freeze=2)
    every_rank = [toy_batches(r, 6) for r in range(world)]
    for step in range(6):
        optimizer.zero_grad()
        for batches in every_rank:
            x, y = batches[step]
            (nn.functional.cross_entropy(model(x), y) / world).backward()
        optimizer.step()
    for parameters in ranks:
        for a, b in zip(parameters, model.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-6)


def resumes_bitwise(rank: int, world: int, directory: str) -> Failures:
    failures = Failures()
    straight, _, _ = _train(rank, "sign:ef=true", freeze=2, steps=8, every=2)
    ddp, optimizer, state = _train(rank, "sign:ef=true", freeze=2, steps=5, every=2)  # between two averages
    path = os.path.join(directory, f"rank{rank}.pt")
    torch.save({"model": ddp.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()}, path)  # type: ignore[attr-defined]
    saved = torch.load(path, weights_only=True)
    resumed, _ = wrap(toy_model(seed=1), None)  # other initial weights: the checkpoint must bring them
    again = CompressedAdamW(
        resumed.parameters(), LR, weight_decay=DECAY, freeze=2, carrier="sign:ef=true", variance_every=2
    )
    hook = again.attach(resumed)
    hook.load_state_dict(saved["hook"])
    resumed.load_state_dict(saved["model"])
    again.load_state_dict(saved["optimizer"])
    _steps(resumed, again, toy_batches(rank, 8)[5:])
    numbers = [s.step for s in hook.steps()]
    failures.expect(numbers == [5, 6, 7], f"a resumed run's statistics go on numbering the run's steps: {numbers}")
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        failures.expect(torch.equal(a, b), "a resumed run differs from the run straight through")
    failures.expect(identical_on_all_ranks(torch.cat([p.reshape(-1) for p in resumed.parameters()])), "ranks differ")
    return failures


def test_a_checkpoint_resumes_bitwise_after_the_freeze() -> None:
    with tempfile.TemporaryDirectory() as directory:
        run_checks(2, resumes_bitwise, (directory,), timeout=120)


def refusals(rank: int, world: int) -> Failures:
    failures = Failures()
    for warmup, message in (("noop", "drift apart"), ("topk:ratio=0.1,ef=true", "stranded")):
        ddp, _ = wrap(toy_model(), None)
        try:
            CompressedAdamW(ddp.parameters(), freeze=1).attach(ddp, warmup)
            failures.append(f"warm-up hook {warmup} was accepted")
        except ValueError as error:
            failures.expect(message in str(error), f"warm-up hook {warmup}: {error}")
    ddp, _ = wrap(toy_model(), None)
    optimizer = CompressedAdamW(ddp.parameters(), freeze=1)
    optimizer.attach(ddp)
    try:
        optimizer.attach(ddp)
        failures.append("a second attach was accepted")
    except RuntimeError as error:
        failures.expect("attached already" in str(error), str(error))
    ddp, _ = wrap(toy_model(), None)
    unattached = CompressedAdamW(ddp.parameters(), freeze=1)
    try:
        _steps(ddp, unattached, toy_batches(rank, 2))
        failures.append("a compressed step without attach was accepted")
    except RuntimeError as error:
        failures.expect("call attach(model) first" in str(error), str(error))
    return failures


def test_bad_combinations_are_refused_with_the_reason() -> None:
    run_checks(2, refusals, timeout=120)
