"""The auto hook: its spec, the per-bucket choice against hand-made costs, and real ranks that
decide alike, switch without losing error feedback's residuals, and resume exactly."""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gradcomp import hooks
from gradcomp.collectives.cost_model import LinkCosts, all_reduce_seconds
from gradcomp.collectives.ring import chunk_bounds
from gradcomp.compressors.keys import StateKey
from gradcomp.cost import online
from gradcomp.cost.choose import choose
from gradcomp.cost.cluster import Cluster
from gradcomp.cost.kernels import FREE, KernelCost
from gradcomp.cost.step import Workload, method_of
from gradcomp.engine.spec import HookSpec
from gradcomp.errors import GradcompError, PeerError, SpecMismatchError
from gradcomp.hooks.auto import DEFAULT_CANDIDATES, AutoSpec, AutoState, is_auto_spec
from tests.distributed import (
    Failures,
    parameters_identical_on_all_ranks,
    run_checks,
    spawn_ranks,
    stay_until_written,
)
from tests.toy_ddp import sgd_steps, toy_batches, toy_model, wrap

# -- the spec ------------------------------------------------------------------------------------


def test_specs_parse_with_the_candidates_own_options() -> None:
    assert AutoSpec.parse("auto") == AutoSpec() and str(AutoSpec()) == "auto"
    spec = AutoSpec.parse("auto:candidates=fp16|powersgd:rank=4,ef=true|topk:ratio=0.01,ef=true,recheck=200")
    assert spec.candidates == tuple(str(HookSpec.parse(c)) for c in ("fp16", "powersgd:rank=4,ef=true",
                                                                     "topk:ratio=0.01,ef=true"))  # fmt: skip
    assert spec.recheck == 200
    assert AutoSpec.parse(str(spec)) == spec
    assert str(spec.hook_specs[0]) == "allreduce"  # always there, first
    assert len(AutoSpec().hook_specs) == 1 + len(DEFAULT_CANDIDATES)
    assert is_auto_spec("auto:margin=0.1") and not is_auto_spec("automatic") and not is_auto_spec("torch:fp16")
    assert isinstance(hooks.parse("auto", seed=3), AutoSpec) and hooks.parse("auto", seed=3).seed == 3  # type: ignore[union-attr]
    assert hooks.parse("auto:seed=1", seed=3).seed == 1  # type: ignore[union-attr]
    # the default applies where auto's own options do not set a seed: a candidate's seed is its own
    candidates = AutoSpec.parse("auto:candidates=fp16:seed=7|sign:ef=true", seed=3)
    assert candidates.seed == 3 and candidates.candidates[0] == "fp16:seed=7"
    assert hooks.parse("auto:candidates=fp16:seed=7|sign:ef=true", seed=3) == candidates
    with pytest.raises(TypeError, match="unknown auto option"):
        AutoSpec.parse("auto", ratio=0.1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("auto:ratio=0.1", "unknown auto option 'ratio=0.1'"),
        ("auto:candidates=noop", "cannot be an auto candidate"),
        ("auto:candidates=quantize:bits=4,local_size=2|sign:ef=true,local_size=4", "one node size"),
        ("auto:candidates=zip", "unknown compressor 'zip'"),
        ("auto:measure_at=1", "measure_at must be >= 2"),
        ("auto:margin=1", "margin < 1"),
        ("auto:recheck=-1", ">= 0"),
    ],
)
def test_bad_specs_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoSpec.parse(text)


def test_candidates_across_nodes_share_one_node_size() -> None:
    spec = AutoSpec.parse("auto:candidates=quantize:bits=4|quantize:bits=4,local_size=2")
    assert spec.local_size == 2 and AutoSpec().local_size == 0


def test_make_refuses_auto_with_the_way_to_attach_it() -> None:
    with pytest.raises(ValueError, match=r"hooks.register\(model, 'auto'\)"):
        hooks.make("auto")


# -- the choice ----------------------------------------------------------------------------------

CANDIDATES = [method_of(s) for s in ("allreduce", "fp16", "topk:ratio=0.01,ef=true")]
TWO_BUCKETS = Workload(((1024, 1024), (1024, 1024)), (0.5, 1.0), 0.01, 0.1, 0.0, groups=((0,), (1,)))


