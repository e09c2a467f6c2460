"""gradcomp hooks inside real DDP on gloo ranks, against DDP's default and torch's own hooks."""

from __future__ import annotations

import datetime
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks
from tests.distributed import Failures, parameters_identical_on_all_ranks, run_checks, spawn_ranks
from tests.helpers import SPECS, with_feedback
from tests.toy_ddp import TORCH_FP16, gradients, sgd_steps, toy_batches, toy_model, train, wrap

SAME_MODEL = "parameters differ between ranks"


def compare_with_torch(rank: int, world: int) -> dict[str, Any]:
    failures = Failures()
    default, _ = train(rank, None, 8)
    ours, _ = train(rank, "allreduce", 8)
    ring, _ = train(rank, "none", 8)
    failures.expect(all(torch.equal(a, b) for a, b in zip(default, ours, strict=True)), "allreduce differs from DDP's")
    failures.expect(
        all(torch.allclose(a, b, atol=1e-6) for a, b in zip(default, ring, strict=True)),
        "none (gradcomp's ring) not close to DDP's default",
    )
    failures.expect(parameters_identical_on_all_ranks(ours), SAME_MODEL)
    fp16_torch, fp16_ours = gradients(rank, TORCH_FP16)[0], gradients(rank, "fp16")[0]
    return {
        "failures": failures,
        # in units of the result's fp16 spacing (2**-10 relative, 2**-24 absolute below 2**-14)
        "fp16 difference": max(
            float(((a - b).abs() / (a.abs() * 2.0**-10).clamp_min(2.0**-24)).max())
            for a, b in zip(fp16_torch, fp16_ours, strict=True)
        ),
        "fp16 identical elements": sum(int((a == b).sum()) for a, b in zip(fp16_torch, fp16_ours, strict=True))
        / sum(a.numel() for a in fp16_ours),
    }


def test_allreduce_and_fp16_hooks_match_torch() -> None:
    """allreduce: bitwise DDP's default (and none, gradcomp's ring, close to it). fp16: torch's
    fp16_compress_hook, except that we divide by the world size before the cast (rule "divide before sum") and
    torch after it, in fp16, which rounds a contribution in fp16's subnormal range (below 2**-14)
    once more; the sum can then round to the neighbouring fp16 value. So: at most one fp16 spacing
    apart, and equal almost everywhere."""
    for result in run_checks(2, compare_with_torch, timeout=240):
        assert result["fp16 difference"] <= 1.0
        assert result["fp16 identical elements"] > 0.95


def wide_replicas(rank: int, world: int) -> Failures:
    """Matrices large enough for BLAS to split them over threads (1024 x 1024): PowerSGD rank 4 decompresses
    on the backend's completion thread, which must multiply as the process's other threads do."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    ddp = DistributedDataParallel(net)
    hooks.register(ddp, "powersgd:rank=4,ef=true")
    generator = torch.Generator().manual_seed(rank)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(12):
        optimizer.zero_grad()
        x, y = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    failures = Failures()
    failures.expect(parameters_identical_on_all_ranks(list(net.parameters())), SAME_MODEL)
    return failures


@pytest.mark.timeout(180)
def test_replicas_stay_bitwise_equal_when_the_backend_thread_decompresses_wide_matrices() -> None:
    run_checks(2, wide_replicas, timeout=120)


def train_many_buckets(rank: int, world: int, spec: str) -> Failures:
    params, _ = train(rank, spec, 200, bucket_cap_mb=0.002)
    failures = Failures()
    failures.expect(parameters_identical_on_all_ranks(params), SAME_MODEL)
    return failures


@pytest.mark.parametrize("spec", ["powersgd:rank=2,ef=true", "topk:ratio=0.1,ef=true", "quantize:bits=4"])
def test_multi_round_and_gather_compressors_run_200_steps_with_many_buckets(spec: str) -> None:
    """torch's powerSGD_hook aborts on gloo with more than one bucket; ours keeps every rank in step."""
    run_checks(2, train_many_buckets, (spec,), timeout=240)


def test_powersgd_runs_200_steps_at_4_ranks_with_many_buckets() -> None:
    run_checks(4, train_many_buckets, ("powersgd:rank=1,ef=true",), timeout=240)


