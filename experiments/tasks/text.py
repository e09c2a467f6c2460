"""A character-level language model on text that ships with Python itself: the standard library's source.

The corpus is the concatenated source of a fixed, sorted list of pure-Python standard-library modules
(:data:`MODULES`), read from this interpreter's stdlib directory: the same Python version gives the
same text, byte for byte, and run.json records the version, the modules found and the text's SHA-256.
The first 90% trains, the last 10% evaluates. Or point ``data=PATH`` at a UTF-8 text file of your own.

Metrics: loss (nats per character), perplexity (its exponential) and next-character accuracy,
over fixed non-overlapping windows of the held-out text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from functools import partial

import torch
from torch import Tensor

from gradcomp.experiments.models import CharTransformer
from gradcomp.experiments.tasks.base import Batch, Task, TaskSpec, generator

MODULES = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "inspect.py",
    "pickle.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "typing.py",
)
"""Standard-library files whose source is the corpus (about 1 MB together in Python 3.11)."""


@dataclasses.dataclass(frozen=True)
class Options:
    context: int = 64
    """Characters per training window (the model's context)."""
    chars: int = 1_000_000
    """Use at most this many characters of the corpus."""
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    eval_windows: int = 64
    """Held-out windows evaluated (non-overlapping, from the start of the held-out text)."""

    def __post_init__(self) -> None:
        for name, low, high in (
            ("context", 2, 4096),
            ("chars", 1000, 10**9),
            ("d_model", 8, 8192),
            ("heads", 1, 128),
            ("layers", 1, 64),
            ("eval_windows", 1, 100_000),
        ):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be in {low}..{high}, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads})")


def stdlib_text() -> tuple[str, list[str]]:
    """The corpus and the modules it was made of (those of :data:`MODULES` this Python has)."""
    root = sysconfig.get_paths()["stdlib"]
    parts, found = [], []
    for name in sorted(MODULES):
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as file:
                parts.append(file.read())
            found.append(name)
    if not found:
        raise ValueError(f"none of the corpus modules were found in {root}")
    return "".join(parts), found


class CharLMTask(Task):
    name = "charlm"
    kind = "language_model"
    metric = "perplexity"
    higher_is_better = False

    def __init__(self, text: str, options: Options, info: dict[str, object]) -> None:
        vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(vocab)}
        tokens = torch.tensor([index[c] for c in text], dtype=torch.int64)
        cut = int(len(tokens) * 0.9)
        self.train_tokens, self.eval_tokens = tokens[:cut], tokens[cut:]
        self.context = options.context
        if len(self.eval_tokens) <= self.context or len(self.train_tokens) <= self.context:
            raise ValueError(f"{len(text)} characters are too few for a context of {self.context}")
        self.eval_windows = min(options.eval_windows, (len(self.eval_tokens) - 1) // self.context)
        model = partial(CharTransformer, len(vocab), options.context, options.d_model, options.heads, options.layers)
        info = {
            **info,
            "characters": len(text),
            "vocab_size": len(vocab),
            "train_characters": cut,
            "eval_characters": self.eval_windows * self.context,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
        }
        super().__init__({"chartransformer": model}, info)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.train_tokens) // (batch_size * self.context))

    def batch(self, step: int, batch_size: int, seed: int) -> Batch:
        # Windows start at random places, drawn from a generator of (seed, step) alone.
        starts = torch.randint(
            0, len(self.train_tokens) - self.context, (batch_size, 1), generator=generator(seed, step)
        )
        positions = starts + torch.arange(self.context)
        return self.train_tokens[positions], self.train_tokens[positions + 1]

    def eval_set(self) -> Batch:
        positions = torch.arange(self.eval_windows).unsqueeze(1) * self.context + torch.arange(self.context)
        return self.eval_tokens[positions], self.eval_tokens[positions + 1]

    def eval_metrics(self, sums: Tensor) -> dict[str, float]:
        metrics = super().eval_metrics(sums)
        metrics["perplexity"] = float(torch.tensor(metrics["loss"]).exp())
        return metrics


def build(options: Options, data: str | None) -> CharLMTask:
    if data is None:
        text, modules = stdlib_text()
        info: dict[str, object] = {"source": "python stdlib", "python": platform.python_version(), "modules": modules}
    else:
        with open(data, encoding="utf-8") as file:
            text = file.read()
        info = {"source": os.path.abspath(data)}
    return CharLMTask(text[: options.chars], options, info)


SPEC = TaskSpec(
    "charlm",
    Options,
    ("chartransformer",),
    build,
    data="optional",
    summary="character-level transformer LM on Python's own stdlib source (or your text file)",
)
