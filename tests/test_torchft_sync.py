"""gradcomp's synchronizers on torchft's manager (``gradcomp.sync.fault_tolerant``).

torchft's own regression test of its DiLoCo (``torchft/diloco_regression_test.py``) records, for two
replica groups, a mock model's parameters before every inner step and the global parameters at every
committed step; its golden files are copied in ``tests/fixtures/torchft`` (BSD-3, torchft's license
beside them; from pytorch/torchft at 73dafea). gradcomp's DiLoCo with torchft's schedule
(``early=true``) reproduces them bitwise, every mixing and delay they cover."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import Failures, run_checks
from tests.torchft_groups import replica

pytest.importorskip("torchft")

FIXTURES = Path(__file__).parent / "fixtures" / "torchft"
GOLDEN = [(0, 0.0), (0, 0.5), (0, 1.0), (1, 0.0), (1, 0.5), (1, 1.0)]
"""torchft's cases in its order (fixture ``test_diloco_mocked_updates_<i>``): (fragment_sync_delay,
fragment_update_alpha), 2 fragments, sync_every 6, inner lr 1 on gradients of 2, outer SGD lr 2."""


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