def kernels(spec: str) -> KernelCost:
    """2 ms per million elements for top-k, 0.5 ms for the cast, nothing for the gradient itself."""
    per = {"none": 0.0, "fp16": 0.5e-9}.get(spec, 2e-9)
    return FREE if not per else KernelCost((1,), (per,), (0.0,), (per / 4,), (per / 4,))


def test_a_free_link_stays_uncompressed_and_a_dear_one_compresses() -> None:
    free = choose(TWO_BUCKETS, CANDIDATES, Cluster(2, LinkCosts(0, 0)), kernels)
    assert free.per_bucket == (0, 0) and "nothing is predicted" in free.reason
    dear = choose(TWO_BUCKETS, CANDIDATES, Cluster(2, LinkCosts(1e-4, 1e-7)), kernels)  # 10 MB/s
    assert dear.per_bucket == (2, 2) and dear.predicted_s < dear.uniform_s[0] / 5
    assert "bucket 1: topk" in dear.reason


def test_a_bucket_that_backward_hides_can_stay_cheap() -> None:
    # 100 MB/s: the first bucket's 4 MB go while backward's second half runs (50 ms); the last is exposed
    hidden = Workload(((1024, 1024), (1024, 1024)), (0.5, 1.0), 0.01, 0.1, 0.0, groups=((0,), (1,)))
    choice = choose(hidden, CANDIDATES, Cluster(2, LinkCosts(1e-5, 1e-8)), kernels)
    assert choice.per_bucket[0] != choice.per_bucket[1]
    assert choice.predicted_s < min(choice.uniform_s)


def test_a_gain_under_the_margin_is_not_taken() -> None:
    link = Cluster(2, LinkCosts(0, 3e-11))  # a little to gain by compressing
    strict = choose(TWO_BUCKETS, CANDIDATES, link, kernels, margin=0.5)
    assert strict.per_bucket == (0, 0)


def test_a_candidate_that_leaves_tensors_dense_is_priced_as_the_all_reduce_it_sends() -> None:
    vectors = Workload(((2**18,), (2**18,)), (0.5, 1.0), 0.01, 0.1, 0.0, groups=((0, 1),))  # one bucket of 1-D tensors
    dear = Cluster(2, LinkCosts(1e-4, 1e-7))
    policy = [method_of(s) for s in ("allreduce", "sign:ef=true,vectors=dense")]
    assert choose(vectors, policy, dear, kernels).per_bucket == (0,)  # it would send the same bytes, dearer
    signs = [method_of(s) for s in ("allreduce", "sign:ef=true")]
    assert choose(vectors, signs, dear, kernels).per_bucket == (1,)


# -- real ranks ----------------------------------------------------------------------------------

FREE_LINK, DEAR_LINK = LinkCosts(0.0, 0.0), LinkCosts(1e-3, 1e-6)  # free, and 1 MB/s with 1 ms latency
SPEC = "auto:candidates=fp16|topk:ratio=0.1,ef=true,measure_at=2,check_every=3"


