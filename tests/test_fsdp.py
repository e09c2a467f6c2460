"""FSDP2 with gradcomp's reduce-scatter, on real gloo ranks, against FSDP2's own reduce-scatter.

One model with everything FSDP2 makes awkward: parameter sizes not divisible by the world (padded
shards), a frozen bias, a wholly frozen layer (its module reduce-scatters nothing), several FSDP
modules and a root holding a parameter of its own. Checked: ``none`` gives FSDP2's gradients
bitwise (its own op, at 2 and 4 ranks, also under a bf16 reduce dtype); the casts equal FSDP2 with
that reduce dtype within one rounding; lossless compression through the all-to-all gives the
average; lossy compression stays close; a quantized parameter all-gather gathers each rank's
nearest codes, the same on every rank, and the gradients follow; FSDP2's gradient divide factor (a pre-multiplied sum,
which gloo cannot do itself) is honoured; two hops average; results are deterministic; a hook's
state saved and loaded (weights only) continues bitwise; bad specs fail before any communication,
ranks given different specs at the first reduce-scatter, and a silent peer within the timeout.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradcomp import hooks
from gradcomp.compressors import make_compressor
from gradcomp.compressors.simulate import roundtrip
from gradcomp.engine.sharded import ShardedEngine, ShardSpec
from gradcomp.errors import SpecMismatchError
from gradcomp.hooks import fsdp2
from tests.distributed import Failures, identical_on_all_ranks, peer_stops, run_checks, spawn_ranks

pytestmark = pytest.mark.skipif(not fsdp2.available(), reason="this torch has no FSDP2 custom reduce-scatter")

STEPS = 3


class Net(nn.Module):
    """Uneven sizes (13 x 7 = 91 weights: padded at 2 and 4 ranks), a frozen bias, a frozen layer,
    and a parameter of the root's own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(13, 7), nn.Linear(7, 5), nn.Linear(5, 5), nn.Linear(5, 3)])
        self.layers[1].bias.requires_grad_(False)
        self.layers[2].requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x) * self.scale


