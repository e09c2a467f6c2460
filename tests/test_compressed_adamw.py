"""CompressedAdamW: AdamW itself until the freeze (bitwise, against torch's), a frozen variance and the
momentum averaged through the carrier after it, identical on every rank, resumed bitwise."""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from gradcomp.bench.launches import gpt_shapes
from gradcomp.cost.roofline import traffic
from gradcomp.hooks import CompressedAdamW, CompressedAdamWSpec
from tests import host_reads
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


SETTLE = 0.17
"""A ``settle`` the toy model's variance reaches after a few dozen steps (at step 30, alone or among 2
or 3 ranks: its denominator moves by about 0.21 between steps 10 and 20, 0.13 to 0.16 to step 30)."""


@pytest.mark.parametrize("settle", [SETTLE, 0.14])
def test_freeze_auto_freezes_at_the_first_check_where_the_denominator_moved_less_than_settle(settle: float) -> None:
    """Every 10 steps the bias-corrected denominator ``sqrt(v / (1 - b2^t))`` of torch's AdamW (run
    alongside, bitwise the same until then) is compared with its value 10 steps before, relatively
    in L1: the optimizer freezes after the first step where that is below ``settle``, not before.
    (0.14 freezes at step 40 where the uncorrected ``sqrt(v)``, which moved by 0.09, would at 30.)"""
    ours, theirs = toy_model(), toy_model()
    optimizer = CompressedAdamW(ours.parameters(), LR, weight_decay=DECAY, freeze="auto", settle=settle)
    reference = torch.optim.AdamW(theirs.parameters(), LR, weight_decay=DECAY, foreach=False)
    frozen_at: int | None = None  # the reference's
    before: torch.Tensor | None = None
    for t, batch in enumerate(toy_batches(0, 46), start=1):
        assert optimizer.compressing == (frozen_at is not None), f"step {t}"
        _steps(ours, optimizer, [batch])
        _steps(theirs, reference, [batch])
        if frozen_at is not None:
            continue
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), f"step {t}, before the freeze, differs from torch's AdamW"
        if t % 10 == 0:
            v = [reference.state[p]["exp_avg_sq"] for p in theirs.parameters()]
            now = torch.cat([(s / (1 - 0.999**t)).sqrt().reshape(-1) for s in v])
            if before is not None and ((now - before).abs().sum() / now.sum()).item() < settle:
                frozen_at = t
            before = now
        assert optimizer.frozen_at == frozen_at, f"step {t}: frozen at {optimizer.frozen_at}, not {frozen_at}"
    assert frozen_at == {SETTLE: 30, 0.14: 40}[settle], f"the toy model's variance settled at step {frozen_at}"
    assert optimizer.frozen_at == frozen_at and optimizer.compressing and optimizer.variance_step() == frozen_at
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert not torch.equal(a, b), "after the freeze the momentum's update is the frozen one, not AdamW's"


def test_the_exchange_scale_is_adamws_denominator_floored_at_a_tenth_of_its_tensors_rms() -> None:
    """``sqrt(v / (1 - b2^t))``, each coordinate at least 0.1 of its tensor's root mean square (plus
    eps): a coordinate whose variance is 0 (a row never seen) divides by that floor; ones at step 0."""
    model = toy_model()
    optimizer = CompressedAdamW(model.parameters(), LR, weight_decay=DECAY, freeze=10)
    parameters = list(model.parameters())
    assert torch.equal(optimizer.exchange_scale(parameters, 0), torch.ones(sum(p.numel() for p in parameters)))
    _steps(model, optimizer, toy_batches(0, 3))
    optimizer.state[parameters[0]]["exp_avg_sq"][:5].zero_()  # five rows of the first layer never seen
    expected, floors = [], []
    for p in parameters:
        root = (optimizer.state[p]["exp_avg_sq"] / (1 - 0.999**3)).sqrt().reshape(-1)
        floors.append(0.1 * root.square().mean().sqrt() + 1e-8)
        expected.append(torch.maximum(root, floors[-1]))
    scale = optimizer.exchange_scale(parameters, 3)
    torch.testing.assert_close(scale, torch.cat(expected), rtol=1e-6, atol=0)
    unseen = scale[: 5 * 32]  # the first layer's weight is 64 x 32
    torch.testing.assert_close(unseen, floors[0].expand_as(unseen), rtol=1e-6, atol=0)


