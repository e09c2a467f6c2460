"""Classification on a dataset of your own: a ``.pt`` or ``.npz`` file of tensors.

The file holds ``x`` (floating point, one sample per row: (N, features), (N, channels, length) or
(N, channels, height, width)) and ``y`` (integer labels 0..C-1, shape (N,)); optionally ``x_eval`` and
``y_eval`` for a fixed evaluation set, else a seeded tenth of the samples is held out. ``.pt`` files are
loaded with ``torch.load(weights_only=True)`` (a dict of tensors: ``torch.save({"x": x, "y": y}, path)``),
``.npz`` files with ``numpy.load(allow_pickle=False)`` (``numpy.savez(path, x=x, y=y)``).

Models: ``mlp`` always; ``signalcnn`` for (N, channels, length); ``smallcnn`` and ``resnet18`` for images.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from gradcomp.experiments.models import MLP, ResNet18, SignalCNN, SmallCNN
from gradcomp.experiments.tasks.base import ClassificationTask, TaskSpec, count_classes, mlp_hidden, split


@dataclasses.dataclass(frozen=True)
class Options:
    hidden: str = "256"
    """The MLP's hidden widths, joined by '-'."""
    held_out: float = 0.1
    """Fraction held out for evaluation when the file has no ``x_eval``/``y_eval``."""

    def __post_init__(self) -> None:
        mlp_hidden(self.hidden)
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out must be in (0, 1), got {self.held_out}")


def load(path: str) -> dict[str, Tensor]:
    """The tensors of a ``.pt`` or ``.npz`` dataset file, checked."""
    if path.endswith(".npz"):
        import numpy as np

        with np.load(path, allow_pickle=False) as archive:
            arrays: dict[str, Any] = {key: torch.from_numpy(archive[key]) for key in archive.files}
    elif path.endswith(".pt"):
        arrays = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(arrays, dict):
            raise ValueError(f"{path}: a .pt dataset is a dict of tensors (x, y[, x_eval, y_eval])")
    else:
        raise ValueError(f"{path}: a dataset is a .pt or .npz file")
    missing = {"x", "y"} - set(arrays)
    if missing:
        raise ValueError(f"{path}: missing {sorted(missing)}; found {sorted(arrays)}")
    if ("x_eval" in arrays) != ("y_eval" in arrays):
        raise ValueError(f"{path}: give both x_eval and y_eval, or neither")
    for key in [k for k in ("x", "x_eval") if k in arrays]:
        x, y = arrays[key], arrays["y" + key[1:]]
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
            raise ValueError(f"{path}: {key} must be floating point of shape (N, ...)")
        if not isinstance(y, Tensor) or y.dtype.is_floating_point or y.dim() != 1 or len(y) != len(x):
            raise ValueError(f"{path}: {'y' + key[1:]} must be integer labels of shape ({len(x)},)")
        if len(y) and int(y.min()) < 0:
            raise ValueError(f"{path}: labels must be >= 0")
        arrays[key] = x.float()
        arrays["y" + key[1:]] = y.long()
    return arrays


def build(options: Options, data: str | None) -> ClassificationTask:
    if data is None:
        raise ValueError("task classify needs a dataset: data=PATH (.pt or .npz with x and y)")
    arrays = load(data)
    x, y = arrays["x"], arrays["y"]
    if "x_eval" in arrays:
        train, test = (x, y), (arrays["x_eval"], arrays["y_eval"])
        if test[0].shape[1:] != x.shape[1:]:
            raise ValueError(f"{data}: x_eval samples are {tuple(test[0].shape[1:])}, x's {tuple(x.shape[1:])}")
    else:
        train, test = split(x, y, max(1, round(len(x) * options.held_out)), seed=0)
    classes = count_classes(y, test[1])
    shape = tuple(x.shape[1:])
    models: dict[str, Callable[[], nn.Module]] = {
        "mlp": partial(MLP, math.prod(shape), mlp_hidden(options.hidden), classes)
    }
    if len(shape) == 2:
        models["signalcnn"] = partial(SignalCNN, classes, shape[0])
    if len(shape) == 3:
        models["smallcnn"] = partial(SmallCNN, classes, shape[0])
        models["resnet18"] = partial(ResNet18, classes, shape[0])
    info = {"source": os.path.abspath(data), "sample_shape": list(shape), "classes": classes}
    return ClassificationTask("classify", train, test, models, info)


SPEC = TaskSpec(
    "classify",
    Options,
    ("mlp", "signalcnn", "smallcnn", "resnet18"),
    build,
    data="required",
    summary="your own dataset: a .pt or .npz file with x and y",
)