def _auto_ranks(rank: int, world: int) -> dict[str, Any]:
    failures = Failures()
    torch.set_num_threads(1)
    batches = toy_batches(rank, 8)
    # a free link: it measures at step 2 and stays uncompressed (whatever the noise of timing this toy
    # model's microsecond kernels: a margin of 50% for this one)
    ddp, state = wrap(toy_model(), SPEC + ",margin=0.5", link=FREE_LINK)
    assert isinstance(state, AutoState)
    sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches[:4])
    failures.expect(len(state.decisions) == 1 and state.decisions[0]["step"] == 2, f"decisions {state.decisions}")
    failures.expect(set(state.decisions[0]["buckets"]) == {"allreduce"}, f"free link: {state.decisions[0]}")
    # a dear link: it compresses, every rank the same way, and the replicas stay identical
    ddp, state = wrap(toy_model(), SPEC, link=DEAR_LINK)
    assert isinstance(state, AutoState)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sgd_steps(ddp, optimizer, batches[:4])
    chosen = state.decisions[0]["buckets"]
    failures.expect(any(b != "allreduce" for b in chosen), f"dear link: {state.decisions[0]}")
    failures.expect(parameters_identical_on_all_ranks(list(ddp.parameters())), "replicas differ")
    steps = state.steps()
    failures.expect([s.step for s in steps] == [0, 1, 2, 3], f"steps {[s.step for s in steps]}")
    failures.expect(steps[-1].payload_bytes < steps[0].payload_bytes, "compression did not shrink the payload")
    # a checkpoint after the decision: a fresh model and hook continue bitwise
    buffer = io.BytesIO()
    torch.save({"hook": state.state_dict(), "model": ddp.module.state_dict(), "opt": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    sgd_steps(ddp, optimizer, batches[4:6])
    again, restored = wrap(toy_model(), SPEC, link=DEAR_LINK)
    assert isinstance(restored, AutoState)
    again.module.load_state_dict(saved["model"])
    resumed = torch.optim.SGD(again.parameters(), lr=0.1)
    resumed.load_state_dict(saved["opt"])
    restored.load_state_dict(saved["hook"])
    sgd_steps(again, resumed, batches[4:6])
    same = all(torch.equal(a, b) for a, b in zip(ddp.parameters(), again.parameters(), strict=True))
    failures.expect(same, "a resumed auto hook does not continue bitwise")
    failures.expect(restored.decisions == state.decisions[:1], "decisions were not restored")
    # switching away from error feedback flushes the residual into the next gradient
    topk = next(i for i, c in enumerate(state.candidates) if c.compressor and c.compressor.name == "topk")
    identity = [key for key, c in state.choice.items() if c == topk]
    residuals = state.engines[topk].compressor.residuals  # type: ignore[attr-defined]
    before = {key: residuals[key].clone() for key in identity}
    state._install({**state.choice, **dict.fromkeys(identity, 0)})
    failures.expect(all(key not in residuals for key in identity), "residuals stayed with the old compressor")
    failures.expect(all(torch.equal(state.pending[k], before[k]) for k in identity), "residuals not pending")
    sizes = [before[k].numel() for k in identity]
    flat = torch.zeros(sum(sizes))
    state._flush(flat, list(identity), [before[k].shape for k in identity])
    expected = torch.cat([before[k].reshape(-1) * world for k in identity])
    failures.expect(torch.equal(flat, expected) and not state.pending, "the flush is not the residual times p")
    decisions = [d["buckets"] for d in state.decisions]
    _a_candidate_warms_up_on_the_hooks_clock(failures, batches)
    _leaving_two_phase(failures, batches, rank, world)
    _leaving_ef21(failures, batches)
    return {"failures": failures, "decisions": decisions}


def _a_candidate_warms_up_on_the_hooks_clock(failures: Failures, batches: list[Any]) -> None:
    """A candidate with a warm-up counts the hook's steps, as a plain hook counts its own: chosen at
    step 2 with ``warmup=3``, top-k sends 1% from step 3 on (before, its engine's clock never moved:
    the warm-up's first ratio, 0.01 ** (1 / 4) ~ 32%, at every step)."""
    ddp, state = wrap(toy_model(), "auto:candidates=topk:ratio=0.01,ef=true,warmup=3,measure_at=2", link=DEAR_LINK)
    assert isinstance(state, AutoState)
    sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches[:6])
    failures.expect(any(c == 1 for c in state.choice.values()), f"dear link, warm-up: {state.decisions}")
    failures.expect([e.steps_done for e in state.engines] == [6, 6], "the candidates' clocks are not the hook's")
    plain, plain_state = wrap(toy_model(), "topk:ratio=0.01,ef=true")
    assert plain_state is not None
    x, y = batches[0]
    torch.nn.functional.cross_entropy(plain(x), y).backward()
    expected = {s.input_bytes / s.payload_bytes for s in plain_state.steps()}
    compressed = [s.input_bytes / s.payload_bytes for s in state.steps() if s.step >= 3]
    failures.expect(len(compressed) == 3 and set(compressed) == expected,
                    f"ratios from step 3 {compressed}, plain top-k's {expected}")  # fmt: skip


def _leaving_two_phase(failures: Failures, batches: list[Any], rank: int, world: int) -> None:
    """Switching away from a two-phase candidate hands over every part of a tensor's residual: the
    shard this rank compressed for each rank, in place, plus the reduced shard it compressed again,
    added at its own shard's place (before, only the plain key was looked up: nothing was handed over)."""
    spec = "auto:candidates=topk:ratio=0.1,ef=true,aggregation=two_phase,measure_at=2"
    ddp, state = wrap(toy_model(), spec, link=DEAR_LINK)
    assert isinstance(state, AutoState)
    sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches[:4])
    chosen = [key for key, c in state.choice.items() if c == 1]
    failures.expect(bool(chosen), f"dear link, two-phase: {state.decisions}")
    residuals = state.engines[1].compressor.residuals  # type: ignore[attr-defined]
    shapes = {k: s for identity, held in state._shapes.items() for k, s in zip(identity, held, strict=True)}
    expected = {}
    for key in chosen:
        flat = torch.zeros(shapes[key]).view(-1)
        bounds = chunk_bounds(flat.numel(), world)
        for j, (start, stop) in enumerate(bounds):
            flat[start:stop] += residuals[(key, j)].reshape(-1)
        start, stop = bounds[rank]
        flat[start:stop] += residuals[(key, "reduced", rank)].reshape(-1)
        expected[key] = flat.view(shapes[key])
    state._install(dict.fromkeys(state.choice, 0))
    handed = all(key in state.pending and torch.equal(state.pending[key], expected[key]) for key in chosen)
    failures.expect(handed, f"two-phase residuals not handed over in place: pending {sorted(state.pending)}")
    left = [k for k in state.engines[1].compressor.state_keys() if StateKey.parse(k).parameter in chosen]
    failures.expect(not left, f"two-phase residuals stayed with the old candidate: {left}")