def sharded(policy: Any = None, **options: Any) -> Net:
    """The net with the same initial weights on every rank, each layer and the root fully sharded
    (``options`` for ``fully_shard``)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    if policy is not None:
        options["mp_policy"] = policy
    for layer in net.layers:
        fully_shard(layer, **options)
    fully_shard(net, **options)
    return net


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 13, generator=torch.Generator().manual_seed(100 * step + rank))


def gradients(net: Net, rank: int, steps: int = STEPS, first: int = 0) -> list[torch.Tensor]:
    """Each trainable parameter's gradient shard after ``steps`` backwards (no optimizer: error
    feedback carries over while the weights stay, so every step is comparable)."""
    for step in range(first, first + steps):
        net.zero_grad()
        net(batch(rank, step)).square().sum().backward()
    return [p.grad.to_local().clone() for p in net.parameters() if p.requires_grad]


def run(spec: str | None, rank: int, policy: Any = None, factor: float | None = None, **options: Any) -> Any:
    from torch.distributed.fsdp import FSDPModule

    net = sharded(policy)
    if factor is not None:  # per FSDP module: each divides its own gradients
        for module in net.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(factor)
    state = hooks.fsdp(net, spec, **options) if spec is not None else None
    return gradients(net, rank), state


def close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float, atol: float = 0.0) -> bool:
    return all(((x - y).abs() <= atol + rtol * y.abs()).all() for x, y in zip(a, b, strict=True))


def local_shards(rank: int, world: int) -> list[torch.Tensor]:
    """This rank's shards of its own last gradient over the world size, unsharded net (FSDP2 cuts
    every parameter into row blocks as ``torch.chunk`` does; a rank past the last block has none)."""
    torch.manual_seed(0)
    net = Net()
    net(batch(rank, STEPS - 1)).square().sum().backward()
    shards = []
    for p in net.parameters():
        if p.requires_grad:
            blocks = torch.chunk(p.grad / world, world)
            shards.append(blocks[rank] if rank < len(blocks) else p.grad.new_empty((0, *p.shape[1:])))
    return shards


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """|a - b| / |b| over all the tensors (a rank's shard of one may be empty, or all zeros)."""
    x, y = torch.cat([t.reshape(-1) for t in a]), torch.cat([t.reshape(-1) for t in b])
    return float((x - y).norm() / y.norm())


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def against_fsdp(rank: int, world: int) -> Failures:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    failures = Failures()
    default, _ = run(None, rank)
    bf16 = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    fp16 = MixedPrecisionPolicy(reduce_dtype=torch.float16)

    mine, state = run("none", rank)
    failures.expect(equal(mine, default), "none: not FSDP2's gradients bitwise")
    steps = state.steps()
    failures.expect(len(steps) == STEPS and steps[-1].buckets == 4, f"none: recorded steps {steps}")
    mine, _ = run("none:algo=ring", rank)  # gradcomp's ring adds in its own order
    failures.expect(close(mine, default, rtol=1e-6, atol=1e-7), "none:algo=ring: not the average")
    mine, _ = run("none", rank, bf16)
    failures.expect(equal(mine, run(None, rank, bf16)[0]), "none under a bf16 reduce dtype: not FSDP2's bitwise")

    # the casts, against FSDP2 reducing in that dtype: one rounding apart
    mine, _ = run("bf16", rank)
    failures.expect(close(mine, run(None, rank, bf16)[0], rtol=2**-7), "bf16: not within one rounding of FSDP2's")
    mine, _ = run("fp16", rank)
    failures.expect(close(mine, run(None, rank, fp16)[0], rtol=2**-10, atol=2**-24), "fp16: not within one rounding")

    # through the all-to-all: lossless, then lossy; reduced in float32 from a bf16 input
    mine, _ = run("topk:ratio=1", rank)
    failures.expect(close(mine, default, rtol=1e-6, atol=1e-7), "topk:ratio=1: not the average")
    mine, _ = run("topk:ratio=1", rank, bf16)
    failures.expect(close(mine, default, rtol=2**-6, atol=1e-4), "topk:ratio=1 from bf16: not the average")
    mine, state = run("quantize:bits=8,ef=true", rank)
    error = relative_error(mine, default)
    failures.expect(error < 0.02, f"quantize:bits=8,ef=true: relative error {error:.4f}")
    step = state.steps()[-1]
    # 8-bit codes and a scale per chunk (most of it, for shards this small); every byte counted
    failures.expect(
        step.compression_ratio > 2 and step.sent_bytes == step.sent_estimate > step.payload_bytes,
        f"quantize:bits=8: step record {step}",
    )

    _divide_factors(failures, rank, world, default)

    # deterministic: two fresh runs of a stochastic compressor with the same seed agree bitwise
    first, _ = run("quantize:bits=4,ef=true", rank)
    again, _ = run("quantize:bits=4,ef=true", rank)
    failures.expect(equal(first, again), "quantize:bits=4,ef=true: two runs differ")

    if world % 2 == 0:
        _two_hops(failures, rank, default)

    # the quantized parameter all-gather (ZeRO++'s qwZ): gradients of nearly the same weights
    errors = {bits: relative_error(run(f"none:param_bits={bits}", rank)[0], default) for bits in (8, 2)}
    failures.expect(0 < errors[8] < 0.1 and errors[2] > errors[8], f"param_bits: gradients' relative errors {errors}")

    _the_policy(failures, rank, default)

    # noop: each rank's own shard, divided (the compute floor of benchmarks)
    mine, state = run("noop", rank)
    failures.expect(state.engine is None and close(mine, local_shards(rank, world), rtol=1e-6), "noop: not its own")
    return failures


def _two_hops(failures: Failures, rank: int, default: list[torch.Tensor]) -> None:
    """local_size=2: a reduce-scatter inside the node, then across nodes."""
    mine, _ = run("topk:ratio=1,local_size=2", rank)
    failures.expect(close(mine, default, rtol=1e-5, atol=1e-7), "two hops of topk:ratio=1: not the average")
    mine, _ = run("quantize:bits=8,ef=true,local_size=2", rank)
    error = relative_error(mine, default)
    failures.expect(error < 0.04, f"two hops of quantize:bits=8: relative error {error:.4f}")


def _divide_factors(failures: Failures, rank: int, world: int, default: list[torch.Tensor]) -> None:
    """set_gradient_divide_factor: a pre-multiplied sum (SUM for fp16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fp16 = MixedPrecisionPolicy(reduce_dtype=torch.float16)
    mine, _ = run("none", rank, factor=world * 4.0)
    quarter = [g / 4 for g in default]
    failures.expect(close(mine, quarter, rtol=1e-6), "none: divide factor not honoured")
    mine, _ = run("quantize:bits=8,rounding=nearest", rank, factor=world * 4.0)
    failures.expect(relative_error(mine, quarter) < 0.02, "quantize:bits=8: divide factor not honoured")
    mine, _ = run("none", rank, fp16, factor=float(world))
    failures.expect(equal(mine, run(None, rank, fp16)[0]), "none with fp16: not FSDP2's pre/post divide")


def _the_policy(failures: Failures, rank: int, default: list[torch.Tensor]) -> None:
    """The per-tensor policy: the picked parameters' columns travel uncompressed, the others compressed."""
    mine, state = run("sign:ef=true,vectors=dense", rank)
    vectors = [i for i, p in enumerate(p for p in Net().parameters() if p.requires_grad) if p.dim() == 1]
    failures.expect(close([mine[i] for i in vectors], [default[i] for i in vectors], rtol=1e-6, atol=1e-7),
                    "vectors=dense: the 1-D parameters are not the average")  # fmt: skip
    matrices = [i for i in range(len(mine)) if i not in vectors]
    failures.expect(not close([mine[i] for i in matrices], [default[i] for i in matrices], rtol=1e-3),
                    "vectors=dense: the matrices were not compressed")  # fmt: skip
    step = state.steps()[-1]
    failures.expect(0 < step.uncompressed_bytes < step.input_bytes, f"vectors=dense: step record {step}")
    mine, state = run("sign:ef=true,min_numel=1000", rank)  # every parameter: FSDP2's average
    failures.expect(close(mine, default, rtol=1e-6, atol=1e-7), "min_numel above every parameter: not the average")
    failures.expect(state.steps()[-1].uncompressed_bytes == state.steps()[-1].input_bytes, "min_numel: bytes")


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_reduce_scatter_against_fsdp2s_own(world: int) -> None:
    run_checks(world, against_fsdp, timeout=280)


def state_and_errors(rank: int, world: int, record_dir: str) -> Failures:
    failures = Failures()
    # the parameter all-gather: every rank's shard through the codec, the same bytes on every rank
    engine = ShardedEngine("none:param_bits=8")
    shard = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    gathered = torch.empty(world * 3000)
    engine.all_gather(gathered, shard.clone())
    expected = roundtrip(make_compressor("quantize:bits=8,rounding=nearest"), shard)
    failures.expect(torch.equal(gathered.view(world, -1)[rank], expected), "param_bits=8: not the nearest codes")
    failures.expect(identical_on_all_ranks(gathered), "param_bits=8: ranks gathered different weights")

    spec = "topk:ratio=0.2,ef=true"
    straight, _ = run(spec, rank)  # STEPS steps straight through

    net = sharded()
    state = hooks.fsdp(net, spec)
    gradients(net, rank, STEPS - 1)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_net = sharded()
    resumed = hooks.fsdp(resumed_net, spec)
    resumed.load_state_dict(saved)
    last = gradients(resumed_net, rank, 1, first=STEPS - 1)
    failures.expect(equal(last, straight), "the resumed hook's step differs from the straight run's")
    trace = Path(f"{record_dir}/trace-{rank}.json")
    resumed.write_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    failures.expect({"compress", "communicate", "decompress"} <= {e["name"] for e in events}, "trace: phases missing")
    try:
        hooks.fsdp(sharded(), "quantize:bits=4").load_state_dict(saved)
        failures.append("a state of another spec was loaded")
    except ValueError as error:
        failures.expect("topk" in str(error), f"unclear refusal: {error}")

    # the same entry point as DDP's hooks; ranks that disagree fail at the first reduce-scatter
    registered = hooks.register(sharded(), "sign:ef=true")
    failures.expect(isinstance(registered.engine, ShardedEngine), f"register made {registered.engine!r}")
    net = sharded()
    hooks.fsdp(net, "sign" if rank == 0 else "sign:ef=true")
    try:
        gradients(net, rank, 1)
        failures.append("ranks with different specs trained")
    except SpecMismatchError as error:
        failures.expect("rank 1" in str(error), f"unclear mismatch: {error}")
    except RuntimeError as error:  # autograd may wrap it
        failures.expect("different hook specs" in str(error), f"unclear mismatch: {error}")
    return failures


def test_fsdp_hook_state_resumes_bitwise_and_bad_setups_fail_clearly(tmp_path: Path) -> None:
    run_checks(2, state_and_errors, (str(tmp_path),), timeout=200)


GROUP_TIMEOUT = 5.0


def stopped_peer(rank: int, world: int, how: str, record: str) -> None:
    """Rank 1 stops after a forward, frozen or alive and silent; rank 0's backward (no all-gather in
    it: the parameters stay unsharded after forward) reaches gradcomp's reduce-scatter first, which
    must fail within the group's timeout naming rank 1, the hook state keeping the error."""
    net = sharded(reshard_after_forward=False)
    state = hooks.fsdp(net, "quantize:bits=4,ef=true,algo=ring")
    gradients(net, rank, 1)
    loss = net(batch(rank, 1)).square().sum()
    peer_stops(rank, how, record, loss.backward, lambda: state.error, at_most=4 * GROUP_TIMEOUT)


@pytest.mark.parametrize("how", ["alive", "frozen"])
def test_a_silent_or_frozen_peer_is_an_error_naming_it_within_the_timeout(how: str, tmp_path: Path) -> None:
    record = tmp_path / "rank0.txt"
    spawn_ranks(2, stopped_peer, (how, str(record)), timeout=120, group_timeout=GROUP_TIMEOUT)
    seen = eval(record.read_text())  # written by rank 0 with repr()
    assert seen["elapsed"] < 6 * GROUP_TIMEOUT, seen
    assert "rank 1" in seen["error"] and seen["kept"] == "PeerError", seen


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("powersgd:rank=2", "needs each tensor's shape"),
        ("quantize:bits=4,aggregation=two_phase", "leave it out"),
        ("quantize:bits=4,algo=tree", "native or ring"),
        ("quantize:bits=4,local_size=-1", "local_size"),
        ("quantize:bits=4,local_size=two", "local_size"),
        ("quantize:bits=4,param_bits=1", "param_bits"),
        ("noop:param_bits=8", "noop has none"),
        ("quantize:bits=4,ef=true,warmup=5", "no step clock of the engine's"),
        ("quantize:bits=4,ef=ef21", "a reduce-scatter leaves each rank its own shard only"),
        ("quantize:bits=4,pieces=2", "reduce-scatters a module's shard in one call"),
        ("nonsense", "unknown compressor"),
    ],
)
def test_bad_sharded_specs_are_refused_without_a_process_group(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardSpec.parse(spec)


def test_sharded_specs_have_a_canonical_text() -> None:
    texts = ("none", "allreduce", "quantize:bits=4,ef=true,local_size=8,param_bits=8", "noop", "sign:algo=ring,seed=3")
    for text in texts:
        spec = ShardSpec.parse(text)
        assert ShardSpec.parse(str(spec)) == spec
    assert str(ShardSpec.parse("allreduce")) == "none"
    assert str(ShardSpec.parse("quantize:bits=4,local_size=8")).endswith(",local_size=8")


def test_fsdp_divisors_follow_its_ops() -> None:
    from torch.distributed.distributed_c10d import ReduceOp

    assert fsdp2.divisor_of(dist.ReduceOp.AVG, 4) == 4
    assert fsdp2.divisor_of(dist.ReduceOp.SUM, 4) == 1
    assert fsdp2.divisor_of(ReduceOp.PREMUL_SUM(1 / 3), 4) == 3
    assert fsdp2.divisor_of(ReduceOp.PREMUL_SUM(0.4), 4) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="SUM, AVG"):
        fsdp2.divisor_of(dist.ReduceOp.MAX, 4)


