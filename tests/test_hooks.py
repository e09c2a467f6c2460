"""gradcomp hooks inside real DDP on gloo ranks, against DDP's default and torch's own hooks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradcomp import hooks
from gradcomp.launch import spawn


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
            for _ in range(steps)]  # fmt: skip


def train(rank: int, hook: Any, steps: int, bucket_cap_mb: float = 0.005) -> tuple[list[torch.Tensor], Any]:
    """Train a copy with DDP (small buckets: several per step) and return its parameters."""
    ddp = DistributedDataParallel(model(), bucket_cap_mb=bucket_cap_mb)
    state = None
    if hook == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook is not None:
        state = hooks.register(ddp, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches(rank, steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in ddp.parameters()], state


def gradients(rank: int, hook: Any) -> list[torch.Tensor]:
    """One step's averaged gradients."""
    ddp = DistributedDataParallel(model(), bucket_cap_mb=0.005)
    if hook == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        hooks.register(ddp, hook)
    x, y = batches(rank, 1)[0]
    nn.functional.cross_entropy(ddp(x), y).backward()
    return [p.grad.clone() for p in ddp.parameters()]


def compare_with_torch(rank: int, world: int) -> dict[str, Any]:
    default, _ = train(rank, None, 8)
    ours, _ = train(rank, "allreduce", 8)
    ring, _ = train(rank, "none", 8)
    fp16_torch, fp16_ours = gradients(rank, "torch-fp16"), gradients(rank, "fp16")
    return {
        "allreduce exact": all(torch.equal(a, b) for a, b in zip(default, ours, strict=True)),
        # in units of the result's fp16 spacing (2**-10 relative, 2**-24 absolute below 2**-14)
        "fp16 difference": max(
            float(((a - b).abs() / (a.abs() * 2.0**-10).clamp_min(2.0**-24)).max())
            for a, b in zip(fp16_torch, fp16_ours, strict=True)
        ),
        "fp16 identical elements": sum(int((a == b).sum()) for a, b in zip(fp16_torch, fp16_ours, strict=True))
        / sum(a.numel() for a in fp16_ours),
        "none close": all(torch.allclose(a, b, atol=1e-6) for a, b in zip(default, ring, strict=True)),
        "params": [p.sum().item() for p in ours],
    }


def test_allreduce_and_fp16_hooks_match_torch() -> None:
    """allreduce: bitwise DDP's default. fp16: torch's fp16_compress_hook, except that we divide by
    the world size before the cast (design rule 5) and torch after it, in fp16, which rounds a
    contribution in fp16's subnormal range (below 2**-14) once more; the sum can then round to the
    neighbouring fp16 value. So: at most one fp16 spacing apart, and equal almost everywhere."""
    results = spawn(2, compare_with_torch, timeout=300)
    for result in results:
        assert result["allreduce exact"], "allreduce hook differs from DDP's default"
        assert result["fp16 difference"] <= 1.0
        assert result["fp16 identical elements"] > 0.95
        assert result["none close"]
    assert results[0]["params"] == results[1]["params"]  # every rank holds the same model


def train_many_buckets(rank: int, world: int, spec: str) -> list[float]:
    params, _ = train(rank, spec, 200, bucket_cap_mb=0.002)
    return [p.double().sum().item() for p in params]


@pytest.mark.parametrize("spec", ["powersgd:rank=2,ef=true", "topk:ratio=0.1,ef=true", "quantize:bits=4"])
def test_multi_round_and_gather_compressors_run_200_steps_with_many_buckets(spec: str) -> None:
    """torch's powerSGD_hook aborts on gloo with more than one bucket; ours keeps every rank in step."""
    results = spawn(2, train_many_buckets, (spec,), timeout=600)
    assert results[0] == results[1]  # bitwise-identical parameters on every rank


def mismatched_specs(rank: int, world: int) -> str:
    try:
        train(rank, "topk:ratio=0.1" if rank == 0 else "topk:ratio=0.2", 1)
    except Exception as error:
        return str(error)
    return "trained"


def test_ranks_with_different_specs_fail_at_the_first_step_naming_both() -> None:
    for message in spawn(2, mismatched_specs, timeout=120):
        assert "different compressor specs" in message
        assert "topk:ratio=0.1" in message and "topk:ratio=0.2" in message


def test_a_bad_spec_fails_before_training() -> None:
    with pytest.raises(ValueError, match="unknown compressor 'topq'"):
        hooks.make("topq:ratio=0.1")