def _leaving_ef21(failures: Failures, batches: list[Any]) -> None:
    """Switching away from an EF21 candidate: its estimates h and G are dropped, not flushed (h is
    no unsent gradient: added to the next one, it would send this rank's share about twice)."""
    ddp, state = wrap(toy_model(), "auto:candidates=topk:ratio=0.1,ef=ef21,measure_at=2", link=DEAR_LINK)
    assert isinstance(state, AutoState)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sgd_steps(ddp, optimizer, batches[:4])
    identity = [key for key, c in state.choice.items() if c == 1]
    failures.expect(bool(identity), f"dear link, EF21: {state.decisions}")
    ef21 = state.engines[1].compressor
    held = all(key in ef21.shares and key in ef21.estimates for key in identity)  # type: ignore[attr-defined]
    failures.expect(held, "EF21 holds no estimates for its tensors")
    state._install(dict.fromkeys(state.choice, 0))
    failures.expect(not state.pending, f"EF21's estimates were taken for unsent gradient: {sorted(state.pending)}")
    dropped = not any(k in ef21.shares or k in ef21.estimates for k in identity)  # type: ignore[attr-defined]
    failures.expect(dropped, "EF21's estimates stayed with it")
    sgd_steps(ddp, optimizer, batches[4:5])
    failures.expect(parameters_identical_on_all_ranks(list(ddp.parameters())), "replicas differ after leaving EF21")


def test_real_ranks_decide_alike_and_switch_and_resume_exactly() -> None:
    results = run_checks(2, _auto_ranks, timeout=180)
    assert results[0]["decisions"] == results[1]["decisions"]


NODES_SPEC = "auto:candidates=topk:ratio=0.1,ef=true|topk:ratio=0.1,ef=true,local_size=2,measure_at=2"


