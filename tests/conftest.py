"""Shared fixtures for the test suite."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Small tensors: threads only add noise, and CI has 2 cores.
    torch.set_num_threads(1)