def test_the_exchange_scale_launches_as_many_operators_for_150_tensors_as_for_one() -> None:
    """A bucket of GPT-2's shape (150 tensors) against one tensor of as many elements, on an
    accelerator's paths: the same operators (kernels on a GPU), none per tensor, and no host read."""
    shapes = gpt_shapes()
    counts = []
    for layout in ([torch.Size([sum(s.numel() for s in shapes)])], shapes):
        parameters = [nn.Parameter(torch.randn(shape)) for shape in layout]
        optimizer = CompressedAdamW(parameters, LR, freeze=10, scaled=True)
        for p in parameters:
            p.grad = torch.randn_like(p)
        optimizer.step()
        optimizer.exchange_scale(parameters, 1, key=0)  # the first call keeps the bucket's buffer and sizes
        with host_reads.audit() as reads:
            counts.append(traffic(lambda: optimizer.exchange_scale(parameters, 1, key=0)).kernels)  # noqa: B023
        assert reads.gated == 0 and not reads.ungated
    assert counts[0] == counts[1] and counts[0] < 20, counts


def test_a_tensor_without_variance_yet_is_floored_by_the_whole_exchange_and_an_empty_one_is_skipped() -> None:
    """A tensor that has had no gradient yet (variance 0 throughout) divides by a tenth of the whole
    exchange's root mean square, not by eps (its first gradient would swamp its chunk's range); a
    tensor of no elements takes part without error."""
    seen, unseen, empty = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(0))
    optimizer = CompressedAdamW([seen, unseen, empty], LR, freeze=10, scaled=True)
    seen.grad = torch.tensor([1.0, 2.0, 3.0, 4.0])
    optimizer.step()
    scale = optimizer.exchange_scale([seen, unseen, empty], 1)
    roots = seen.grad.abs()  # sqrt(v / (1 - b2)) after one step is |g|
    everyone = torch.cat([roots, torch.zeros(3)]).square().mean().sqrt()
    torch.testing.assert_close(scale[4:], (0.1 * everyone + 1e-8).expand(3), rtol=1e-6, atol=0)
    torch.testing.assert_close(scale[:4], roots, rtol=1e-6, atol=0)
    outside = nn.Parameter(torch.ones(2))  # in DDP's buckets, not in this optimizer: floored as unseen
    scale = optimizer.exchange_scale([seen, outside], 1)
    floor = 0.1 * torch.cat([roots, torch.zeros(2)]).square().mean().sqrt() + 1e-8
    torch.testing.assert_close(scale[4:], floor.expand(2))
    assert outside not in optimizer.state


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