def _across_nodes_ranks(rank: int, world: int) -> dict[str, Any]:
    """4 ranks as 2 nodes of 2: switching a tensor between flat top-k and top-k across nodes hands
    over its residual, across nodes only the piece of rows this rank compressed (zeros elsewhere),
    and the replicas stay identical; measured for real, the nodes are probed and it decides alike."""
    failures = Failures()
    torch.set_num_threads(1)
    batches = toy_batches(rank, 12)
    ddp, state = wrap(toy_model(), NODES_SPEC, link=DEAR_LINK)
    assert isinstance(state, AutoState)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sgd_steps(ddp, optimizer, batches[:3])  # decided at step 2
    keys = [key for identity in state._shapes for key in identity]
    state._install(dict.fromkeys(keys, 2))  # every tensor across nodes
    sgd_steps(ddp, optimizer, batches[3:5])
    across = state.engines[2].compressor.residuals  # type: ignore[attr-defined]
    j = rank % 2
    pieces = {key: across[(key, "node", j)].clone() for key in keys}
    shapes = {key: shape for identity, held in state._shapes.items() for key, shape in zip(identity, held, strict=True)}
    state._install(dict.fromkeys(keys, 1))  # every tensor flat
    for key in keys:
        expected = torch.zeros(shapes[key])
        torch.tensor_split(expected, 2)[j].copy_(pieces[key].view_as(torch.tensor_split(expected, 2)[j]))
        failures.expect(torch.equal(state.pending[key], expected), f"tensor {key}: not its piece's residual in place")
        failures.expect((key, "node", j) not in across, f"tensor {key}: the residual stayed across nodes")
    sgd_steps(ddp, optimizer, batches[5:7])  # flushed into the flat hook's gradients
    failures.expect(not state.pending, "residuals still pending")
    state._install(dict.fromkeys(keys, 2))  # and back: the flat residuals flushed into the node's sum
    sgd_steps(ddp, optimizer, batches[7:9])
    failures.expect(parameters_identical_on_all_ranks(list(ddp.parameters())), "replicas differ")
    measured, probed = wrap(toy_model(), NODES_SPEC)
    assert isinstance(probed, AutoState)
    # measured at step 2 (on loopback a probe may not fit: it measures again, up to three times)
    sgd_steps(measured, torch.optim.SGD(measured.parameters(), lr=0.1), batches)
    failures.expect(len(probed.decisions) == 1, f"decisions {probed.decisions}")
    failures.expect(parameters_identical_on_all_ranks(list(measured.parameters())), "measured: replicas differ")
    return {"failures": failures, "decisions": [d["buckets"] for d in probed.decisions]}


def test_auto_chooses_across_nodes_and_switches_without_losing_residuals() -> None:
    results = run_checks(4, _across_nodes_ranks, timeout=200)
    assert all(r["decisions"] == results[0]["decisions"] for r in results)


def test_probing_the_nodes_finds_a_shared_uplink() -> None:
    """One rank crossing sees the uplink; two ranks of a node crossing at once each see half of it."""
    link = LinkCosts(1e-4, 1e-8)

    def timed(p: int, costs: LinkCosts) -> dict[str, list[list[float]]]:
        sizes = (4096, 1 << 20, 16 << 20)
        return {
            "all_reduce": [[n, all_reduce_seconds("ring", n, p, costs)] for n in sizes],
            "all_gather": [[n, (p - 1) * (costs.alpha + n * costs.beta)] for n in sizes],
        }

    inside = timed(2, LinkCosts(1e-6, 1e-10))
    shared = online.fit(timed(4, link), 4, online.Nodes(2, inside, timed(2, LinkCosts(1e-4, 2e-8))))
    own = online.fit(timed(4, link), 4, online.Nodes(2, inside, timed(2, link)))
    assert shared.shared_uplink and not own.shared_uplink
    assert shared.local_size == own.local_size == 2 and own.inside.beta == pytest.approx(1e-10)


def _measured_ranks(rank: int, world: int) -> dict[str, Any]:
    failures = Failures()
    torch.set_num_threads(1)
    ddp, state = wrap(toy_model(), "auto:measure_at=2,check_every=2,stray=0.0001")
    assert isinstance(state, AutoState)
    sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), toy_batches(rank, 14))  # room for retries
    decisions = state.decisions
    failures.expect(len(decisions) >= 2, f"a prediction off by more than stray must make it measure again: {decisions}")
    failures.expect(all(d["predicted_ms"] > 0 for d in decisions), f"predictions {decisions}")
    failures.expect(parameters_identical_on_all_ranks(list(ddp.parameters())), "replicas differ")
    return {"failures": failures, "decisions": [d["buckets"] for d in decisions]}