def mismatched_specs(rank: int, world: int) -> Failures:
    failures = Failures()
    try:
        train(rank, "topk:ratio=0.1" if rank == 0 else "topk:ratio=0.2", 1)
    except Exception as error:
        message = str(error)
        failures.expect("different hook specs" in message, f"unexpected error: {message}")
        failures.expect("topk:ratio=0.1" in message and "topk:ratio=0.2" in message, f"not both specs: {message}")
    else:
        failures.append("trained")
    return failures


def test_ranks_with_different_specs_fail_at_the_first_step_naming_both() -> None:
    run_checks(2, mismatched_specs, timeout=120)


def test_a_bad_spec_fails_before_training() -> None:
    with pytest.raises(ValueError, match="unknown compressor 'topq'"):
        hooks.make("topq:ratio=0.1")


def resume(rank: int, world: int, spec: str) -> Failures:
    """N steps, checkpoint (model, optimizer, hook state through torch.save / weights_only load),
    a fresh process state, M more steps == N + M steps uninterrupted, bitwise."""
    data = toy_batches(rank, 10)

    def fresh() -> tuple[DistributedDataParallel, torch.optim.Optimizer, hooks.HookState]:
        ddp, state = wrap(toy_model(), spec, seed=3)
        assert state is not None
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), state

    ddp, optimizer, straight = fresh()
    sgd_steps(ddp, optimizer, data)
    uninterrupted = [p.detach().clone() for p in ddp.parameters()]

    ddp, optimizer, state = fresh()
    sgd_steps(ddp, optimizer, data[:6])
    buffer = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    ddp, optimizer, state = fresh()
    ddp.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["hook"])
    sgd_steps(ddp, optimizer, data[6:])
    failures = Failures()
    for index, (a, b) in enumerate(zip(uninterrupted, ddp.parameters(), strict=True)):
        failures.expect(torch.equal(a, b), f"parameter {index} differs from the uninterrupted run's")
    # The engine's learned transfer sizes came back too. DDP buckets its first iteration as at step
    # 0, and step 0 of the uninterrupted run spent one round of 8-byte frames per bucket learning
    # the padded all-gather's capacities: the resumed run's first step sends exactly that less, and
    # its later steps exactly what the uninterrupted run's last steps sent. (Payloads of the same
    # shapes on every rank are gathered unpadded: nothing to learn.)
    sent, first = [s.sent_bytes for s in state.steps()], straight.steps()[0]
    expected = [s.sent_bytes for s in straight.steps()][6:]
    assert straight.engine is not None
    padded = not straight.engine.compressor.capabilities.same_shapes
    if padded and first.sent_bytes is not None and first.buckets is not None:  # a gathered payload (the native
        expected[0] = first.sent_bytes - 8 * (world - 1) * first.buckets  # all-reduce's is not observable)
    elif first.sent_bytes is not None:  # bucketed as step 0: payloads batched by size align as they did there
        expected[0] = first.sent_bytes
    if "warmup=" in spec:  # the first resumed step, inside the warm-up, all-gathers exact sizes (no
        sent, expected = sent[1:], expected[1:]  # capacity) over DDP's first bucketing: other buckets
    failures.expect(sent == expected, f"the resumed steps sent {sent}, expected {expected}")
    return failures


@pytest.mark.parametrize(
    "spec",
    [
        "topk:ratio=0.1,ef=true",
        "powersgd:rank=2,ef=true",
        "quantize:bits=2",
        # stopped at step 6 inside an 8-step warm-up: dense steps, then the ratio schedule's end
        "quantize:bits=2,ef=true,momentum=0.9,warmup=8",
        "topk:ratio=0.1,ef=true,momentum=0.9,nesterov=true,clip=1,warmup=8",
        "sign:ef=ef21",
    ],
)
def test_checkpoint_and_resume_continue_exactly(spec: str) -> None:
    run_checks(2, resume, (spec,), timeout=240)