def test_the_spec_reads_freeze_auto_settle_and_scaled_and_prints_only_what_differs() -> None:
    spec = CompressedAdamWSpec.parse("compressed-adamw:freeze=auto,settle=0.05,scaled=true")
    assert (spec.freeze, spec.settle, spec.scaled) == ("auto", 0.05, True)
    assert CompressedAdamWSpec.parse(str(spec)) == spec
    name, _, options = str(spec).partition(":")
    assert name == "compressed-adamw"
    assert sorted(options.split(",")) == ["freeze=auto", "scaled=true", "settle=0.05"]
    defaults = CompressedAdamWSpec.parse("compressed-adamw:freeze=100,settle=0.1,scaled=false")
    assert defaults == CompressedAdamWSpec() and str(defaults) == "compressed-adamw"
    assert str(CompressedAdamWSpec.parse("compressed-adamw:freeze=auto,settle=0.1")) == "compressed-adamw:freeze=auto"
    optimizer = CompressedAdamW.from_spec(toy_model().parameters(), spec, LR, DECAY)
    assert optimizer.spec == spec and optimizer.frozen_at is None and not optimizer.compressing


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("compressed-adamw:freeze=0", r"freeze must be an integer >= 1 .* or 'auto' \(when it has settled\), got 0"),
        ("compressed-adamw:freeze=auto2", "freeze must be an integer >= 1 or 'auto' .*, got 'auto2'"),
        ("compressed-adamw:freeze=auto,settle=0", r"settle must be in \(0, 1\).*got 0.0"),
        ("compressed-adamw:freeze=auto,settle=1", r"settle must be in \(0, 1\).*got 1.0"),
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
    rank: int,
    carrier: str,
    freeze: int | str,
    steps: int,
    warmup: str = "allreduce",
    every: int = 0,
    **options: Any,
) -> tuple[nn.Module, CompressedAdamW, object]:
    """``options``: CompressedAdamW's others (``scaled``, ``settle``)."""
    ddp, _ = wrap(toy_model(), None)
    optimizer = CompressedAdamW(
        ddp.parameters(), LR, weight_decay=DECAY, freeze=freeze, carrier=carrier, variance_every=every, **options
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


def scaled_ranks_stay_identical(rank: int, world: int, carrier: str, freeze: int | str, scaled: bool) -> dict[str, Any]:
    """A lossy warm-up (quantize:bits=4) and a lossy carrier, each exchange scaled by Adam's
    denominator or not: the ranks' parameters and moments, bitwise, and the step each froze at."""
    failures = Failures()
    steps = 36 if freeze == "auto" else 8
    ddp, optimizer, _ = _train(rank, carrier, freeze, steps, warmup="quantize:bits=4", scaled=scaled, settle=SETTLE)
    failures.expect(parameters_identical_on_all_ranks(list(ddp.parameters())), "parameters differ between ranks")
    momenta = [optimizer.state[p]["exp_avg"] for p in ddp.parameters()]
    variances = [optimizer.state[p]["exp_avg_sq"] for p in ddp.parameters()]
    failures.expect(parameters_identical_on_all_ranks(momenta + variances), "optimizer states differ between ranks")
    failures.expect(optimizer.compressing, f"not compressing after {steps} steps (frozen at {optimizer.frozen_at})")
    failures.expect(not scaled or "momentum" in optimizer._scales, "the momentum was not scaled")
    return {"failures": failures, "frozen_at": optimizer.frozen_at}


@pytest.mark.parametrize(
    ("world", "carrier", "freeze", "scaled"),
    [
        (2, "quantize:bits=2,rounding=nearest,ef=true", 3, True),
        (3, "sign:ef=true", 3, True),
        (2, "sign:ef=true", "auto", True),
        (3, "quantize:bits=2,rounding=nearest,ef=true", "auto", True),
        (3, "sign:ef=true", "auto", False),
    ],
)
def test_scaled_or_auto_lossy_exchanges_leave_every_rank_identical_and_frozen_at_one_step(
    world: int, carrier: str, freeze: int | str, scaled: bool
) -> None:
    results = run_checks(world, scaled_ranks_stay_identical, (carrier, freeze, scaled), timeout=120)
    frozen = [r["frozen_at"] for r in results]
    assert len(set(frozen)) == 1, f"the ranks froze at {frozen}"
    checks = (20, 30)  # freeze=auto: a check's step within the 36 steps (the first to compare is 20's)
    assert frozen[0] in (checks if freeze == "auto" else (freeze,)), f"the ranks froze at {frozen}"


def scaled_exact_steps(rank: int, world: int) -> list[list[torch.Tensor]]:
    """The parameters after each of 7 steps, scaled, with exact exchanges (a freeze at 3)."""
    ddp, _ = wrap(toy_model(), None)
    optimizer = CompressedAdamW(ddp.parameters(), LR, weight_decay=DECAY, freeze=3, carrier="allreduce", scaled=True)
    optimizer.attach(ddp)
    snapshots = []
    for batch in toy_batches(rank, 7):
        _steps(ddp, optimizer, [batch])
        snapshots.append([p.detach().clone() for p in ddp.parameters()])
    return snapshots


def test_scaled_exact_exchanges_are_adamw_on_the_averaged_gradient_before_and_after_the_freeze() -> None:
    """Dividing each exchange by Adam's denominator and multiplying the average back changes nothing
    but rounding: with allreduce before and after the freeze, every step is one process's on the
    whole batch (unscaled: it exchanges nothing)."""
    ranks = spawn_ranks(2, scaled_exact_steps, timeout=120)
    for step, model in enumerate(_whole_batch_steps(2, steps=7, freeze=3)):
        for snapshots in ranks:
            for a, b in zip(snapshots[step], model.parameters(), strict=True):
                torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-7, msg=f"step {step + 1} differs")


