"""gradcomp on torchft's process groups (issue: training that survives a lost replica).

torchft reconfigures one process group in place at every quorum, a group that ``torch.distributed``
does not know; gradcomp's engine runs on it as it is (``Engine(own_group=False)``: no private group
of its ranks, which a dead member would leave broken), its point-to-point exchanges through the
group's own send and receive. Here: that engine averages as the engine on the world group does,
bitwise, for every kind of payload."""

from __future__ import annotations

import contextlib
import datetime
import pickle
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.distributed import Failures, identical_on_all_ranks, run_checks, spawn_ranks
from tests.torchft_groups import lose_and_restart, replica, replica_manager, served_lighthouse

pytest.importorskip("torchft")

SPECS = ["allreduce", "quantize:bits=4", "sign:ef=true", "topk:ratio=0.1,ef=true", "powersgd:rank=2,ef=true",
         "quantize:bits=4,algo=ring"]  # fmt: skip
"""Sums (native and gradcomp's ring: point-to-point), gathers of fixed and of measured sizes, two rounds."""
MEASURED = ["threshold:tau=0.5,ef=true", "topk:ratio=0.1,method=sampled,ef=true"]
"""Payloads sized by their values, on an accelerator's paths: counts gathered, then sizes known."""
SHAPES = [torch.Size(s) for s in [(40, 30), (30,), (64, 16), (7,), (300, 300)]]


def torchft_group(rank: int, world: int, prefix: str) -> Any:
    """A torchft ``ProcessGroupGloo`` of the world's ranks, configured as its ``Manager`` does at a
    quorum (on a store that rank 0 serves): unknown to ``torch.distributed``."""
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    group = ProcessGroupGloo(timeout=datetime.timedelta(seconds=60))
    group.configure(f"localhost:{port[0]}/{prefix}", f"replica{rank}", rank, world)
    group.kept_store = store  # the store lives as long as the group
    return group


def engines_agree(rank: int, world: int) -> list[str]:
    from gradcomp import host
    from gradcomp.collectives.groups import rank_of, registered, size_of
    from gradcomp.engine import Engine

    group = torchft_group(rank, world, "engines/1")
    failures = Failures()
    # torchft's own rank() answers 0 everywhere: rank_of reads the quorum's group inside it
    failures.expect(not registered(group) and size_of(group) == world and rank_of(group) == rank, "not torchft's group")
    numel = sum(s.numel() for s in SHAPES)
    keys = list(range(len(SHAPES)))
    runs = [(text, False) for text in SPECS] + [(text, True) for text in MEASURED]
    for text, accelerator in runs:
        ours, theirs = Engine(text, group=group, own_group=False), Engine(text)
        with host.as_accelerator() if accelerator else contextlib.nullcontext():
            for step in range(3):
                generator = torch.Generator().manual_seed(100 * rank + step)
                x = torch.randn(numel, generator=generator)
                mine = ours.reduce(x.clone(), keys, SHAPES, 0, True).wait()
                ours.end_step()
                reference = theirs.reduce(x.clone(), keys, SHAPES, 0, True).wait()
                theirs.end_step()
                failures.expect(torch.equal(mine, reference), f"{text}: step {step} differs on torchft's group")
        failures.expect(identical_on_all_ranks(mine), f"{text}: ranks differ")
    return failures


@pytest.mark.timeout(200)
def test_the_engine_runs_on_a_group_torchft_reconfigures_as_on_the_world() -> None:
    run_checks(2, engines_agree, timeout=180)


def test_an_engine_on_a_group_it_does_not_own_makes_no_group_of_its_own() -> None:
    from gradcomp.engine import Engine

    with pytest.raises(ValueError, match="makes no group of its own"):
        Engine("sign:ef=true,local_size=2", group=None, own_group=False)
    with pytest.raises(ValueError, match="makes no group of its own"):
        Engine("sign:ef=true", group=None, own_group=False, timeout=5.0)


def trained_on_plain_ddp(spec: str, batches: list[Any], with_state: bool = False) -> Any:
    """The toy model trained on ``batches`` with gradcomp's hook on plain DDP over the world, made as
    torchft's DDP is (no bucket rebuild: the order DDP first hands the parameters over numbers them,
    and with them the keys that stochastic rounding's noise follows); ``with_state``: and the hook's state."""
    import torch.nn.functional as F

    from gradcomp import hooks
    from tests.toy_ddp import BUCKET_CAP_MB, toy_model

    reference = torch.nn.parallel.DistributedDataParallel(toy_model(), bucket_cap_mb=BUCKET_CAP_MB,
                                                          find_unused_parameters=True)  # fmt: skip
    state = hooks.register(reference, spec)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    return (reference, state) if with_state else reference


