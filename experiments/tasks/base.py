"""What every task provides to the training loop, and the parts the classification tasks share.

A task is built once per rank, identically on every rank (its data are generated or loaded from
fixed sources with fixed seeds). The loop asks it for the *global* batch of a step, takes its own
shard (``rank::world``), and evaluates on a shard of the fixed evaluation set; so the data a run
sees depend on the seed and the step only, never on the number of ranks or on a resume.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gradcomp.options import options_from

Batch = tuple[Tensor, Tensor]
Kind = Literal["classification", "language_model", "synthetic"]


class Task(abc.ABC):
    """A built task: data, the models that fit them, the loss and the evaluation metrics."""

    name: str
    kind: Kind
    metric: str
    """The headline metric of a run (in the final metrics): ``accuracy``, ``perplexity``, ``steps_per_s``."""
    higher_is_better: bool = True
    evaluates: bool = True
    """False where evaluation means nothing (random data): no ``eval/*`` scalars then."""

    def __init__(self, models: Mapping[str, Callable[[], nn.Module]], info: dict[str, Any]) -> None:
        self.models = dict(models)
        self.info = info

    @property
    def default_model(self) -> str:
        return next(iter(self.models))

    def build_model(self, name: str | None) -> nn.Module:
        name = name or self.default_model
        if name not in self.models:
            raise ValueError(f"task {self.name!r} has no model {name!r} for its data; valid: {', '.join(self.models)}")
        return self.models[name]()

    @abc.abstractmethod
    def steps_per_epoch(self, batch_size: int) -> int: ...

    @abc.abstractmethod
    def batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """The global batch of ``step``: a function of (step, batch_size, seed) only."""

    @abc.abstractmethod
    def eval_set(self) -> Batch:
        """The whole evaluation set, fixed for the task (the loop shards and batches it)."""

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output.flatten(0, -2), target.flatten())

    def eval_sums(self, output: Tensor, target: Tensor) -> Tensor:
        """Sums to all-reduce over ranks and batches: (summed loss, correct predictions, count)."""
        logits, labels = output.flatten(0, -2).float(), target.flatten()
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
        correct = (logits.argmax(-1) == labels).sum()
        return torch.stack([loss, correct.to(loss.dtype), torch.tensor(labels.numel(), dtype=loss.dtype)])

    def eval_metrics(self, sums: Tensor) -> dict[str, float]:
        loss, correct, count = (float(v) for v in sums)
        return {"loss": loss / count, "accuracy": correct / count}


class ClassificationTask(Task):
    """Inputs ``x`` and integer labels ``y``; each epoch visits the training set in a new seeded order."""

    kind: Kind = "classification"
    metric = "accuracy"

    def __init__(
        self,
        name: str,
        train: Batch,
        test: Batch,
        models: Mapping[str, Callable[[], nn.Module]],
        info: dict[str, Any],
    ) -> None:
        super().__init__(models, info)
        self.name = name
        self.train_x, self.train_y = train
        self.eval_x, self.eval_y = test
        self._order: tuple[tuple[int, int], Tensor] | None = None
        self.info.update(train_samples=len(self.train_x), eval_samples=len(self.eval_x))

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.train_x) // batch_size)

    def batch(self, step: int, batch_size: int, seed: int) -> Batch:
        if batch_size > len(self.train_x):
            raise ValueError(f"batch size {batch_size} is larger than the {len(self.train_x)} training samples")
        per_epoch = self.steps_per_epoch(batch_size)
        epoch, index = divmod(step, per_epoch)
        if self._order is None or self._order[0] != (seed, epoch):
            self._order = ((seed, epoch), torch.randperm(len(self.train_x), generator=generator(seed, epoch)))
        chosen = self._order[1][index * batch_size : (index + 1) * batch_size]
        return self.train_x[chosen], self.train_y[chosen]

    def eval_set(self) -> Batch:
        return self.eval_x, self.eval_y


def generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by several integers (a run's seed and a step or epoch).

    Mixed through a hash into 32 bits: torch's CPU generator (mt19937) keeps only the low 32 bits of
    its seed, so ``seed * 2**32 + step`` would give every seed the same stream.
    """
    digest = hashlib.blake2b(",".join(map(str, keys)).encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def count_classes(*labels: Tensor) -> int:
    return int(max(int(y.max()) for y in labels if len(y))) + 1


def split(x: Tensor, y: Tensor, held_out: int, seed: int) -> tuple[Batch, Batch]:
    """A seeded random split: ``held_out`` samples for evaluation, the rest for training."""
    if not 0 < held_out < len(x):
        raise ValueError(f"cannot hold out {held_out} of {len(x)} samples for evaluation")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = order[:held_out], order[held_out:]
    return (x[train], y[train]), (x[test], y[test])


def mlp_hidden(text: str) -> list[int]:
    """``"256-256"`` -> [256, 256] (an option of the tasks that offer an MLP)."""
    try:
        widths = [int(part) for part in text.split("-") if part]
    except ValueError:
        raise ValueError(f"hidden must be widths joined by '-', like 256-256; got {text!r}") from None
    if not widths or min(widths) < 1:
        raise ValueError(f"hidden must be positive widths joined by '-', like 256-256; got {text!r}")
    return widths


# -- task options: "name:key=value,..." ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A task family: its options, the model names it offers (the default first), and its builder."""

    name: str
    options: type[Any]
    models: tuple[str, ...]
    build: Callable[[Any, str | None], Task]
    """``build(options, data_path)``"""
    data: Literal["none", "optional", "required"] = "none"
    summary: str = ""

    def parse_options(self, options: Mapping[str, Any]) -> Any:
        return options_from(self.options, options, f"task {self.name!r}")


def batches(x: Tensor, y: Tensor, size: int) -> Iterator[Batch]:
    for start in range(0, len(x), size):
        yield x[start : start + size], y[start : start + size]