def scale_buffers_are_kept(rank: int, world: int) -> Failures:
    """Each bucket's scale, then the momentum's, is one buffer refilled step after step (once DDP has
    rebuilt its buckets, after the first step)."""
    failures = Failures()
    ddp, _ = wrap(toy_model(), None)
    optimizer = CompressedAdamW(ddp.parameters(), LR, weight_decay=DECAY, freeze=6, scaled=True)
    optimizer.attach(ddp)
    kept: dict[object, torch.Tensor] = {}
    for t, batch in enumerate(toy_batches(rank, 10), start=1):
        _steps(ddp, optimizer, [batch])
        if t in (2, 7):  # the buckets' after DDP's rebuild; the momentum's at its first compressed step
            kept = {key: optimizer._scales[key] for key in optimizer._scales}
            held = {key: (scale.data_ptr(), scale.clone()) for key, scale in kept.items()}
            continue
        if t < 2:
            continue
        for key, scale in kept.items():
            now = optimizer._scales.get(key)
            failures.expect(now is scale and now.data_ptr() == held[key][0], f"step {t}: {key!r}'s scale reallocated")
            if t <= 6:  # a bucket's: refilled with the last step's denominators
                failures.expect(not torch.equal(scale, held[key][1]), f"step {t}: bucket {key!r}'s scale not refilled")
        if t <= 6:
            held = {key: (scale.data_ptr(), scale.clone()) for key, scale in kept.items()}
    buckets = [key for key in kept if isinstance(key, int)]
    failures.expect(len(buckets) >= 2 and "momentum" in kept, f"scales kept: {list(kept)}")
    return failures


def test_a_scaled_exchange_allocates_each_scale_once() -> None:
    run_checks(2, scale_buffers_are_kept, timeout=120)


def exact_carrier(rank: int, world: int) -> list[torch.Tensor]:
    ddp, _, _ = _train(rank, "allreduce", freeze=2, steps=6)
    return [p.detach().clone() for p in ddp.parameters()]


def _whole_batch_steps(world: int, steps: int, freeze: int) -> Iterator[nn.Module]:
    """The reference for exact exchanges: one process's CompressedAdamW on every rank's batch at once
    (each rank's loss over ``world``), the model after each step."""
    model = toy_model()
    optimizer = CompressedAdamW(model.parameters(), LR, weight_decay=DECAY, freeze=freeze)
    every_rank = [toy_batches(r, steps) for r in range(world)]
    for step in range(steps):
        optimizer.zero_grad()
        for batches in every_rank:
            x, y = batches[step]
            (nn.functional.cross_entropy(model(x), y) / world).backward()
        optimizer.step()
        yield model


def test_an_exact_carrier_is_adamw_on_the_averaged_gradient() -> None:
    """With an exact carrier (allreduce), the average of the ranks' momenta is the momentum of the
    averaged gradient: the run is one process's on the whole batch, to rounding."""
    ranks = spawn_ranks(2, exact_carrier, timeout=120)
    *_, model = _whole_batch_steps(2, steps=6, freeze=2)
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


def auto_resumes_bitwise(rank: int, world: int, directory: str, scaled: bool) -> Failures:
    """freeze=auto, checkpointed after a check that did not freeze (its denominator held to compare
    with) and resumed into a fresh optimizer: the same freeze, and bitwise the run straight through."""
    failures = Failures()
    options: dict[str, Any] = {"scaled": scaled, "settle": SETTLE}
    straight, done, _ = _train(rank, "sign:ef=true", "auto", 36, **options)
    ddp, optimizer, state = _train(rank, "sign:ef=true", "auto", 25, **options)
    held = optimizer.state_dict()["freeze"]
    failures.expect(held["frozen_at"] is None and held["settle_before"] is not None, f"saved at step 25: {held}")
    path = os.path.join(directory, f"rank{rank}.pt")
    torch.save({"model": ddp.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()}, path)  # type: ignore[attr-defined]
    saved = torch.load(path, weights_only=True)
    resumed, _ = wrap(toy_model(seed=1), None)
    again = CompressedAdamW(resumed.parameters(), LR, weight_decay=DECAY, freeze="auto", carrier="sign:ef=true",
                            **options)  # fmt: skip
    hook = again.attach(resumed)
    hook.load_state_dict(saved["hook"])
    resumed.load_state_dict(saved["model"])
    again.load_state_dict(saved["optimizer"])
    _steps(resumed, again, toy_batches(rank, 36)[25:])
    failures.expect(done.frozen_at is not None, "the run straight through never froze")
    failures.expect(again.frozen_at == done.frozen_at, f"resumed: frozen at {again.frozen_at}, not {done.frozen_at}")
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        failures.expect(torch.equal(a, b), "a resumed run differs from the run straight through")
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        for name in ("exp_avg", "exp_avg_sq"):
            failures.expect(torch.equal(done.state[p][name], again.state[q][name]), f"resumed {name} differs")
    return failures


@pytest.mark.parametrize("scaled", [False, True])
def test_a_checkpoint_before_an_auto_freeze_resumes_to_the_same_freeze_bitwise(scaled: bool) -> None:
    with tempfile.TemporaryDirectory() as directory:
        run_checks(2, auto_resumes_bitwise, (directory, scaled), timeout=120)


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