def trained_on_torchfts_ddp(rank: int, world: int, batches: list[Any]) -> torch.nn.Module:
    """The toy model trained on ``batches`` through torchft's own DDP (uncompressed) and manager."""
    import torch.nn.functional as F
    import torchft.ddp
    import torchft.optim

    from tests.toy_ddp import BUCKET_CAP_MB, toy_model

    with replica(rank, world) as manager:
        model = torchft.ddp.DistributedDataParallel(manager, toy_model(), bucket_cap_mb=BUCKET_CAP_MB)
        optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model


def trained_through_torchft(rank: int, world: int, specs: list[str]) -> list[str]:
    """Per spec, the toy model trained 4 steps through torchft's manager with the gradcomp hook, and
    through gradcomp's hook on plain DDP over the world (and, for ``allreduce``, through torchft's own
    DDP): the same parameters, bitwise."""
    import torch.nn.functional as F
    import torchft.optim

    from gradcomp.hooks.fault_tolerant import DistributedDataParallel
    from tests.distributed import parameters_identical_on_all_ranks
    from tests.toy_ddp import BUCKET_CAP_MB, toy_batches, toy_model

    failures = Failures()
    batches = toy_batches(rank, 4)
    for text in specs:
        with replica(rank, world) as manager:
            model = DistributedDataParallel(manager, toy_model(), text, bucket_cap_mb=BUCKET_CAP_MB)
            optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
            # what a healing replica fetches from a live one (step 0 syncs every replica from one)
            manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
            manager.register_state_dict_fn("optim", optimizer.load_state_dict, optimizer.state_dict)
            committed = 0
            for x, y in batches:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if manager.should_commit():  # OptimizerWrapper.step, counting the commits
                    committed += 1
                    optimizer.optim.step()
        reference = trained_on_plain_ddp(text, batches)
        if text == "allreduce":  # torchft's own DDP: a sum, then over 2 (exactly gradcomp's halves summed)
            theirs = trained_on_torchfts_ddp(rank, world, batches)
            same = all(torch.equal(a, b) for a, b in zip(model.parameters(), theirs.parameters(), strict=True))
            failures.expect(same, "allreduce: trained through torchft, the parameters differ from torchft's own DDP's")
        failures.expect(committed == len(batches), f"{text}: {committed} of {len(batches)} steps committed")
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
        failures.expect(same, f"{text}: trained through torchft, the parameters differ from gradcomp's own hook's")
        failures.expect(parameters_identical_on_all_ranks(list(model.parameters())), f"{text}: replicas differ")
        failures.expect(model.gradcomp_state.quorums == 1 and model.gradcomp_state.error is None, f"{text}: state")
    return failures


@pytest.mark.timeout(240)
def test_a_hook_through_torchfts_manager_trains_as_on_plain_ddp() -> None:
    """Healthy: through torchft's manager (a quorum each step, commits), gradcomp's hook trains as it
    does on DDP over the world, bitwise: allreduce, a compressor with error feedback, a gather."""
    run_checks(2, trained_through_torchft, (["allreduce", "quantize:bits=4,ef=true", "topk:ratio=0.25,ef=true"],),
               timeout=220)  # fmt: skip


def test_the_fault_tolerant_ddp_refuses_what_torchfts_groups_cannot_carry() -> None:
    from gradcomp.hooks.fault_tolerant import DistributedDataParallel

    model = torch.nn.Linear(4, 2)
    refused = [("auto:candidates=fp16|topk:ratio=0.1,local_size=2", "local_size makes node groups"),
               ("noop", "sends nothing"), ("sign:ef=true,local_size=2", "local_size makes node groups")]  # fmt: skip
    for spec, message in refused:
        with pytest.raises(ValueError, match=message):
            DistributedDataParallel(None, model, spec)