def train_with_scaler(net: nn.Module, rank: int, scaler: torch.amp.GradScaler | None, steps: int) -> None:
    """``steps`` SGD steps on the mean square of the net's output for this rank's batches, the loss
    scaled by ``scaler`` when there is one."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        loss = net(batch(rank, step)).square().mean()
        if scaler is None:
            loss.backward()
            optimizer.step()
            continue
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def under_a_changing_scale(rank: int, world: int) -> Failures:
    """A GradScaler whose scale doubles every step, given to the hook (``scaler=``): 4-bit codes
    with error feedback train bitwise as without a scaler (residuals rescale exactly at a step's
    first reduce-scatter); a hook that does not follow the scale trains otherwise."""
    failures = Failures()

    def trained(scaled: bool, follow: bool) -> list[torch.Tensor]:
        net = sharded()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1) if scaled else None
        hooks.fsdp(net, "quantize:bits=4,ef=true", scaler=scaler if follow else None)
        train_with_scaler(net, rank, scaler, 6)
        assert scaler is None or scaler.get_scale() == 2.0**10, "the scale doubled at each of 6 steps"
        return [p.full_tensor().clone() for p in net.parameters()]

    plain = trained(scaled=False, follow=False)
    followed = trained(scaled=True, follow=True)
    failures.expect(all(torch.equal(a, b) for a, b in zip(followed, plain, strict=True)),
                    "under a changing scale it differs from the run without a scaler")  # fmt: skip
    lost = trained(scaled=True, follow=False)
    failures.expect(not all(torch.equal(a, b) for a, b in zip(lost, plain, strict=True)),
                    "not following the scale changes nothing: the test proves nothing")  # fmt: skip
    return failures


def test_error_feedback_follows_the_loss_scale_under_fsdp2() -> None:
    run_checks(2, under_a_changing_scale, timeout=120)


def nan_at_step_3(rank: int, world: int) -> Failures:
    """Under FSDP2 and a GradScaler the hook follows, an Inf in rank 0's batch at step 3 skips exactly
    that step; the residuals stay clean (every later step is taken), the model finite and the same
    on every rank."""
    failures = Failures()
    for spec in ("quantize:bits=4,ef=true", "topk:ratio=0.25,ef=true", "sign:ef=true,algo=ring"):
        net = sharded()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        hooks.fsdp(net, spec, scaler=scaler)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        skipped = []
        for step in range(8):
            x = batch(rank, step)
            if step == 3 and rank == 0:
                x[0, 0] = float("inf")
            optimizer.zero_grad()
            scaler.scale(net(x).square().mean()).backward()
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
        failures.expect(skipped == [i == 3 for i in range(8)], f"{spec}: skipped steps {skipped}")
        full = [p.full_tensor() for p in net.parameters()]
        failures.expect(all(bool(torch.isfinite(p).all()) for p in full), f"{spec}: non-finite model")
        failures.expect(identical_on_all_ranks(torch.cat([p.reshape(-1) for p in full])), f"{spec}: ranks differ")
    return failures


def test_one_non_finite_batch_skips_one_step_under_gradscaler() -> None:
    run_checks(2, nan_at_step_3, timeout=120)


def test_the_policys_columns_are_its_tensors_shards_and_an_unknown_layout_goes_compressed() -> None:
    from gradcomp.engine.columns import Columns, dense_columns
    from gradcomp.engine.spec import HookSpec

    spec = HookSpec.parse("sign:ef=true,vectors=dense,min_numel=50")
    tensors = [(torch.Size((13, 7)), 48), (torch.Size((7,)), 4), (torch.Size((3,)), 2), (torch.Size((5, 5)), 13)]
    assert dense_columns(spec, tensors, 67) == [(48, 67)]  # the vectors and the 25-element matrix, one span
    assert dense_columns(spec, tensors, 66) is None  # a parameter left out: which one is not known
    columns = Columns.of([(1, 3)], 5, torch.device("cpu"))
    rows = torch.arange(10.0).view(2, 5)
    plain, kept = columns.split(rows)
    assert plain.tolist() == [[1, 2], [6, 7]] and kept.tolist() == [[0, 3, 4], [5, 8, 9]]
    out = torch.empty(5)
    columns.join(out, plain[1], kept[1])
    assert torch.equal(out, rows[1])
