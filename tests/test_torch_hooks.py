"""torch's own hooks as ``torch:`` specs: parsing, the bytes they record against exact counts, gradients
against torch's hooks registered directly, PowerSGD's state saved and restored bitwise, and the
several-bucket PowerSGD case on gloo refused instead of hanging."""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks
from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.run import launch
from gradcomp.hooks import torch_hooks
from gradcomp.hooks.torch_hooks import PowerSGDOptions, TorchHookSpec, is_torch_spec
from tests.distributed import Failures, run_checks
from tests.toy_ddp import toy_batches, toy_model


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("torch:allreduce", "torch:allreduce"),
        (" torch:fp16 ", "torch:fp16"),
        ("torch:bf16", "torch:bf16"),
        ("torch:allreduce_hook", "torch:allreduce_hook"),
        ("torch:powersgd", "torch:powersgd"),
        ("torch:powersgd:rank=1,start=2,ef=true", "torch:powersgd"),  # defaults are left out
        ("torch:powersgd:start=100,rank=4", "torch:powersgd:rank=4,start=100"),  # in the options' order
        ("torch:powersgd:ef=false,warm_start=false,start=0", "torch:powersgd:start=0,ef=false,warm_start=false"),
        ("torch:powersgd:batched=true", "torch:powersgd:batched=true"),
    ],
)
def test_specs_parse_to_a_canonical_text_that_parses_back(text: str, canonical: str) -> None:
    spec = TorchHookSpec.parse(text)
    assert str(spec) == canonical and TorchHookSpec.parse(canonical) == spec and is_torch_spec(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("torch:fp32", "unknown torch hook 'fp32'; valid: torch:allreduce, torch:allreduce_hook"),
        ("torch:fp16:rank=2", "torch:fp16 takes no options"),
        ("torch:powersgd:rnak=2", "unknown option"),
        ("torch:powersgd:rank=0", "rank must be >= 1"),
        ("torch:powersgd:start=1", "start must be >= 2 with ef or warm_start"),
        ("torch:powersgd:rank=two", "must be an integer"),
        ("fp16", "starts with 'torch:'"),
    ],
)
def test_bad_specs_are_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TorchHookSpec.parse(text)


def test_training_configs_take_torch_specs_in_their_canonical_text() -> None:
    config = TrainConfig(steps=1, hook="torch:powersgd:rank=4,start=2")
    assert config.effective.hook == "torch:powersgd:rank=4"
    assert config.hook_spec == TorchHookSpec("powersgd", PowerSGDOptions(rank=4))
    with pytest.raises(ValueError, match="hook 'torch:powersgd:rank=-1'"):
        TrainConfig(steps=1, hook="torch:powersgd:rank=-1")


# -- inside ranks -------------------------------------------------------------------------------

STEPS = 6


