"""scikit-learn's bundled handwritten digits: 1,797 real 8x8 grey-level images of the digits 0-9.

The data ship inside scikit-learn (nothing is downloaded). A fixed seeded split holds out 397 images
for evaluation (the size of ``tests/test_convergence.py``'s). Small enough that a 2-rank run of a few hundred
steps takes seconds, real enough that error feedback and bias show: the quick sweep's task.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from functools import partial

import numpy
import torch
from torch import Tensor, nn

from gradcomp.experiments.models import MLP, SmallCNN
from gradcomp.experiments.tasks.base import ClassificationTask, TaskSpec, mlp_hidden, split

HELD_OUT = 397
EXTRA = "pip install 'gradcomp[experiments]' (or scikit-learn)"


@dataclasses.dataclass(frozen=True)
class Options:
    hidden: str = "128"
    """The MLP's hidden widths, joined by '-'."""

    def __post_init__(self) -> None:
        mlp_hidden(self.hidden)


def load() -> tuple[Tensor, Tensor]:
    """The 1,797 digits as (N, 1, 8, 8) floats in [0, 1] and their labels.

    Read straight from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, what
    ``sklearn.datasets.load_digits`` reads; the test suite checks they agree): importing scikit-learn
    costs each rank seconds.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ValueError(f"the digits task reads the data scikit-learn ships: {EXTRA}")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    table = torch.from_numpy(numpy.loadtxt(path, delimiter=",", dtype=numpy.float32))
    return table[:, :-1].reshape(-1, 1, 8, 8) / 16.0, table[:, -1].long()


def build(options: Options, data: str | None) -> ClassificationTask:
    x, y = load()
    train, test = split(x, y, HELD_OUT, seed=0)
    models: dict[str, Callable[[], nn.Module]] = {
        "mlp": partial(MLP, 64, mlp_hidden(options.hidden), 10),
        "smallcnn": partial(SmallCNN, 10, 1),
    }
    return ClassificationTask("digits", train, test, models, {"source": "sklearn.datasets.load_digits"})


SPEC = TaskSpec("digits", Options, ("mlp", "smallcnn"), build, summary="scikit-learn's handwritten digits, 8x8")