def replica_group(replica: int, lighthouse: str, spec: str, steps: int, die_at: int | None, mid_step: bool,
                  shared: Any, results: Any) -> None:  # fmt: skip
    """One replica group of one rank in a process of its own: the toy model trained through torchft's
    manager with a gradcomp hook until the groups' step count reaches ``steps`` and the group that
    died has rejoined (``shared["rejoined"]``, set by it after its first committed step); at
    ``die_at`` it kills itself (SIGKILL: no goodbye), before the step or (``mid_step``) after its
    forward, while the others' collectives wait for it. Replica 0 posts its step in
    ``shared["progress"]``. Puts (replica, final parameters, steps committed and attempted here, how
    many quorum groups its hook averaged on, whether a step's averaging failed, the final step,
    ``auto``'s candidate per tensor) on ``results``."""
    import os
    import signal

    import torch.nn.functional as F
    import torchft.optim

    from gradcomp.hooks.fault_tolerant import DistributedDataParallel
    from tests.toy_ddp import BUCKET_CAP_MB, toy_batches, toy_model

    torch.set_num_threads(1)
    manager = replica_manager(replica, 2, lighthouse, timeout=10.0)  # at least 2 groups per step
    model = DistributedDataParallel(manager, toy_model(), spec, bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.05))
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optimizer.load_state_dict, optimizer.state_dict)
    batches = toy_batches(replica, steps)
    committed, attempted, restarted = 0, 0, die_at is None and replica == 2
    deadline = time.monotonic() + 90  # a bound, should the group that died never come back
    while time.monotonic() < deadline:
        step = manager.current_step()
        if step >= steps and shared["rejoined"].value:
            break
        dies = die_at is not None and step == die_at
        if dies and not mid_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if replica == 0:
            shared["progress"].value = step
        x, y = batches[step % steps]
        attempted += 1
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if dies:  # in the step's quorum, then gone: the others' collectives of this step wait for it
            manager.wait_quorum()
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        if manager.should_commit():
            committed += 1
            optimizer.optim.step()
            if restarted:
                shared["rejoined"].value = 1
        time.sleep(0.02)  # steps of a few tens of ms: the loss and the rejoin span several of them
    parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # pickled by value: a tensor through the queue's pickler is served by this process until it exits
    state = model.gradcomp_state
    outcome = (parameters, committed, attempted, state.quorums, state.error is not None, manager.current_step(),
               dict(getattr(state, "choice", {})))  # fmt: skip
    results.put(pickle.dumps((replica, *outcome)))
    manager.shutdown(wait=False)


def three_groups_one_lost(target: Any, spec: str, steps: int, die_at: int, mid_step: bool) -> dict[int, Any]:
    """:func:`replica_group` (or ``target``, which runs it) for three groups, the third killed at
    ``die_at`` and restarted (:func:`tests.torchft_groups.lose_and_restart`): each one's outcome."""
    from gradcomp.launch import rank_context

    context = rank_context()
    results = context.Queue()
    shared = {"progress": context.Value("i", 0), "rejoined": context.Value("i", 0)}

    def arguments(replica: int, dies: bool) -> tuple[Any, ...]:
        return (replica, shared["lighthouse"], spec, steps, die_at if dies else None, mid_step, shared, results)

    return lose_and_restart(target, arguments, die_at, shared, results)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("spec", "mid_step"), [("quantize:bits=4,ef=true", True), ("topk:ratio=0.25,ef=true", False)])
def test_a_lost_replica_group_leaves_the_others_training_and_heals_when_restarted(spec: str, mid_step: bool) -> None:
    """Three replica groups; the third is killed (SIGKILL) at step 4, between steps or while the
    others' collectives wait for it (their step fails, is reported and not committed), and started
    again once the others have trained three steps without it: they go on without it (losing at
    most the broken step and one while the quorum settles), it heals from a live one at their step
    and rejoins, and all three end at the same step with the same parameters."""
    die_at = 4
    finished = three_groups_one_lost(replica_group, spec, 12, die_at, mid_step)
    first, last_step = finished[0][0], finished[0][5]
    assert all(torch.equal(outcome[0], first) and outcome[5] == last_step for outcome in finished.values())
    for _, committed, attempted, quorums, failed, *_ in (finished[0], finished[1]):
        # the survivors lose the step the death broke (mid-step: their collectives failed, which was
        # reported and not committed) and at most one more while the quorum settles, and averaged
        # on three quorum groups: all three, the two, all three again
        assert (1 if mid_step else 0) <= attempted - committed <= 2 and failed == mid_step, finished
        assert quorums >= 3, finished
    assert finished[2][1] < last_step - die_at - 2, finished  # it healed at the survivors' step, not from 0


