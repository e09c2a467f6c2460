"""gradcomp's synchronizers on torchft's manager (``gradcomp.sync.fault_tolerant``).

torchft's own regression test of its DiLoCo (``torchft/diloco_regression_test.py``) records, for two
replica groups, a mock model's parameters before every inner step and the global parameters at every
committed step; its golden files are copied in ``tests/fixtures/torchft`` (BSD-3, torchft's license
beside them; from pytorch/torchft at 73dafea). gradcomp's DiLoCo with torchft's schedule
(``early=true``) reproduces them bitwise, every mixing and delay they cover."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import Failures, run_checks
from tests.torchft_groups import lose_and_restart, replica

pytest.importorskip("torchft")

FIXTURES = Path(__file__).parent / "fixtures" / "torchft"
GOLDEN = [(0, 0.0), (0, 0.5), (0, 1.0), (1, 0.0), (1, 0.5), (1, 1.0)]
"""torchft's cases in its order (fixture ``test_diloco_mocked_updates_<i>``): (fragment_sync_delay,
fragment_update_alpha), 2 fragments, sync_every 6, inner lr 1 on gradients of 2, outer SGD lr 2."""


def test_diloco_on_torchft_refuses_what_one_quorum_at_a_time_cannot_run() -> None:
    import types

    from gradcomp.sync import fault_tolerant

    model = nn.Linear(4, 2)
    synchronous, asynchronous = (types.SimpleNamespace(_use_async_quorum=a, _pg=None) for a in (False, True))
    cases = [(asynchronous, "diloco:every=4", "use_async_quorum=False"),
             (synchronous, "diloco:every=5,fragments=2", r"every \(5\) must be a multiple of fragments \(2\)"),
             (synchronous, "diloco:every=4,fragments=2,delay=2", r"use a delay below every / fragments \(2\)"),
             (synchronous, "localsgd:every=4,state=true", "state and local_size are not supported")]  # fmt: skip
    inner = torch.optim.SGD(model.parameters())
    for manager, sync, message in cases:
        with pytest.raises(ValueError, match=message):
            fault_tolerant.FaultTolerantSynchronizer(manager, model, sync, optimizer=inner)


def golden_run(rank: int, world: int, delay: int, alpha: float) -> dict[str, Any]:
    """torchft's mocked DiLoCo run, with gradcomp's synchronizer: a model of two 1x1 layers at 1,
    gradients of 2, plain SGD inside (lr 1) and outside (lr 2); the manager at step 2 first (as its
    test starts, with two commits), the run ends at its step 7. Returns the parameters before each
    inner step, and the global ones when a commit is first seen, as its fixtures hold them."""
    from gradcomp.sync import fault_tolerant

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(1, 1, bias=False) for _ in range(2)])
    with torch.no_grad():
        for layer in model.layers:
            layer.weight.fill_(1.0)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    history: dict[str, Any] = {"history": {}, "global_parameter_history": {}}
    with replica(rank, world, asynchronous=False) as manager:
        manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        outer = fault_tolerant.DiLoCo(manager, model, inner, every=6, fragments=2, delay=delay, early=delay > 0,
                                      mix=alpha, outer_lr=2.0, momentum=0.0, nesterov=False)  # fmt: skip
        manager.start_quorum()
        dist.barrier()
        assert manager.should_commit() and manager.should_commit()
        seen: set[int] = set()
        step = 0
        while True:
            named = dict(model.named_parameters())
            history["history"][str(step)] = {name: p.detach().tolist() for name, p in named.items()}
            committed = manager.current_step()
            if committed == 7:
                break
            if committed not in seen:
                seen.add(committed)
                history["global_parameter_history"][str(step)] = {
                    name: g.tolist() for name, g in zip(named, outer.globals, strict=True)
                }
            for p in model.parameters():
                p.grad = torch.full_like(p, 2.0)
            inner.step()
            outer.step()
            step += 1
    history["failures"] = outer.failures
    return history


def golden_checks(rank: int, world: int) -> Failures:
    failures = Failures()
    for index, (delay, alpha) in enumerate(GOLDEN):
        fixture = json.loads((FIXTURES / f"test_diloco_mocked_updates_{index}.json").read_text())[rank][0]
        ran = golden_run(rank, world, delay, alpha)
        case = f"fixture {index} (delay {delay}, alpha {alpha})"
        failures.expect(ran["failures"] == 0, f"{case}: {ran['failures']} synchronizations failed")
        failures.expect(ran["history"] == fixture["history"], f"{case}: parameters {ran['history']}")
        failures.expect(ran["global_parameter_history"] == fixture["global_parameter_history"],
                        f"{case}: global parameters {ran['global_parameter_history']}")  # fmt: skip
    return failures


@pytest.mark.timeout(200)
def test_diloco_on_torchft_reproduces_torchfts_golden_trajectories_bitwise() -> None:
    """Two replica groups under a lighthouse, gradcomp's DiLoCo on each one's manager: every step's
    parameters and every commit's global ones equal torchft's golden files exactly (the values are
    small integers and halves: any difference of schedule, mixing or outer step shows)."""
    run_checks(2, golden_checks, timeout=180)


def diloco_group(replica: int, lighthouse: str, spec: str, syncs: int, die_at: int | None, shared: Any,
                 results: Any) -> None:  # fmt: skip
    """One replica group of one rank in a process of its own: the toy model trained with gradcomp's
    Streaming DiLoCo (2 fragments, a synchronization every 2 inner steps landing 1 later) on torchft's
    manager until the groups' commit count reaches ``syncs`` and two past the one at which the group
    that died rejoined (``shared["rejoined"]``: every group stops at the same landing). At commit
    ``die_at`` it kills itself (SIGKILL) just after a synchronization started, its fragment in flight.
    Puts (replica, global parameters, synchronizations failed here, inner steps here, commits) on
    ``results``."""
    import os
    import signal

    import torch.nn.functional as F

    from gradcomp.sync import fault_tolerant
    from tests.torchft_groups import replica_manager
    from tests.toy_ddp import toy_batches, toy_model

    torch.set_num_threads(1)
    manager = replica_manager(replica, 2, lighthouse, timeout=10.0, asynchronous=False)
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("inner", inner.load_state_dict, inner.state_dict)
    outer = fault_tolerant.DiLoCo(manager, model, inner, every=4, fragments=2, delay=1, mix=0.0, spec=spec)
    batches = toy_batches(replica, 16)
    restarted = die_at is None and replica == 2
    steps = 0
    deadline = time.monotonic() + 90  # a bound, should the group that died never come back
    while time.monotonic() < deadline:
        rejoined = shared["rejoined"].value
        done = manager.current_step() >= syncs and rejoined >= 0 and manager.current_step() >= rejoined + 2
        if done and not outer.in_flight:
            break
        x, y = batches[steps % len(batches)]
        inner.zero_grad()
        F.cross_entropy(model(x), y).backward()
        inner.step()
        before = manager.current_step()
        outer.step()
        steps += 1
        if replica == 0:
            shared["progress"].value = manager.current_step()
        if restarted and manager.current_step() > before and shared["rejoined"].value < 0:
            shared["rejoined"].value = manager.current_step()
        if die_at is not None and manager.current_step() >= die_at and outer.in_flight:
            os.kill(os.getpid(), signal.SIGKILL)  # a fragment in flight, its collective maybe not sent
        time.sleep(0.01)
    globals_ = torch.cat([g.reshape(-1) for g in outer.globals])
    results.put(pickle.dumps((replica, globals_, outer.failures, steps, manager.current_step())))
    manager.shutdown(wait=False)


@pytest.mark.timeout(240)
def test_a_group_lost_with_a_fragment_in_flight_leaves_the_others_synchronizing_and_heals_when_restarted() -> None:
    """Three replica groups under DiLoCo with 4-bit outer gradients; the third is killed (SIGKILL)
    while a fragment's synchronization is in flight, and started again once the others have
    committed three synchronizations without it: they go on (losing at most the synchronization the
    death broke and one while the quorum settles), it heals the global parameters and the outer
    optimizers from a live group at the quorum it joins, and all three end with the same global
    parameters, bitwise."""
    from gradcomp.launch import rank_context

    context = rank_context()
    results = context.Queue()
    shared = {"progress": context.Value("i", 0), "rejoined": context.Value("i", -1)}
    syncs, die_at, spec = 10, 3, "quantize:bits=4,ef=true"

    def arguments(replica: int, dies: bool) -> tuple[Any, ...]:
        return (replica, shared["lighthouse"], spec, syncs, die_at if dies else None, shared, results)

    finished = lose_and_restart(diloco_group, arguments, die_at, shared, results)
    first, commits = finished[0][0], finished[0][-1]
    assert all(torch.equal(outcome[0], first) and outcome[-1] == commits for outcome in finished.values()), finished
    for _, failed, _, _ in (finished[0], finished[1]):
        assert failed <= 2, finished
    restarted_steps = finished[2][2]
    assert restarted_steps < finished[0][2] - 2 * die_at, finished  # healed at the others' commit, not from 0


def restart_on_one_group(rank: int, world: int) -> Failures:
    """DiLoCo over PowerSGD (its warm starts are state) on two groups; before the third
    synchronization group 1 alone restarts its engine (as after a failure only it saw): every group
    makes its engine again there, and they stay bitwise alike."""
    import torch.nn.functional as F

    from gradcomp.sync import fault_tolerant
    from tests.distributed import parameters_identical_on_all_ranks
    from tests.toy_ddp import toy_batches, toy_model

    failures = Failures()
    model = toy_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    with replica(rank, world, asynchronous=False) as manager:
        manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        outer = fault_tolerant.DiLoCo(manager, model, inner, every=2, spec="powersgd:rank=2,ef=true")
        for step, (x, y) in enumerate(toy_batches(rank, 10)):
            if step == 5 and rank == 1:
                outer.engines.restart()
            inner.zero_grad()
            F.cross_entropy(model(x), y).backward()
            inner.step()
            outer.step()
    failures.expect(outer.engines.quorums == 2, f"group {rank} made {outer.engines.quorums} engines, not 2")
    failures.expect(parameters_identical_on_all_ranks(list(model.parameters())), "the groups' parameters differ")
    return failures


def test_a_restart_one_group_asks_for_is_every_groups() -> None:
    run_checks(2, restart_on_one_group, timeout=120)