def resume(rank: int, world: int, spec: str) -> bool:
    """N steps, checkpoint (model, optimizer, hook state through torch.save / weights_only load),
    a fresh process state, M more steps == N + M steps uninterrupted, bitwise."""
    import io

    data = batches(rank, 10)

    def fresh() -> tuple[DistributedDataParallel, torch.optim.Optimizer, hooks.HookState]:
        ddp = DistributedDataParallel(model(), bucket_cap_mb=0.005)
        state = hooks.register(ddp, spec, seed=3)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), state

    def steps(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, chunk: list) -> None:
        for x, y in chunk:
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()

    ddp, optimizer, _ = fresh()
    steps(ddp, optimizer, data)
    uninterrupted = [p.detach().clone() for p in ddp.parameters()]

    ddp, optimizer, state = fresh()
    steps(ddp, optimizer, data[:6])
    buffer = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "optimizer": optimizer.state_dict(), "hook": state.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    ddp, optimizer, state = fresh()
    ddp.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["hook"])
    steps(ddp, optimizer, data[6:])
    return all(torch.equal(a, b) for a, b in zip(uninterrupted, ddp.parameters(), strict=True))


@pytest.mark.parametrize("spec", ["topk:ratio=0.1,ef=true", "powersgd:rank=2,ef=true", "quantize:bits=2"])
def test_checkpoint_and_resume_continue_exactly(spec: str) -> None:
    assert spawn(2, resume, (spec,), timeout=300) == [True, True]


