"""Error feedback on a real task: scikit-learn's handwritten digits, 2 gloo ranks, DDP.

400 steps of plain SGD (lr 0.5, batch 32 per rank) on an MLP: top-k at 1% and sign, both with error
feedback, reach within 1 point of uncompressed accuracy, while top-k at 1% without it is measurably
worse. With momentum 0.9 (lr 0.05, 300 steps), top-k with error feedback under the optimizer's
momentum falls short (measured: 93.5% against 95.7%), and DGC's momentum correction with a ratio
warm-up comes within a point (95.2%). Everything is seeded, so the figures are reproducible.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed import spawn_ranks
from tests.toy_ddp import sgd_steps, wrap

STEPS = 400
SPECS = ["default", "topk:ratio=0.01,ef=true", "sign:ef=true", "topk:ratio=0.01"]


MOMENTUM_STEPS = 300
MOMENTUM_SPECS = {  # spec: the optimizer's momentum (DGC's correction takes it over in the hook)
    "default": 0.9,
    "topk:ratio=0.01,ef=true": 0.9,
    "topk:ratio=0.01,ef=true,momentum=0.9,mask=true,warmup=30": 0.0,
}


def train_digits(rank: int, world: int) -> dict[str, float]:
    """Every spec's test accuracy after training from the same seeded start on this rank's shard:
    plain SGD (lr 0.5, 400 steps), then with momentum 0.9 (lr 0.05, 300 steps)."""
    accuracy = {spec: _train(rank, world, spec, 0.5, 0.0, STEPS) for spec in SPECS}
    for spec, momentum in MOMENTUM_SPECS.items():
        accuracy[f"momentum {spec}"] = _train(rank, world, spec, 0.05, momentum, MOMENTUM_STEPS)
    return accuracy


def _train(rank: int, world: int, spec: str, lr: float, momentum: float, steps: int) -> float:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400], order[1400:]
    shard = train[rank::world]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp, _ = wrap(net, None if spec == "default" else spec, bucket_cap_mb=None)
    sampler = torch.Generator().manual_seed(10 + rank)
    batches = [shard[torch.randint(0, len(shard), (32,), generator=sampler)] for _ in range(steps)]
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    sgd_steps(ddp, optimizer, [(x[batch], y[batch]) for batch in batches])
    with torch.no_grad():
        return float((net(x[test]).argmax(1) == y[test]).float().mean())


@pytest.fixture(scope="module")
def accuracy() -> dict[str, float]:
    return spawn_ranks(2, train_digits, timeout=240)[0]


def test_uncompressed_training_learns_the_digits(accuracy: dict[str, float]) -> None:
    assert accuracy["default"] > 0.93


@pytest.mark.parametrize("spec", ["topk:ratio=0.01,ef=true", "sign:ef=true"])
def test_error_feedback_stays_within_a_point_of_uncompressed(accuracy: dict[str, float], spec: str) -> None:
    assert accuracy[spec] >= accuracy["default"] - 0.01


def test_top_k_without_error_feedback_is_measurably_worse(accuracy: dict[str, float]) -> None:
    assert accuracy["topk:ratio=0.01"] <= accuracy["topk:ratio=0.01,ef=true"] - 0.01


def test_momentum_correction_recovers_what_error_feedback_loses_with_momentum(accuracy: dict[str, float]) -> None:
    """With momentum 0.9, top-k + EF under the optimizer's momentum falls short of uncompressed
    (the interaction DGC describes); moved into the hook, before compression, with a warm-up of the
    ratio, it comes within a point."""
    default = accuracy["momentum default"]
    assert default > 0.93
    corrected = accuracy["momentum topk:ratio=0.01,ef=true,momentum=0.9,mask=true,warmup=30"]
    assert corrected >= default - 0.01
    assert corrected >= accuracy["momentum topk:ratio=0.01,ef=true"] + 0.01