def test_measuring_for_real_and_measuring_again_when_the_prediction_strays() -> None:
    results = run_checks(2, _measured_ranks, timeout=180)
    assert results[0]["decisions"] == results[1]["decisions"]


def test_a_training_run_with_auto_resumes_and_writes_its_decisions(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gradcomp.experiments.training.config import TrainConfig
    from gradcomp.experiments.training.run import launch

    spec = "auto:candidates=fp16|topk:ratio=0.05,ef=true,measure_at=3"
    settings: dict[str, Any] = {"task": "digits", "steps": 12, "batch_size": 32, "hook": spec, "ranks": 2, "seed": 1,
                                "eval_every": 6, "log_every": 4, "timeout": 150, "group_timeout": 60}  # fmt: skip
    out = tmp_path / "auto"
    stopped = launch(TrainConfig(**settings, out=str(out), stop_at=8))
    assert stopped["status"] == "stopped"
    resumed = launch(TrainConfig(**settings, out=str(out), resume="auto"))
    assert resumed["status"] == "finished" and resumed["resumed_from"] == 8
    events = EventAccumulator(str(out), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert "hook/predicted_step_ms" in events.Tags()["scalars"]
    texts = [t for t in events.Tags()["tensors"] if t.startswith("hook/decision")]
    decision = events.Tensors(texts[0])[0].tensor_proto.string_val[0].decode()
    assert int(decision.split(":")[0].removeprefix("step ")) >= 3  # from step 3 (later if the link would not fit)
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["hooks"][0]["decisions"][0]["step"] >= 3


# -- outside the happy path (issue 48, item 4) ----------------------------------------------------


class WithEmpty(torch.nn.Module):
    """The toy model and a parameter of no elements (with its gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = toy_model()
        self.empty = torch.nn.Parameter(torch.zeros(0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.empty.sum()


def _fails(ddp: Any, batches: list[Any]) -> str:
    """The error training raises (type: message), or "" if it trains."""
    try:
        sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches)
    except Exception as error:  # gradcomp's own, DDP's wrapping of it, or the hook's ValueError as it is
        return f"{type(error).__name__}: {error}"
    return ""


def _off_the_happy_path(rank: int, world: int) -> dict[str, Any]:
    failures = Failures()
    torch.set_num_threads(1)
    batches = toy_batches(rank, 4)
    spec = "auto:candidates=fp16|topk:ratio=0.1,ef=true,measure_at=2"
    # a 0-element parameter: decided alike (before: rank 0 raised, rank 1 waited out the timeout)
    ddp, state = wrap(WithEmpty(), spec, link=DEAR_LINK)
    assert isinstance(state, AutoState)
    failures.expect(_fails(ddp, batches) == "", f"an empty parameter: {state.error!r}")
    failures.expect(len(state.decisions) == 1 and state.error is None, f"decisions {state.decisions}")
    failures.expect(parameters_identical_on_all_ranks(list(ddp.parameters())), "replicas differ")
    decisions = [d["buckets"] for d in state.decisions]
    # rank 0 failing to decide: every rank stops with an error, kept in its state, none waits
    ddp, failing = wrap(toy_model(), spec, link=DEAR_LINK)
    assert isinstance(failing, AutoState)
    if rank == 0:

        def defect(*_: Any) -> list[float]:
            raise ValueError("a defect of the decision")

        failing._decide = defect  # type: ignore[method-assign]
    began = time.monotonic()
    said = _fails(ddp, batches)
    failures.expect(time.monotonic() - began < 20, "a rank waited for rank 0's decision")
    kept = ValueError if rank == 0 else GradcompError
    failures.expect(isinstance(failing.error, kept), f"rank 0 failed to decide: kept {failing.error!r}, said {said}")
    failures.expect(rank == 0 or "rank 0 failed to decide at step 2" in said, f"said {said}")
    # auto's own options differing between ranks: a SpecMismatchError at the first bucket, on every rank
    for option, mine in [("measure_at", f"measure_at={2 + rank}"), ("recheck", f"recheck={100 * (rank + 1)}")]:
        ddp, differing = wrap(toy_model(), f"auto:candidates=fp16,{mine}", link=DEAR_LINK)
        said = _fails(ddp, batches[:1])
        failures.expect(isinstance(differing.error, SpecMismatchError) and "rank 1:" in said, f"{option}: {said}")
    ddp, differing = wrap(toy_model(), "auto:candidates=fp16", **({"link": DEAR_LINK} if rank == 0 else {}))
    said = _fails(ddp, batches[:1])
    failures.expect(isinstance(differing.error, SpecMismatchError) and "link: measured" in said, f"link: {said}")
    # a tampered state: a choice out of range (negative too) or an unknown key is refused, naming it
    saved = state.state_dict()
    for tampered, message in [
        ({**saved, "choice": [[saved["choice"][0][0], 3]]}, "indices 0 to 2"),
        ({**saved, "choice": [[saved["choice"][0][0], -1]]}, "indices 0 to 2"),
        ({**saved, "extra": 1}, "unknown keys ['extra']"),
    ]:
        try:
            state.load_state_dict(tampered)
            failures.append(f"a tampered state was accepted ({message})")
        except ValueError as error:
            failures.expect(message in str(error), f"tampered: {error}")
    return {"failures": failures, "decisions": decisions}


def test_auto_off_its_happy_path_decides_or_fails_alike_on_every_rank() -> None:
    """Issue 48, item 4: an empty parameter, rank 0 failing to decide, options that differ between
    ranks, a tampered state: an answer or the same error on every rank, kept in the hook's state."""
    results = run_checks(2, _off_the_happy_path, timeout=120)
    assert results[0]["decisions"] == results[1]["decisions"]


PEER_TIMEOUT = 3.0


def _peer_stops_while_measuring(rank: int, world: int, how: str, record: str) -> None:
    """Rank 1 freezes (SIGSTOP) or fails and stays alive (as a peer stuck in user code) in the middle
    of ``auto``'s measuring step (its link's probes); rank 0 records the error it raised and the error
    its state kept. (A peer killed there is the same error on rank 0, sooner: gloo's closed
    connection instead of its timeout; not tested here, as the launcher may stop rank 0 as soon as
    rank 1 is dead, before it writes what it saw.)"""
    ddp, state = wrap(toy_model(), "auto:candidates=fp16,measure_at=2")
    assert isinstance(state, AutoState)
    pid = os.getpid()
    if rank == 1:

        def stop(*_: Any) -> Any:
            if how == "frozen":
                os.kill(pid, signal.SIGSTOP)  # rank 0 wakes it once it has its error
            else:
                stay_until_written(record, at_most=5 * PEER_TIMEOUT)
            raise RuntimeError("rank 1 stopped")

        online.probe_link = stop  # type: ignore[assignment]
    pids: list[int | None] = [None, None]
    torch.distributed.all_gather_object(pids, pid)
    began = time.monotonic()
    try:
        sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), toy_batches(rank, 4))
        error = "no error"
    except RuntimeError as caught:
        error = f"{type(caught).__name__}: {caught}"
    if rank == 1:
        return
    elapsed = time.monotonic() - began
    Path(record).write_text(repr({"elapsed": elapsed, "error": error, "kept": type(state.error).__name__}))
    if how == "frozen":
        os.kill(pids[1], signal.SIGCONT)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["frozen", "alive"])
def test_a_peer_lost_while_auto_measures_is_a_peer_error(how: str, tmp_path: Path) -> None:
    """Issue 48, item 4: the probes' gloo failure becomes a PeerError within the group's timeout."""
    record = tmp_path / "rank0.txt"
    spawn_ranks(2, _peer_stops_while_measuring, (how, str(record)), timeout=60, group_timeout=PEER_TIMEOUT,
                fresh=True)  # fmt: skip
    seen = eval(record.read_text())  # written by rank 0 with repr()
    assert seen["elapsed"] < 5 * PEER_TIMEOUT, seen
    assert "PeerError" in seen["error"] and "probes" in seen["error"], seen
    assert seen["kept"] == PeerError.__name__, seen