class TwoHeads(nn.Module):
    """A model whose second head is unused: DDP needs find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.used, self.unused = nn.Linear(32, 64), nn.Linear(64, 10), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(torch.relu(self.body(x)))


def run_options(
    rank: int, options: dict[str, Any], hook: str | None, dtype: str, accumulate: int
) -> list[torch.Tensor]:
    """The parameters after 6 optimizer steps, each over ``accumulate`` batches (no_sync between)."""
    net = TwoHeads() if options.get("find_unused_parameters") else toy_model()
    ddp, _ = wrap(net.to(getattr(torch, dtype)), hook, ddp_options=options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step, (x, y) in enumerate(toy_batches(rank, 6 * accumulate)):
        loss = nn.functional.cross_entropy(ddp(x.to(getattr(torch, dtype))).float(), y)
        if (step + 1) % accumulate:
            with ddp.no_sync():  # accumulate locally, communicate every `accumulate` steps
                loss.backward()
            continue
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().float().clone() for p in ddp.parameters()]


OPTIONS = [
    ({"gradient_as_bucket_view": True}, "float32", 1),
    ({"static_graph": True}, "float32", 1),
    ({}, "float32", 3),  # no_sync accumulation
    ({"find_unused_parameters": True}, "float32", 1),
    ({}, "bfloat16", 1),
    ({}, "float16", 1),
]


def check_options(rank: int, world: int, index: int) -> Failures:
    options, dtype, accumulate = OPTIONS[index]
    failures = Failures()
    default = run_options(rank, options, None, dtype, accumulate)
    ours = run_options(rank, options, "allreduce", dtype, accumulate)
    failures.expect(all(torch.equal(a, b) for a, b in zip(default, ours, strict=True)), "allreduce differs from DDP's")
    compressed = run_options(rank, options, "topk:ratio=0.2,ef=true", dtype, accumulate)
    failures.expect(parameters_identical_on_all_ranks(compressed), f"top-k hook: {SAME_MODEL}")
    failures.expect(all(torch.isfinite(p).all() for p in compressed), "top-k hook: non-finite parameters")
    return failures


@pytest.mark.parametrize("index", range(len(OPTIONS)), ids=[f"{o}-{d}-x{a}" for o, d, a in OPTIONS])
def test_ddp_options_and_half_precision_parameters(index: int) -> None:
    """One group of ranks per configuration, each comparing DDP's default, the allreduce hook and a
    compressed hook; find_unused_parameters makes DDP communicate on its own group during backward."""
    run_checks(2, check_options, (index,), timeout=240)


def measure(rank: int, world: int, spec: str, trace: str) -> dict[str, Any]:
    params, state = train(rank, spec, 3, algo="ring")
    assert state is not None
    state.write_trace(f"{trace}.{rank}")
    return {"steps": state.steps(), "params": sum(p.numel() * 4 for p in params)}


@pytest.mark.parametrize(("spec", "ratio"), [("fp16", 2.0), ("powersgd:rank=1", None), ("sign", None)])
def test_statistics_and_trace(spec: str, ratio: float | None, tmp_path: Path) -> None:
    trace = str(tmp_path / "trace.json")
    results = spawn_ranks(2, measure, (spec, trace), timeout=240)
    for rank, result in enumerate(results):
        steps = result["steps"]
        assert [s.step for s in steps] == [0, 1, 2]
        for s in steps:
            assert s.input_bytes == result["params"]  # every gradient byte, once per step
            assert s.buckets >= (1 if s.step == 0 else 2)  # DDP rebuilds its buckets after step 0
            if ratio is not None:
                assert s.compression_ratio == pytest.approx(ratio)
            else:
                assert s.compression_ratio > 4
            assert s.sent_bytes > 0 and s.received_bytes > 0  # gradcomp's ring: observable
            assert s.wire_bytes == s.sent_bytes
            assert s.compress_s > 0 and s.communicate_s > 0 and s.decompress_s > 0
        with open(f"{trace}.{rank}") as file:
            events = json.load(file)["traceEvents"]
        names = {e["name"] for e in events}
        assert {"queued", "compress", "communicate", "decompress"} <= names
        assert sum(e["name"].startswith("ready") for e in events) == sum(s.buckets for s in steps)
        routes = {e["args"]["routes"] for e in events if "args" in e}  # the plan's, as gradcomp explain names them
        assert routes == {"sum" if spec != "sign" else "gather (alike)"}, routes  # algo=ring: gradcomp's all-gather


LOSSY_BOUNDS = {  # worst error of the averaged gradient, relative to each parameter's largest |g|
    "fp16": 2.0**-10,
    "bf16": 2.0**-7,
    "fp8:format=e4m3,chunk=64": 2.0**-3,
    "quantize:bits=8,rounding=nearest,chunk=64": 2.0 / 255,
    "quantize:bits=4,chunk=64": 2.0 * 2 / 15,
    "topk:ratio=1.0": 1e-6,
}


def worst_relative_error(approx: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """The largest error of any parameter's gradient, relative to that gradient's largest |g|."""
    return max(
        float((a - e).abs().max() / e.abs().max()) for a, e in zip(approx, exact, strict=True) if e.abs().max() > 0
    )


def lossy_errors(rank: int, world: int) -> dict[str, float]:
    exact, _ = gradients(rank, "allreduce")
    return {spec: worst_relative_error(gradients(rank, spec)[0], exact) for spec in LOSSY_BOUNDS}


def test_every_lossy_hook_stays_within_its_documented_bound() -> None:
    for errors in spawn_ranks(2, lossy_errors, timeout=240):
        for spec, bound in LOSSY_BOUNDS.items():
            assert errors[spec] <= bound, f"{spec}: {errors[spec]} > {bound}"
        assert errors["fp16"] > 0  # and they do compress


def noop_training(rank: int, world: int) -> float:
    params, _ = train(rank, "noop", 3)
    return float(sum(p.double().sum() for p in params))


def test_noop_does_not_communicate() -> None:
    first, second = spawn_ranks(2, noop_training, timeout=120)
    assert first != second  # each rank trained on its own data only


def test_make_accepts_string_and_tuple_specs_and_aliases() -> None:
    # no process group is needed to refuse, and refusing happens before any group is touched
    with pytest.raises(ValueError, match="unknown option"):
        hooks.make(("allreduce", {"ratio": 0.1}))
    state, _ = hooks.make("noop")
    assert state.engine is None and state.steps() == [] and state.state_dict() == {"spec": "noop", "world_size": 1}


def two_phase_against_exact(rank: int, world: int) -> dict[str, Any]:
    exact, _ = gradients(rank, "allreduce")
    result: dict[str, Any] = {}
    for aggregation in ("gather", "two_phase"):
        grads, state = gradients(
            rank, "quantize:bits=8,rounding=nearest,chunk=64", aggregation=aggregation, algo="ring"
        )
        assert state is not None
        result[aggregation] = worst_relative_error(grads, exact)
        result[f"{aggregation} sent"] = state.steps()[0].sent_bytes
    trained, _ = train(rank, "topk:ratio=0.2,ef=true", 20, aggregation="two_phase")
    result["failures"] = Failures()
    result["failures"].expect(parameters_identical_on_all_ranks(trained), f"two_phase training: {SAME_MODEL}")
    return result


def test_two_phase_aggregation() -> None:
    """Two-phase: within two compression errors of the exact average, fewer bytes than all-gather
    at 4 ranks, and bitwise-identical models on every rank."""
    step = 2.0 / 255  # 8-bit nearest rounding over a chunk's range: at most half a step, twice
    for result in run_checks(4, two_phase_against_exact, timeout=240):
        assert result["gather"] <= step
        assert result["two_phase"] <= 2 * step
        assert result["two_phase sent"] < result["gather sent"]


def test_two_phase_is_refused_for_summable_compressors() -> None:
    with pytest.raises(ValueError, match="two_phase is for gather compressors"):
        hooks.make("fp16", aggregation="two_phase")


def every_compressor(rank: int, world: int) -> dict[str, Any]:
    specs: list[Any] = [*SPECS, *[with_feedback(s) for s in SPECS]]
    specs += ["fp16:algo=ring", "sign:aggregation=two_phase,seed=5", ("topk", {"ratio": 0.1, "algo": "tree"})]
    failures = Failures()
    for spec in specs:
        params, _ = train(rank, spec, 3)
        failures.expect(parameters_identical_on_all_ranks(params), f"{spec}: {SAME_MODEL}")
        failures.expect(all(abs(p.double().sum().item()) < 1e6 for p in params), f"{spec}: diverged")
    return {"failures": failures, "specs": [str(spec) for spec in specs]}


def test_every_compressor_with_and_without_error_feedback_trains_in_step() -> None:
    first, second = run_checks(2, every_compressor, timeout=240)
    assert first["specs"] == second["specs"] and len(set(first["specs"])) == 41


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fp16:aggregation=two_phase", "two_phase is for gather compressors"),
        ("topk:algo=butterfly", "unknown all-reduce algorithm 'butterfly'"),
        ("topk:aggregation=sometimes", "unknown aggregation 'sometimes'"),
        ("noop:ratio=1", "noop takes no options"),
        ("sign:seed=x", "seed must be an integer"),
        ("allreduce:ratio=0.1", r"unknown option\(s\) \['ratio'\] for 'none'"),
    ],
)
def test_hook_spec_options_are_checked_before_training(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hooks.make(spec)


LAZY_SPEC = "topk:ratio=0.1,ef=true"


def made_before_the_group(rank: int, world: int, store: str) -> dict[str, Any]:
    """Hook states made before ``init_process_group`` (as Lightning's ``DDPStrategy`` takes them):
    the engine comes at the first bucket, and the run is the one a state made after would give; a
    state loaded meanwhile is applied then; a state bound to the world refuses another group."""
    import torch.distributed as dist

    failures = Failures()
    dist.destroy_process_group()  # the launcher made one: start as a script would, without
    state, hook = hooks.make(LAZY_SPEC)
    later, later_hook = hooks.make(LAZY_SPEC)
    failures.expect(state.engine is None and later.engine is None, "an engine was made without a process group")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    batches = toy_batches(rank, 5)
    lazy = DistributedDataParallel(toy_model())
    lazy.register_comm_hook(state, hook)
    reference, _ = wrap(toy_model(), LAZY_SPEC, bucket_cap_mb=None)
    for ddp in (lazy, reference):
        sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches[:4])
    same = all(torch.equal(a, b) for a, b in zip(lazy.parameters(), reference.parameters(), strict=True))
    failures.expect(same, "made before the group: not the run of a state made after it")
    steps = len(state.steps())
    failures.expect(steps == 4 and state.world == world, f"steps {steps}, world {state.world}")
    # a state loaded before its first bucket: kept as it is, then applied when the engine is made
    saved = state.state_dict()
    later.load_state_dict(saved)
    failures.expect(later.state_dict() is saved, "a state loaded before the first bucket did not stay as it was")
    again = DistributedDataParallel(toy_model())
    again.load_state_dict(lazy.state_dict())
    again.register_comm_hook(later, later_hook)
    for ddp in (lazy, again):
        sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches[4:])
    same = all(torch.equal(a, b) for a, b in zip(lazy.parameters(), again.parameters(), strict=True))
    failures.expect(same, "the residuals loaded before the first bucket were not applied")
    # a hook state serves one group
    alone = [dist.new_group([r]) for r in range(world)][rank]
    try:
        hooks.register(DistributedDataParallel(toy_model(), process_group=alone), state)
        failures.append("a state bound to the world was registered on another group")
    except ValueError as error:
        failures.expect("serves ranks" in str(error), f"unclear refusal: {error}")
    return {"failures": failures}


def test_a_hook_state_made_before_the_process_group_binds_at_its_first_bucket(tmp_path: Path) -> None:
    run_checks(2, made_before_the_group, (str(tmp_path / "store"),), timeout=120, fresh=True)


CYCLE_SPECS = ["allreduce", "topk:ratio=0.1,ef=true", "powersgd:rank=2,ef=true", "quantize:bits=4", "fp16:algo=ring"]


def steps_leave_no_cycles(rank: int, world: int) -> Failures:
    """What a step leaves behind is freed when its last reference goes, not by a garbage collection:
    an object a collection frees late (or never, at exit) may hold a backend's future, whose
    freeing at interpreter exit aborts a gloo process."""
    import gc

    failures = Failures()
    for spec in CYCLE_SPECS:
        ddp, _ = wrap(toy_model(), spec)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        sgd_steps(ddp, optimizer, toy_batches(rank, 3))  # DDP rebuilds its buckets at the first
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            sgd_steps(ddp, optimizer, toy_batches(rank, 2))
            gc.collect()
            left = sorted({type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage
                           if type(o).__module__.startswith(("gradcomp", "concurrent", "torch"))})  # fmt: skip
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        failures.expect(not left, f"{spec}: a step left cycles holding {left}")
    return failures


def test_steps_leave_no_reference_cycles() -> None:
    run_checks(2, steps_leave_no_cycles, timeout=120)


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(datetime.timedelta(0), ValueError), (-1, ValueError), (float("inf"), ValueError), ("30", TypeError),
     (True, TypeError)],
)  # fmt: skip
def test_a_timeout_is_a_positive_time_in_seconds_or_a_timedelta(timeout: Any, error: type) -> None:
    """Refused when the hook is made (before the process group), not as an AttributeError or a peer
    that seems not to answer (a zero timeout) at the first bucket; a number is seconds."""
    with pytest.raises(error, match="timeout must be"):
        hooks.make("topk:ratio=0.1,ef=true", timeout=timeout)
    state, _ = hooks.make("topk:ratio=0.1,ef=true", timeout=30)
    assert state._timeout == datetime.timedelta(seconds=30)


# -- a loaded state must be finite -----------------------------------------------------------------


def _first_floating(state: Any, path: str = "") -> tuple[str, torch.Tensor] | None:
    """The first floating tensor of a saved state and its key, named as the refusal names it."""
    if isinstance(state, torch.Tensor):
        return (path, state) if state.is_floating_point() and state.numel() else None
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        found = _first_floating(value, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


def _poisoned(saved: dict[str, Any], where: str = "") -> tuple[dict[str, Any], str]:
    """A copy of ``saved`` as a checkpoint gives it back, with a NaN in its first floating tensor
    (under ``where``), and that tensor's key."""
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=True)
    found = _first_floating(copy[where] if where else copy, where)
    assert found is not None, f"no floating tensor to poison under {where!r} in {sorted(copy)}"
    path, tensor = found
    tensor.view(-1)[0] = float("nan")
    return copy, path


