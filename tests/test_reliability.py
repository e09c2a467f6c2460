"""What goes wrong between ranks ends as a clear error within the user's timeout, one bad step never
poisons what the hook keeps, and valid but unusual input (subgroups, empty and complex parameters)
gives what DDP's own path gives. On real gloo ranks; docs/reliability.md lists what each proves."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks
from gradcomp.collectives.cost_model import LinkCosts
from gradcomp.engine.spec import HookSpec
from gradcomp.hooks.auto import AutoState
from tests.distributed import (
    Failures,
    parameters_identical_on_all_ranks,
    peer_stops,
    run_checks,
    spawn_ranks,
    stay_until_written,
)
from tests.toy_ddp import sgd_steps, toy_batches, toy_model, wrap

GROUP_TIMEOUT = 5.0
"""What init_process_group is given in the fault scenarios: every wait must end within about this."""
AUTO_TOPK = "auto:candidates=topk:ratio=0.05,ef=true,measure_at=2,check_every=1000"
"""``auto`` with one lossy candidate, deciding once (at step 2): given a dear link, it compresses from then on."""


# -- one NaN does not end training ---------------------------------------------------------------


def nan_at_step_5(rank: int, world: int, specs: list[str]) -> Failures:
    """GradScaler skips exactly the step whose batch held an Inf (on rank 0 only), then trains on
    (the hook follows the scaler; ``auto`` compresses from its decision at step 2, a dear link)."""
    failures = Failures()
    for spec in specs:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        options = {"link": LinkCosts(1e-3, 1e-6)} if spec.startswith("auto") else {}
        ddp, _ = wrap(toy_model(), spec, scaler=scaler, **options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        skipped = []
        for step, (x, y) in enumerate(toy_batches(rank, 12)):
            if step == 5 and rank == 0:
                x = x.clone()
                x[0, 0] = float("inf")
            optimizer.zero_grad()
            scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
        failures.expect(skipped == [i == 5 for i in range(12)], f"{spec}: skipped steps {skipped}")
        failures.expect(all(bool(torch.isfinite(p).all()) for p in ddp.parameters()), f"{spec}: non-finite model")
        failures.expect(parameters_identical_on_all_ranks(list(ddp.parameters())), f"{spec}: ranks differ")
    return failures


def test_one_non_finite_batch_skips_one_step_under_gradscaler() -> None:
    specs = ["topk:ratio=0.1,ef=true", "powersgd:rank=2,ef=true", "fp16:ef=true", "sign:ef=true", AUTO_TOPK]
    run_checks(2, nan_at_step_5, (specs,), timeout=240)


def train_under_a_scale(
    rank: int, spec: str, scaled: bool, follow: bool, hand_over_at: int | None = None, **options: Any
) -> list[torch.Tensor]:
    """8 steps of DDP with ``spec`` (``options`` to ``hooks.register``) under a GradScaler whose scale
    doubles every step (``scaled``), given to the hook when ``follow``. ``hand_over_at``: after that
    step, ``auto`` hands every tensor back to the uncompressed all-reduce (their residuals wait, pending,
    for the next step's gradients: made at one scale, added at the next)."""
    ddp = DistributedDataParallel(toy_model(), bucket_cap_mb=0.005)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1) if scaled else None
    state = hooks.register(ddp, spec, scaler=scaler if follow else None, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step, (x, y) in enumerate(toy_batches(rank, 8)):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        if step == hand_over_at:
            assert isinstance(state, AutoState) and state.choice, "auto chose no compressor to hand over from"
            state._install(dict.fromkeys(state.choice, 0))
            assert state.pending, "no residual in hand-over"
    assert scaler is None or scaler.get_scale() == 2.0**12, "the scale doubled at each of 8 steps"
    return [p.detach().clone() for p in ddp.parameters()]


def under_a_changing_scale(rank: int, world: int, specs: list[str]) -> Failures:
    """Error feedback under a GradScaler whose scale doubles every step: the hook that follows the
    scaler trains bitwise as it does without a scaler (a loss scale changes by powers of two, so
    every residual rescales exactly); one that does not follow it trains otherwise (its residuals
    are added at the size of the scale they were made in). ``auto`` (a dear link: it compresses from
    its decision at step 2) with its residuals in hand-over too."""
    failures = Failures()
    cases: list[tuple[str, dict[str, Any]]] = [(spec, {}) for spec in specs]
    cases.append((AUTO_TOPK, {"link": LinkCosts(1e-3, 1e-6), "hand_over_at": 4}))
    for spec, options in cases:
        plain = train_under_a_scale(rank, spec, scaled=False, follow=False, **options)
        followed = train_under_a_scale(rank, spec, scaled=True, follow=True, **options)
        failures.expect(all(torch.equal(a, b) for a, b in zip(followed, plain, strict=True)),
                        f"{spec}: under a changing scale it differs from the run without a scaler")  # fmt: skip
        lost = train_under_a_scale(rank, spec, scaled=True, follow=False, **options)
        failures.expect(not all(torch.equal(a, b) for a, b in zip(lost, plain, strict=True)),
                        f"{spec}: not following the scale changes nothing: the test proves nothing")  # fmt: skip
    return failures


def test_error_feedback_follows_the_loss_scale() -> None:
    specs = ["topk:ratio=0.05,ef=true", "topk:ratio=0.05,ef=true,momentum=0.9", "sign:ef=ef21",
             "quantize:bits=4,ef=true"]  # fmt: skip
    run_checks(2, under_a_changing_scale, (specs,), timeout=240)


# -- the group DDP communicates on ----------------------------------------------------------------


def subgroup_ddp(rank: int, world: int) -> Failures:
    """DDP on the subgroups {0, 1} and {2, 3}: the hook averages over the model's own group only,
    bitwise as DDP's built-in all-reduce does."""
    failures = Failures()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    x, y = toy_batches(rank, 1)[0]
    grads = []
    for hook in (None, "allreduce", "fp16"):
        ddp, _ = wrap(toy_model(), hook, ddp_options={"process_group": mine})
        nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append([p.grad for p in ddp.parameters()])
    reference, allreduce, fp16 = grads
    failures.expect(all(torch.equal(a, b) for a, b in zip(reference, allreduce, strict=True)), "allreduce differs")
    close = all(torch.allclose(a, b, rtol=1e-2, atol=1e-3) for a, b in zip(reference, fp16, strict=True))
    failures.expect(close, "fp16 is not the subgroup's average")
    return failures


def test_the_hook_averages_over_the_group_ddp_communicates_on() -> None:
    run_checks(4, subgroup_ddp, timeout=240)


# -- empty and complex parameters ---------------------------------------------------------------


class Unusual(nn.Module):
    """A linear layer, an empty parameter and a complex one, all with gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(32, 10)
        self.empty = nn.Parameter(torch.zeros(0, 16))
        self.phase = nn.Parameter(torch.randn(10, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * self.phase).abs() + self.empty.sum()


UNUSUAL_SPECS = ["allreduce", "fp16", "quantize:bits=4", "qsgd", "sign:ef=true", "terngrad", "topk:ratio=0.5,ef=true"]


def unusual_parameters(rank: int, world: int) -> Failures:
    failures = Failures()
    batches = toy_batches(rank, 3)
    reference, _ = wrap(Unusual(), None)
    sgd_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    for spec in UNUSUAL_SPECS:
        ddp, _ = wrap(Unusual(), spec)
        sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches)
        parameters = list(ddp.parameters())
        failures.expect(parameters[0].shape == (0, 16) and parameters[1].is_complex(), f"{spec}: shapes changed")
        failures.expect(all(bool(torch.isfinite(p).all()) for p in parameters), f"{spec}: non-finite")
        failures.expect(parameters_identical_on_all_ranks(parameters), f"{spec}: ranks differ")
        if spec == "allreduce":
            same = all(torch.equal(a, b) for a, b in zip(reference.parameters(), parameters, strict=True))
            failures.expect(same, "allreduce differs from DDP's built-in path with empty and complex parameters")
    return failures


def test_empty_and_complex_parameters_train_with_every_kind_of_hook() -> None:
    run_checks(2, unusual_parameters, timeout=240)


# -- every wait ends within the timeout, with an error that names what went wrong ---------------


def frozen_or_absent_peer(rank: int, world: int, how: str, spec: str, record: str) -> None:
    """Rank 1 freezes (SIGSTOP) or raises and stays alive; rank 0's next step must fail within the
    group's timeout, naming rank 1, and its hook state keeps gradcomp's own error. ``auto`` decides
    at step 2 (a dear link: to compress) and trains two more steps before rank 1 stops."""
    together = 4 if spec.startswith("auto") else 2  # steps before rank 1 stops
    # 100 kB/s: top-k is predicted ~5x faster (240 ms a step), whatever a loaded machine times its kernels at
    # (at 1 MB/s a bucket could stay uncompressed, and fail on the backend's all-reduce, unnamed)
    options = {"link": LinkCosts(1e-3, 1e-5)} if spec.startswith("auto") else {}
    ddp, state = wrap(toy_model(), spec, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    batches = toy_batches(rank, together + 1)
    sgd_steps(ddp, optimizer, batches[:together])
    assert state is not None
    peer_stops(rank, how, record, lambda: sgd_steps(ddp, optimizer, batches[together:]), lambda: state.error,
               at_most=3 * GROUP_TIMEOUT)  # fmt: skip


@pytest.mark.parametrize(
    ("how", "spec", "named"),
    [
        ("frozen", "topk:ratio=0.1,ef=true,algo=ring", "rank 1"),
        ("alive", "topk:ratio=0.1,ef=true,algo=ring", "rank 1"),
        ("frozen", "topk:ratio=0.1,ef=true", "rank 0 of 2: the backend's all-gather of a bucket failed"),
        ("frozen", "allreduce", "rank 0 of 2: the backend's all-reduce of a bucket failed"),
        ("frozen", "auto:candidates=topk:ratio=0.1,ef=true,algo=ring,measure_at=2,check_every=1000", "rank 1"),
    ],
)
def test_a_frozen_or_silent_peer_is_an_error_within_the_timeout(
    how: str, spec: str, named: str, tmp_path: Path
) -> None:
    """gradcomp's own transfers (``algo=ring``) name the peer; the backend's all-reduce and
    all-gather (``algo=native``) cannot say which peer they waited for, so the error says which
    rank and what failed."""
    record = tmp_path / "rank0.txt"
    spawn_ranks(2, frozen_or_absent_peer, (how, spec, str(record)), timeout=120, group_timeout=GROUP_TIMEOUT)
    seen = eval(record.read_text())  # written by rank 0 with repr()
    assert seen["elapsed"] < 6 * GROUP_TIMEOUT, seen  # the group's timeout, not gloo's 30 minutes
    assert named in seen["error"] and "PeerError" in seen["error"], seen
    assert seen["kept"] == "PeerError", seen


def noop_against_topk(rank: int, world: int, record: str) -> str:
    try:
        ddp, _ = wrap(toy_model(), "noop" if rank == 0 else "topk:ratio=0.1")
        sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), toy_batches(rank, 2))
    except RuntimeError as error:
        Path(record).write_text("gave up")
        return f"{type(error).__name__}: {error}"
    # noop finished without communicating; it stays until rank 1 gave up
    stay_until_written(record, at_most=2 * GROUP_TIMEOUT)
    return "finished"


def test_a_rank_with_another_hook_is_named_as_the_likely_cause(tmp_path: Path) -> None:
    """Rank 0 (noop) creates no process group for its hook, so rank 1's engine waits for it in vain;
    rank 0 may finish, or time out in DDP's own collectives waiting for rank 1: either way no hang."""
    began = time.monotonic()
    results = spawn_ranks(2, noop_against_topk, (str(tmp_path / "gave-up"),), timeout=120, group_timeout=GROUP_TIMEOUT)
    assert time.monotonic() - began < 60
    assert results[1].startswith("PeerError") and "another hook (noop creates none)" in results[1], results[1]


# -- hook state records what it belongs to ------------------------------------------------------


def test_a_hook_state_from_another_spec_or_world_size_is_refused_naming_both() -> None:
    state = hooks.HookState(HookSpec.parse("topk:ratio=0.1,ef=true"), None, world=2)
    saved = state.state_dict()
    assert saved == {"spec": "topk:ratio=0.1,method=exact,tolerance=0.2,ef=true", "world_size": 2}
    with pytest.raises(ValueError, match=r"saved by the hook 'topk:ratio=0.1.*at world size 2; this hook is 'fp16'"):
        hooks.HookState(HookSpec.parse("fp16"), None, world=2).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"at world size 2; this hook is .* at world size 1"):
        hooks.HookState(HookSpec.parse("topk:ratio=0.1,ef=true"), None, world=1).load_state_dict(saved)
    with pytest.raises(ValueError, match="not a gradcomp hook state"):
        state.load_state_dict({"compressor": {}})
