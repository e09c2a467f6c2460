"""``auto`` on torchft's replica groups (``gradcomp.hooks.fault_tolerant_auto``).

The decision is forced to a compressor for every bucket (on a loopback link ``auto`` keeps the
uncompressed all-reduce, rightly): then a group that averaged with another candidate than the others
would send payloads of another kind, and the groups would not end alike. Healthy, two groups train
bitwise as ``auto`` on plain DDP with the same decision; a group killed after the decision and
restarted takes the decision from the others before its first bucket and ends where they do."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.distributed import Failures, parameters_identical_on_all_ranks, run_checks
from tests.test_torchft import replica_group, three_groups_one_lost, trained_on_plain_ddp
from tests.torchft_groups import replica

pytest.importorskip("torchft")

SPEC = "auto:candidates=topk:ratio=0.25,ef=true,measure_at=2,check_every=0"


@contextlib.contextmanager
def compressor_forced() -> Iterator[None]:
    """``auto``'s decision (rank 0's: the others receive it) made the compressor, candidate 1, for
    every bucket, whatever the link measured; as it was after the block (a test's ranks serve the
    file's other tests)."""
    from gradcomp.hooks.auto import AutoState

    def forced(self: AutoState, *_: Any, **__: Any) -> list[float]:
        return [0.01, *[0.01] * len(self.methods), *[1.0] * len(self.order)]

    decide = AutoState._decide
    AutoState._decide = forced  # type: ignore[method-assign]
    try:
        yield
    finally:
        AutoState._decide = decide  # type: ignore[method-assign]


def healthy(rank: int, world: int) -> list[str]:
    """8 steps through torchft with ``auto``, and with ``auto`` on plain DDP: the same decision at
    the same step, the same parameters bitwise, every rank alike."""
    import torch.nn.functional as F
    import torchft.optim

    from gradcomp.hooks.fault_tolerant import DistributedDataParallel
    from tests.toy_ddp import BUCKET_CAP_MB, toy_batches, toy_model

    failures = Failures()
    batches = toy_batches(rank, 8)
    with compressor_forced(), replica(rank, world) as manager:
        model = DistributedDataParallel(manager, toy_model(), SPEC, bucket_cap_mb=BUCKET_CAP_MB)
        optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    state = model.gradcomp_state
    with compressor_forced():
        reference, theirs = trained_on_plain_ddp(SPEC, batches, with_state=True)
    failures.expect(bool(state.decisions) and set(state.choice.values()) == {1}, f"no decision: {state.decisions}")
    steps = ([d["step"] for d in state.decisions], [d["step"] for d in theirs.decisions])
    failures.expect(steps[0] == steps[1], f"decided at steps {steps[0]} through torchft, {steps[1]} on DDP")
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    failures.expect(same, "through torchft, the parameters differ from auto's on plain DDP")
    failures.expect(parameters_identical_on_all_ranks(list(model.parameters())), "the groups' parameters differ")
    failures.expect(state.resyncs == 1 and state.quorums == 1, f"{state.resyncs} resyncs, {state.quorums} quorums")
    return failures


@pytest.mark.timeout(240)
def test_auto_through_torchft_trains_as_auto_on_ddp() -> None:
    run_checks(2, healthy, timeout=220)


def forced_replica_group(*arguments: Any) -> None:
    """:func:`tests.test_torchft.replica_group` with ``auto``'s decision forced to the compressor
    (in a process of its own)."""
    with compressor_forced():
        replica_group(*arguments)


@pytest.mark.timeout(240)
def test_a_group_restarted_after_autos_decision_averages_with_the_others() -> None:
    """Three groups; auto decides at step 2; the third is killed (SIGKILL) at step 6 and restarted
    with nothing decided: it takes the others' decision before its first bucket, heals and ends
    with the same parameters at the same step, its choice theirs."""
    die_at = 6
    finished = three_groups_one_lost(forced_replica_group, SPEC, 14, die_at, mid_step=False)
    first, last_step, choice = finished[0][0], finished[0][5], finished[0][6]
    assert choice and set(choice.values()) == {1}, finished
    for parameters, _, _, _, _, step, theirs in finished.values():
        assert torch.equal(parameters, first) and step == last_step and theirs == choice, finished
    assert finished[2][1] < last_step - die_at - 2, finished  # it healed at the survivors' step, not from 0


def test_a_checkpoint_holds_the_decision_and_a_resumed_state_takes_it() -> None:
    """state_dict: the decision (step, when it measured, the prediction, every tensor's candidate),
    not the residuals; loaded into a fresh state it is that decision; another spec's is refused."""
    from types import SimpleNamespace

    from gradcomp.hooks.auto_spec import AutoSpec
    from gradcomp.hooks.fault_tolerant_auto import FaultTolerantAutoState

    def fresh(spec: str = SPEC) -> FaultTolerantAutoState:
        return FaultTolerantAutoState(SimpleNamespace(), AutoSpec.parse(spec), SimpleNamespace(), parameters=4)

    decided = fresh()
    decided.step, decided.measured_at, decided.predicted_s, decided.choice = 9, 2, 0.0125, {0: 1, 3: 1}
    saved = decided.state_dict()
    assert set(saved) == {"spec", "decision"}  # nothing per rank
    resumed = fresh()
    resumed.load_state_dict(saved)
    assert (resumed.step, resumed.measured_at, resumed.predicted_s) == (9, 2, 0.0125)
    assert resumed.choice == {0: 1, 1: 0, 2: 0, 3: 1} and not resumed._measure_next
    with pytest.raises(ValueError, match="not of this hook's"):
        fresh("auto:candidates=fp16,measure_at=2").load_state_dict(saved)
