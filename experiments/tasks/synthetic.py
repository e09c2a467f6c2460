"""Random inputs and labels for step-time studies: the loss means nothing, the steps per second do.

``mlp`` is the benchmark MLP 1024-2048-2048-10 (6.32M parameters) on 1024-feature inputs;
``resnet18`` the CIFAR-style ResNet-18 (11.2M) on 3x32x32 images; ``chartransformer`` a character
transformer (4 layers of width 256, 3.2M) on windows of 128 random tokens, predicting the next
token; ``gpt`` the same kind of model GPT-shaped (12 layers of width 128, 150 parameter tensors,
2.45M) on windows of 64. A small pool of random samples (generated once, seeded) is cycled through, so no time goes
into making data. There is no evaluation; the headline metric is training steps per second. The
DDP benchmark (``gradcomp bench ddp``) trains these models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from gradcomp.experiments.models import MLP, CharTransformer, ResNet18
from gradcomp.experiments.tasks.base import Batch, ClassificationTask, TaskSpec

VOCABULARY, CONTEXT = 128, 128
"""The character transformer's alphabet and window."""
GPT_VOCABULARY, GPT_CONTEXT = 256, 64
"""The GPT-shaped model's vocabulary and window."""


@dataclasses.dataclass(frozen=True)
class Options:
    samples: int = 1024
    """Random samples in the pool that batches are drawn from."""
    image: int = 32
    """Image side for resnet18."""

    def __post_init__(self) -> None:
        if not 1 <= self.samples <= 100_000:
            raise ValueError(f"samples must be in 1..100000, got {self.samples}")
        if not 8 <= self.image <= 256:
            raise ValueError(f"image must be in 8..256, got {self.image}")


class SyntheticTask(ClassificationTask):
    kind = "synthetic"
    metric = "steps_per_s"
    evaluates = False

    def __init__(self, options: Options) -> None:
        self.options = options
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(options.samples, 1024, generator=generator)
        labels = torch.randint(0, 10, (options.samples,), generator=generator)
        models: dict[str, Callable[[], nn.Module]] = {
            "mlp": partial(MLP, 1024, [2048, 2048], 10),
            "resnet18": partial(ResNet18, 10, 3),
            "chartransformer": partial(CharTransformer, VOCABULARY, context=CONTEXT, d_model=256, heads=4, layers=4),
            # many small tensors, as the models people train have (GPT-2 small: 148): 150 of them
            "gpt": partial(CharTransformer, GPT_VOCABULARY, context=GPT_CONTEXT, d_model=128, heads=4, layers=12),
        }
        super().__init__("synthetic", (features, labels), (features[:0], labels[:0]), models, {"random": True})

    def build_model(self, name: str | None) -> torch.nn.Module:
        # Inputs for the model asked for (images can be large: only when asked).
        generator = torch.Generator().manual_seed(1)
        if (name or self.default_model) == "resnet18":
            side = self.options.image
            self.train_x = torch.randn(self.options.samples, 3, side, side, generator=generator)
        elif name in ("chartransformer", "gpt"):
            vocabulary, context = (VOCABULARY, CONTEXT) if name == "chartransformer" else (GPT_VOCABULARY, GPT_CONTEXT)
            tokens = torch.randint(0, vocabulary, (self.options.samples, context + 1), generator=generator)
            self.train_x, self.train_y = tokens[:, :-1], tokens[:, 1:]
        return super().build_model(name)

    def batch(self, step: int, batch_size: int, seed: int) -> Batch:
        # Cycle through the pool in order: random data need no shuffling, and this costs nothing.
        start = (step * batch_size) % len(self.train_y)
        chosen = torch.arange(start, start + batch_size) % len(self.train_y)
        return self.train_x[chosen], self.train_y[chosen]


def build(options: Options, data: str | None) -> SyntheticTask:
    return SyntheticTask(options)


SPEC = TaskSpec(
    "synthetic", Options, ("mlp", "resnet18", "chartransformer", "gpt"), build,
    summary="random data, for steps per second",
)