def made_again_mid_run(rank: int, world: int, spec: str) -> list[float]:
    """The toy model trained 6 steps through torchft, the hook's engine made again at step 3 (as at
    a quorum change), with the residuals carried and with them dropped: per way, the largest
    difference from gradcomp's hook on plain DDP trained straight through."""
    import torch.nn.functional as F
    import torchft.optim

    from gradcomp.hooks.fault_tolerant import DistributedDataParallel
    from tests.toy_ddp import BUCKET_CAP_MB, toy_batches, toy_model

    batches = toy_batches(rank, 6)
    straight = torch.cat([p.detach().reshape(-1) for p in trained_on_plain_ddp(spec, batches).parameters()])
    differences = []
    for carried in (True, False):
        with replica(rank, world) as manager:
            model = DistributedDataParallel(manager, toy_model(), spec, bucket_cap_mb=BUCKET_CAP_MB)
            state = model.gradcomp_state
            if not carried:  # what the hook did before it carried them: the residuals dropped
                state.engines._take_residuals = lambda engine: None  # type: ignore[method-assign]
            optimizer = torchft.optim.OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.1))
            for step, (x, y) in enumerate(batches):
                if step == 3:
                    state.engines.restart()  # the engine is made again at this step's first bucket
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
        assert state.quorums == 2 and not state.engines.pending
        trained = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        differences.append(float((trained - straight).abs().max()))
    return differences


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec", ["topk:ratio=0.25,ef=true", "quantize:bits=4,rounding=nearest,ef=true"])
def test_an_engine_made_again_carries_what_error_feedback_had_not_sent(spec: str) -> None:
    """At a quorum change the hook's engine is made again; the residuals it had not sent are added
    to the next gradients (times the old world size): the run trains as one straight through,
    bitwise at 2 groups (times 2, then over 2, is exact), where dropping them moves the weights."""
    for carried, dropped in spawn_ranks(2, made_again_mid_run, (spec,), timeout=220):
        assert carried == 0.0 and dropped > 1e-4, (carried, dropped)


def example_run(rank: int, world: int, steps: int, extra: tuple[str, ...] = ()) -> str:
    """``examples/torchft/train.py`` run as its docstring runs it, in this rank: a replica group of
    its own under rank 0's lighthouse, with a store of its own (torchrun's), the environment torchrun
    and the recipe give it; what it printed."""
    import io
    import os
    import pathlib
    import runpy
    import sys

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    example = pathlib.Path(__file__).parent.parent / "examples" / "torchft" / "train.py"
    printed = io.StringIO()
    with served_lighthouse(rank, world) as lighthouse:
        given = {"REPLICA_GROUP_ID": str(rank), "TORCHFT_LIGHTHOUSE": lighthouse, "MASTER_ADDR": "localhost",
                 "MASTER_PORT": str(store.port), "RANK": "0", "WORLD_SIZE": "1"}  # fmt: skip
        saved, argv = {k: os.environ.get(k) for k in given}, sys.argv
        os.environ.update(given)
        sys.argv = [str(example), "--steps", str(steps), "--min-groups", str(world), *extra]
        try:
            with contextlib.redirect_stdout(printed):
                runpy.run_path(str(example), run_name="__main__")
        finally:
            sys.argv = argv
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return printed.getvalue()


@pytest.mark.timeout(180)
def test_the_torchft_example_trains_two_replica_groups() -> None:
    """``examples/torchft/train.py`` as its docstring runs it: two groups under a lighthouse train 20
    steps, every step averaged over both; then 40 inner steps of DiLoCo, synchronizing over both."""
    for group, printed in enumerate(spawn_ranks(2, example_run, (20,), timeout=150)):
        assert f"group {group} step 20 " in printed and "groups 2" in printed, printed
    diloco = ("--sync", "diloco:every=4,fragments=2,delay=1,early=true", "--spec", "quantize:bits=4,ef=true")
    for group, printed in enumerate(spawn_ranks(2, example_run, (40, diloco), timeout=150)):
        assert f"group {group} step 20 " in printed and "groups 2" in printed, printed


def test_state_starts_anew_on_every_rank_alike_read_from_the_manager() -> None:
    """Restarts: after a step committed nowhere, and in a step where a group heals; not after a step
    that committed, nor because of a failure seen on this rank only (the others would not know)."""
    from types import SimpleNamespace

    from gradcomp.engine.quorum import Restarts

    manager = SimpleNamespace(step=0, participants=3)
    manager.current_step = lambda: manager.step
    manager.num_participants = lambda: manager.participants
    group = SimpleNamespace(size=lambda: 3)
    restarts = Restarts(manager, group)
    seen = []
    for step, participants in [(0, 3), (1, 3), (1, 3), (2, 2), (3, 3), (4, 3)]:
        manager.step, manager.participants = step, participants
        seen.append(restarts.due())
    # the first step; committed; not committed (step 1 again); a group heals; committed twice
    assert seen == [False, False, True, True, False, False]
