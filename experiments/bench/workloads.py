"""What the ranks of ``gradcomp bench ddp`` (and ``fsdp``) train: a preset model of the ``synthetic``
task at a batch size (:data:`PRESETS`), or a user's own model, imported from ``pkg.module:factory``
and trained on random inputs (:func:`user_model`, checked before any rank starts)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import torch
from torch import Tensor, nn


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model of the ``synthetic`` task, and the batch each rank trains it on."""

    name: str
    model: str
    """The synthetic task's model name."""
    batch_size: int
    """Samples per rank and step."""
    about: str


PRESETS = {
    "mlp": Preset("mlp", "mlp", 32, "MLP 1024-2048-2048-10, 6.32M parameters"),
    "cnn": Preset("cnn", "resnet18", 8, "ResNet-18 (32x32 inputs), 11.2M parameters"),
    "transformer": Preset(
        "transformer", "chartransformer", 8, "character transformer, 4 layers of width 256, 3.2M parameters"
    ),
    "gpt": Preset("gpt", "gpt", 8, "GPT-shaped transformer, 12 layers of width 128: 150 tensors, 2.45M parameters"),
}


@dataclasses.dataclass(frozen=True)
class UserModel:
    """A user's model: ``factory`` (``pkg.module:function``) builds it; it trains on random inputs."""

    factory: str
    input_shape: tuple[int, ...]
    """One sample's shape (without the batch dimension)."""
    batch_size: int = 8
    input_high: int | None = None
    """Integer inputs in [0, input_high) (token ids) instead of standard normal floats."""

    @property
    def about(self) -> str:
        kind = f"integers below {self.input_high}" if self.input_high else "normal floats"
        return f"{self.factory}, random inputs of shape {list(self.input_shape)} ({kind})"

    def build(self) -> nn.Module:
        module_name, function = self.factory.split(":")  # checked by user_model
        model = getattr(importlib.import_module(module_name), function)()
        if not isinstance(model, nn.Module):
            raise TypeError(f"{self.factory} returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    def batch(self, rank: int, seed: int) -> Tensor:
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        shape = (self.batch_size, *self.input_shape)
        if self.input_high:
            return torch.randint(0, self.input_high, shape, generator=generator)
        return torch.randn(shape, generator=generator)


BenchModel = Preset | UserModel
"""What the ranks train: a preset of the synthetic task, or a user's model."""


def user_model(factory: str, input_shape: str | None, batch_size: int = 8, input_high: int | None = None) -> UserModel:
    """Check a ``pkg.module:factory`` model's arguments (and that it imports) before any rank starts."""
    module_name, colon, function = factory.partition(":")
    if not colon or not module_name or not function.isidentifier():
        raise ValueError(f"--model takes a preset ({', '.join(PRESETS)}) or pkg.module:factory, got {factory!r}")
    if input_shape is None:
        raise ValueError(f"--model {factory} needs --input-shape (one sample's shape, e.g. 3,32,32)")
    try:
        shape = tuple(int(size) for size in input_shape.split(",") if size.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ValueError(f"--input-shape must be positive sizes separated by commas (3,32,32), got {input_shape!r}")
    if batch_size < 1 or (input_high is not None and input_high < 1):
        raise ValueError(f"--batch-size and --input-high must be >= 1, got {batch_size} and {input_high}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} for --model {factory}: {error}") from error
    if not callable(getattr(module, function, None)):
        raise ValueError(f"{module_name} has no function {function!r} (--model {factory})")
    return UserModel(factory, shape, batch_size, input_high)


def import_from_current_directory() -> None:
    """Let a user's model be a module of the current directory, as ``python -m`` does (a console
    script does not put it on ``sys.path``; the ranks inherit ``sys.path``)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
