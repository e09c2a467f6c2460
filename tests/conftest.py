"""Shared fixtures for the test suite."""

from __future__ import annotations

import pytest
import torch

from tests.training_runs import TrainingRun, train_straight


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Small tensors: threads only add noise, and CI has 2 cores.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> TrainingRun:
    """The digits run of tests.training_runs, straight through: trained once for the whole session."""
    return train_straight(tmp_path_factory.mktemp("runs") / "straight")
