"""Shared fixtures for the test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from tests.rank_pool import spawn_pooled
from tests.training_runs import TrainingRun, train_straight

os.environ.setdefault("GRADCOMP_COMPILE", "0")
"""The suite runs the eager operators (and so do the ranks it spawns, which inherit it): compiling
every configuration of every test would cost minutes. ``tests/test_fusion.py`` compiles, and proves the
compiled kernels give what the eager operators give."""

LONGEST_FIRST = [
    "test_lightning.py", "test_reliability.py", "test_hooks.py", "test_hsdp_training.py", "test_unbiased.py",
    "test_collectives.py", "test_bench_ddp.py", "test_fsdp_training.py", "test_fsdp.py", "test_sync.py",
    "test_netem.py", "test_convergence.py", "test_docs.py", "test_loop_habits.py", "test_exchange.py",
    "test_sync_training.py", "test_tutorial.py", "test_launch.py", "test_accelerate.py", "test_report.py",
]  # fmt: skip
"""The files that take longest on 2 cores (``--durations``), longest first: ``make test``'s workers
take whole files in collection order, so these start first and the last to finish are short ones."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (the others after them, in their order); tests marked ``cuda`` skip,
    saying why, on a machine without a CUDA device."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's order stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: `make gpu-check` runs these on a GPU host")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Small tensors: threads only add noise, and CI has 2 cores.
    torch.set_num_threads(1)


@pytest.fixture(params=["cpu", "accelerator"])
def both_paths(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run a test twice: on the CPU's paths (which read the host where that skips work) and on an
    accelerator's (decided on the device: ``gradcomp.host.as_accelerator``). For a module:
    ``pytestmark = pytest.mark.usefixtures("both_paths")``."""
    from gradcomp import host

    if request.param == "cpu":
        yield
    else:
        with host.as_accelerator():
            yield


@pytest.fixture(scope="session", autouse=True)
def _training_ranks_from_the_pool() -> Iterator[None]:
    """Training runs and benchmarks that tests launch on loopback take their ranks from the session's pools
    (``tests/rank_pool.py``) instead of starting processes of their own: the same ``train`` in the
    same kind of gloo group, without importing torch and the experiments again for every run."""
    from gradcomp.experiments.bench import runner
    from gradcomp.experiments.training import run

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run, "spawn", spawn_pooled)
        patch.setattr(runner, "spawn", spawn_pooled)
        yield


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> TrainingRun:
    """The digits run of tests.training_runs, straight through: trained once for the whole session."""
    return train_straight(tmp_path_factory.mktemp("runs") / "straight")