def _train(ddp: DistributedDataParallel, batches: list[Any]) -> list[torch.Tensor]:
    """SGD steps (no momentum: the optimizer keeps no state); the gradients of each step."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads = []
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]))
        optimizer.step()
    return grads


def _one_bucket(seed: int = 0) -> DistributedDataParallel:
    return DistributedDataParallel(toy_model(seed), bucket_cap_mb=25)


def _powersgd_elements(model: torch.nn.Module, rank: int) -> int:
    """What PowerSGD sends per step, counted from the shapes: a matrix compressed at least 2x as its
    two factors, any other tensor as it is."""
    total = 0
    for p in model.parameters():
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        factors = (rows + cols) * rank
        total += factors if p.dim() > 1 and factors * 2 < rows * cols else p.numel()
    return total


def _records_and_gradients(rank: int, world: int) -> Failures:
    failures = Failures()
    batches = toy_batches(rank, STEPS)
    numel = sum(p.numel() for p in toy_model().parameters())

    # torch:fp16 is torch's fp16_compress_hook: the same gradients, bitwise; half the bytes
    ours = _one_bucket()
    state = torch_hooks.register(ours, "torch:fp16")
    direct = _one_bucket()
    direct.register_comm_hook(None, default_hooks.fp16_compress_hook)
    same = all(torch.equal(a, b) for a, b in zip(_train(ours, batches), _train(direct, batches), strict=True))
    failures.expect(same, "torch:fp16's gradients differ from fp16_compress_hook's")
    steps = state.steps()
    failures.expect([s.step for s in steps] == list(range(STEPS)), f"fp16 steps {[s.step for s in steps]}")
    failures.expect(all(s.input_bytes == 4 * numel and s.payload_bytes == 2 * numel for s in steps),
                    f"fp16 bytes {steps[0]}")  # fmt: skip
    failures.expect(all(s.sent_bytes is None and s.compress_s is None for s in steps), "fp16 claims a time")
    failures.expect(all(math.isclose(s.wire_bytes, s.payload_bytes * 2 * (world - 1) / world) for s in steps),
                    f"fp16 is not counted as a ring all-reduce of its payload: {steps[0]}")  # fmt: skip

    # torch:allreduce registers no hook: DDP's own path; a step is a forward outside no_sync
    builtin = _one_bucket()
    state = torch_hooks.register(builtin, "torch:allreduce")
    default = _one_bucket()
    same = all(torch.equal(a, b) for a, b in zip(_train(builtin, batches), _train(default, batches), strict=True))
    failures.expect(same, "torch:allreduce's gradients differ from DDP's default")
    with builtin.no_sync():
        torch.nn.functional.cross_entropy(builtin(batches[0][0]), batches[0][1]).backward()
    builtin.eval()
    builtin(batches[0][0])
    steps = state.steps()
    failures.expect(len(steps) == STEPS, f"torch:allreduce counted {len(steps)} steps, not {STEPS}")
    failures.expect(all(s.payload_bytes == s.input_bytes == 4 * numel for s in steps), f"bytes {steps[0]}")

    # torch:powersgd: the whole gradient before `start`, then factors and vectors, as counted from the shapes
    model = _one_bucket()
    state = torch_hooks.register(model, "torch:powersgd:rank=2,start=3", seed=1)
    _train(model, batches)
    payload = [s.payload_bytes // 4 for s in state.steps()]
    expected = [numel] * 3 + [_powersgd_elements(model.module, 2)] * (STEPS - 3)
    failures.expect(payload == expected, f"powersgd payload {payload}, expected {expected}")
    return failures


RESUME_TOLERANCE = 1e-6
"""A resumed torch PowerSGD run's first step multiplies matrices in DDP's first-step bucket layout,
where their alignment differs: the last bits of that step's products may differ (module docstring).
Without the layout reordering, residuals land on other parameters: differences of 1e-3 and more."""


def _powersgd_resume(rank: int, world: int) -> Failures:
    """Stopped after 3 steps (its state through torch.save and a weights-only load) and resumed in a
    fresh DDP model: the parameters of the run straight through, to the last bits of one step."""
    failures = Failures()
    batches = toy_batches(rank, STEPS)
    spec = "torch:powersgd:rank=2,start=2"
    straight = _one_bucket()
    torch_hooks.register(straight, spec, seed=5)
    _train(straight, batches)

    first = _one_bucket()
    state = torch_hooks.register(first, spec, seed=5)
    _train(first, batches[:3])
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _one_bucket(seed=99)  # other weights: the state and the parameters must be what is restored
    resumed.module.load_state_dict(first.module.state_dict())
    torch_hooks.register(resumed, spec, seed=123).load_state_dict(saved)
    _train(resumed, batches[3:])
    gap = max(float((a - b).abs().max()) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))
    failures.expect(gap <= RESUME_TOLERANCE, f"the resumed PowerSGD run's parameters differ by {gap:.2e}")
    other = torch_hooks.register(_one_bucket(), "torch:powersgd:rank=4", seed=5)
    try:
        other.load_state_dict(saved)
        failures.append("a state of rank 2 loaded into a rank-4 hook")
    except ValueError as error:
        failures.expect("saved by the hook 'torch:powersgd:rank=2'" in str(error), str(error))
    return failures


def _several_buckets_refused(rank: int, world: int) -> Failures:
    failures = Failures()
    model = DistributedDataParallel(toy_model(), bucket_cap_mb=0.005)
    state = torch_hooks.register(model, "torch:powersgd:rank=2")
    try:
        _train(model, toy_batches(rank, 4))
        failures.append("several buckets trained past torch PowerSGD's start on gloo")
    except Exception as error:  # DDP's backward raises what the hook raised
        failures.expect("hangs on gloo when DDP splits the gradients" in str(error), str(error))
        failures.expect(isinstance(state.error, ValueError), f"state.error is {state.error!r}")
    return failures


def _refused_setups(rank: int, world: int) -> Failures:
    """What torch's PowerSGD cannot run here is refused when registered, with the reason: its batched
    hook where this torch's _orthogonalize rejects one matrix (torch 2.13), find_unused_parameters on
    gloo (measured: torch's own powerSGD_hook aborted 3 of 3 runs with a layer used every third step)."""
    failures = Failures()
    batched = DistributedDataParallel(toy_model())
    if torch_hooks._batched_runs():
        torch_hooks.register(batched, "torch:powersgd:rank=2,batched=true")  # this torch's runs: taken
    else:
        with pytest.raises(ValueError, match="batched_powerSGD_hook fails at its first compressed step"):
            torch_hooks.register(batched, "torch:powersgd:rank=2,batched=true")
    unused = DistributedDataParallel(toy_model(), find_unused_parameters=True)
    with pytest.raises(ValueError, match="aborts on gloo with find_unused_parameters=True"):
        torch_hooks.register(unused, "torch:powersgd:rank=2")
    torch_hooks.register(DistributedDataParallel(toy_model(), find_unused_parameters=True), "torch:fp16")
    # the one entry for every kind of spec takes torch's too
    state = hooks.register(DistributedDataParallel(toy_model()), "torch:fp16")
    failures.expect(isinstance(state, torch_hooks.TorchHookState), f"hooks.register gave {type(state).__name__}")
    return failures


@pytest.mark.timeout(180)
def test_torch_powersgd_refuses_what_torch_cannot_run_here() -> None:
    run_checks(2, _refused_setups, timeout=60)


@pytest.mark.timeout(180)
def test_torch_hooks_record_what_they_send_and_match_torch_registered_directly() -> None:
    run_checks(2, _records_and_gradients, timeout=120)


@pytest.mark.timeout(180)
def test_torch_powersgd_resumes_bitwise_from_a_weights_only_state() -> None:
    run_checks(2, _powersgd_resume, timeout=120)


@pytest.mark.timeout(180)
def test_torch_powersgd_with_several_buckets_on_gloo_fails_on_every_rank_instead_of_hanging() -> None:
    run_checks(2, _several_buckets_refused, timeout=60)


@pytest.mark.timeout(240)
def test_a_training_run_with_torch_powersgd_resumes_where_the_straight_run_ends(tmp_path: Any) -> None:
    settings = {"task": "digits", "steps": 12, "batch_size": 32, "hook": "torch:powersgd:rank=2", "ranks": 2,
                "seed": 1, "eval_every": 6, "timeout": 120, "group_timeout": 60}  # fmt: skip
    straight = launch(TrainConfig(**settings, out=str(tmp_path / "straight")))
    config = TrainConfig(**settings, out=str(tmp_path / "resumed"), resume="auto")
    launch(dataclasses.replace(config, stop_at=5))
    resumed = launch(config)
    assert straight["status"] == resumed["status"] == "finished" and resumed["resumed_from"] == 5
    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)
    assert max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"]) <= RESUME_TOLERANCE
    assert a["progress"]["wire_bytes"] == b["progress"]["wire_bytes"] > 0
    metrics = straight["metrics"]
    assert metrics["compression_ratio"] > 2 and metrics["compress_ms"] is None and metrics["compute_ms"] > 0