class TwoHeads(nn.Module):
    """A model whose second head is unused: DDP needs find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.used, self.unused = nn.Linear(32, 64), nn.Linear(64, 10), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(torch.relu(self.body(x)))


def run_options(rank: int, world: int, options: dict[str, Any], hook: Any, dtype: str, accumulate: int) -> list:
    net = TwoHeads() if options.get("find_unused_parameters") else model()
    net = net.to(getattr(torch, dtype))
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.005, **options)
    if hook is not None:
        hooks.register(ddp, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches(rank, 6 * accumulate)):
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


def check_options(rank: int, world: int, index: int) -> list[str]:
    options, dtype, accumulate = OPTIONS[index]
    failures = []
    default = run_options(rank, world, options, None, dtype, accumulate)
    ours = run_options(rank, world, options, "allreduce", dtype, accumulate)
    if not all(torch.equal(a, b) for a, b in zip(default, ours, strict=True)):
        failures.append("allreduce hook differs from DDP's default")
    compressed = run_options(rank, world, options, "topk:ratio=0.2,ef=true", dtype, accumulate)
    flat = torch.cat([p.view(-1) for p in compressed])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    if not all(torch.equal(c, flat) for c in copies) or not torch.isfinite(flat).all():
        failures.append("top-k hook left ranks apart or non-finite")
    return failures


@pytest.mark.parametrize("index", range(len(OPTIONS)), ids=[f"{o}-{d}-x{a}" for o, d, a in OPTIONS])
def test_ddp_options_and_half_precision_parameters(index: int) -> None:
    """One group of ranks per configuration, each comparing DDP's default, the allreduce hook and a
    compressed hook; find_unused_parameters makes DDP communicate on its own group during backward."""
    assert spawn(2, check_options, (index,), timeout=300) == [[], []]


def measure(rank: int, world: int, spec: str, trace: str) -> dict[str, Any]:
    ddp = DistributedDataParallel(model(), bucket_cap_mb=0.005)
    state = hooks.register(ddp, spec, algo="ring")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches(rank, 3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    state.write_trace(f"{trace}.{rank}")
    return {"steps": state.steps(), "params": sum(p.numel() * 4 for p in ddp.parameters())}


@pytest.mark.parametrize(("spec", "ratio"), [("fp16", 2.0), ("powersgd:rank=1", None), ("sign", None)])
def test_statistics_and_trace(spec: str, ratio: float | None, tmp_path: Any) -> None:
    import json

    trace = str(tmp_path / "trace.json")
    results = spawn(2, measure, (spec, trace), timeout=300)
    for rank, result in enumerate(results):
        steps = result["steps"]
        assert [s["step"] for s in steps] == [0, 1, 2]
        for s in steps:
            assert s["input_bytes"] == result["params"]  # every gradient byte, once per step
            assert s["buckets"] >= (1 if s["step"] == 0 else 2)  # DDP rebuilds its buckets after step 0
            if ratio is not None:
                assert s["compression_ratio"] == pytest.approx(ratio)
            else:
                assert s["compression_ratio"] > 4
            assert s["sent_bytes"] > 0 and s["received_bytes"] > 0  # gradcomp's ring: observable
            assert s["compress_s"] > 0 and s["communicate_s"] > 0 and s["decompress_s"] > 0
        with open(f"{trace}.{rank}") as file:
            events = json.load(file)["traceEvents"]
        names = {e["name"] for e in events}
        assert {"queued", "compress", "communicate", "decompress"} <= names
        assert sum(e["name"].startswith("ready") for e in events) == sum(s["buckets"] for s in steps)


LOSSY_BOUNDS = {  # worst error of the averaged gradient, relative to each parameter's largest |g|
    "fp16": 2.0**-10,
    "bf16": 2.0**-7,
    "fp8:format=e4m3,chunk=64": 2.0**-3,
    "quantize:bits=8,rounding=nearest,chunk=64": 2.0 / 255,
    "quantize:bits=4,chunk=64": 2.0 * 2 / 15,
    "topk:ratio=1.0": 1e-6,
}


def lossy_errors(rank: int, world: int) -> dict[str, float]:
    exact = gradients(rank, "allreduce")
    errors = {}
    for spec in LOSSY_BOUNDS:
        approx = gradients(rank, spec)
        errors[spec] = max(
            float((a - e).abs().max() / e.abs().max()) for a, e in zip(approx, exact, strict=True) if e.abs().max() > 0
        )
    return errors


def test_every_lossy_hook_stays_within_its_documented_bound() -> None:
    for errors in spawn(2, lossy_errors, timeout=300):
        for spec, bound in LOSSY_BOUNDS.items():
            assert errors[spec] <= bound, f"{spec}: {errors[spec]} > {bound}"
        assert errors["fp16"] > 0  # and they do compress


def noop_training(rank: int, world: int) -> float:
    params, _ = train(rank, "noop", 3)
    return float(sum(p.double().sum() for p in params))


def test_noop_does_not_communicate() -> None:
    first, second = spawn(2, noop_training, timeout=120)
    assert first != second  # each rank trained on its own data only


def test_powersgd_runs_200_steps_at_4_ranks_with_many_buckets() -> None:
    results = spawn(4, train_many_buckets, ("powersgd:rank=1,ef=true",), timeout=600)
    assert all(r == results[0] for r in results)


def test_make_accepts_string_and_tuple_specs_and_aliases() -> None:
    # no process group is needed to refuse, and refusing happens before any group is touched
    with pytest.raises(ValueError, match="unknown option"):
        hooks.make(("allreduce", {"ratio": 0.1}))
    state, _ = hooks.make("noop")
    assert state.engine is None and state.steps() == [] and state.state_dict() == {}


def two_phase_against_exact(rank: int, world: int) -> dict[str, Any]:
    exact = gradients(rank, "allreduce")
    result: dict[str, Any] = {}
    for aggregation in ("gather", "two_phase"):
        ddp = DistributedDataParallel(model(), bucket_cap_mb=0.005)
        state = hooks.register(ddp, "quantize:bits=8,rounding=nearest,chunk=64", aggregation=aggregation, algo="ring")
        x, y = batches(rank, 1)[0]
        nn.functional.cross_entropy(ddp(x), y).backward()
        grads = [p.grad for p in ddp.parameters()]
        result[aggregation] = max(
            float((g - e).abs().max() / e.abs().max()) for g, e in zip(grads, exact, strict=True) if e.abs().max() > 0
        )
        result[f"{aggregation} sent"] = state.steps()[0]["sent_bytes"]
    ddp = DistributedDataParallel(model(), bucket_cap_mb=0.005)
    hooks.register(ddp, "topk:ratio=0.2,ef=true", aggregation="two_phase")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in batches(rank, 20):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    result["trained"] = [p.double().sum().item() for p in ddp.parameters()]
    return result


def test_two_phase_aggregation() -> None:
    """Two-phase: within two compression errors of the exact average, fewer bytes than all-gather
    at 4 ranks, and bitwise-identical models on every rank."""
    results = spawn(4, two_phase_against_exact, timeout=600)
    step = 2.0 / 255  # 8-bit nearest rounding over a chunk's range: at most half a step, twice
    for result in results:
        assert result["gather"] <= step
        assert result["two_phase"] <= 2 * step
        assert result["two_phase sent"] < result["gather sent"]
    assert all(r["trained"] == results[0]["trained"] for r in results)


def test_two_phase_is_refused_for_summable_compressors() -> None:
    with pytest.raises(ValueError, match="two_phase is for gather compressors"):
        hooks.make("fp16", aggregation="two_phase")


def every_compressor(rank: int, world: int) -> dict[str, list[float]]:
    from tests.helpers import SPECS

    results = {}
    specs = [*SPECS, *[f"{s}{',' if ':' in s else ':'}ef=true" for s in SPECS]]
    specs += ["fp16:algo=ring", "sign:aggregation=two_phase,seed=5", ("topk", {"ratio": 0.1, "algo": "tree"})]
    for spec in specs:
        params, _ = train(rank, spec, 3)
        results[str(spec)] = [p.double().sum().item() for p in params]
    return results


def test_every_compressor_with_and_without_error_feedback_trains_in_step() -> None:
    first, second = spawn(2, every_compressor, timeout=600)
    assert first.keys() == second.keys() and len(first) == 41
    for spec, sums in first.items():
        assert sums == second[spec], spec  # bitwise-identical models on both ranks
        assert all(abs(s) < 1e6 for s in sums), spec  # finite, not diverged


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
