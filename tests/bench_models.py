"""Models for ``gradcomp bench ddp --model tests.bench_models:<factory>`` in the tests."""

from __future__ import annotations

from torch import nn


def tiny() -> nn.Module:
    """Two linear layers on 16 features."""
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def wide() -> nn.Module:
    """256 features into 1024 and out to 16: a 1.1 MB gradient, enough to load a shaped link."""
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 16))


def tokens() -> nn.Module:
    """An embedding of 50 token ids (integer inputs) and a head; returns a tuple, as some models do."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 8), nn.Linear(8, 50)

        def forward(self, ids):  # type: ignore[no-untyped-def]
            return (self.head(self.embed(ids)), None)

    return Tokens()


NOT_A_MODEL = 3


def not_a_model() -> int:
    return 3