def poisoned_states(rank: int, world: int) -> Failures:
    """Every kind of state a hook or synchronizer loads, saved after a few steps with one NaN put
    in: the load is refused in one line naming the key, and the state refused stays usable (it trains
    on, finite). Before the refusal a NaN residual was loaded, kept by every step's non-finite
    guard, and every later step was non-finite on both ranks."""
    from gradcomp.sync import Synchronizer

    failures = Failures()
    batches = toy_batches(rank, 3)

    def refused(load: Any, saved: dict[str, Any], path: str, what: str) -> None:
        try:
            load(saved)
        except ValueError as error:
            text = str(error)
            failures.expect("non-finite" in text and path in text and "\n" not in text, f"{what}: {text}")
        else:
            failures.expect(False, f"{what}: a state holding a NaN at {path} was loaded")

    for spec in ["topk:ratio=0.1,ef=true", "topk:ratio=0.1,ef=true,momentum=0.9", "topk:ratio=0.1,ef=ef21",
                 "powersgd:rank=2,ef=true"]:  # fmt: skip
        ddp, state = wrap(toy_model(), spec)
        assert state is not None
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        sgd_steps(ddp, optimizer, batches[:2])
        saved, path = _poisoned(state.state_dict(), "compressor")
        refused(state.load_state_dict, saved, path, spec)
        fresh = hooks.make(spec)[0]  # loaded before its first bucket: refused at once too
        refused(fresh.load_state_dict, saved, path, f"{spec}, before its engine")
        sgd_steps(ddp, optimizer, batches[2:])
        failures.expect(all(bool(p.isfinite().all()) for p in ddp.parameters()), f"{spec}: not finite after")

    ddp, auto = wrap(toy_model(), "auto")
    sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches[:1])
    saved = auto.state_dict()  # type: ignore[union-attr]
    saved["pending"] = [[0, torch.zeros(4)]]  # a residual in hand-over between candidates
    saved, path = _poisoned(saved, "pending")
    refused(auto.load_state_dict, saved, path, "auto")  # type: ignore[union-attr]

    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = Synchronizer(model, "diloco:every=2", "topk:ratio=0.1,ef=true", optimizer=optimizer)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        sync.step()
    for where in ("compressor", "globals"):
        saved, path = _poisoned(sync.state_dict(), where)
        refused(sync.load_state_dict, saved, path, f"diloco's {where}")
    return failures


def test_a_loaded_state_holding_nan_or_inf_is_refused_naming_the_key() -> None:
    run_checks(2, poisoned_states, timeout=120)
