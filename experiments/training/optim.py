"""Optimizers and learning-rate schedules by name, for configs and the command line."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from gradcomp.hooks import CompressedAdamW, CompressedAdamWSpec
from gradcomp.hooks.compressed_adamw_spec import OPTIONS as COMPRESSED_ADAMW_OPTIONS
from gradcomp.hooks.compressed_adamw_spec import is_compressed_adamw_spec

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr, momentum, weight_decay: torch.optim.SGD(
        params, lr=lr, momentum=momentum, weight_decay=weight_decay
    ),
    "nesterov": lambda params, lr, momentum, weight_decay: torch.optim.SGD(
        params, lr=lr, momentum=momentum or 0.9, weight_decay=weight_decay, nesterov=True
    ),
    "adam": lambda params, lr, momentum, weight_decay: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay),
    "adamw": lambda params, lr, momentum, weight_decay: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
}
"""``sgd`` (with ``momentum``, 0 by default), ``nesterov`` (momentum 0.9 unless given), ``adam``, ``adamw``
(``momentum`` unused). Error feedback was measured with plain SGD in ``docs/hooks.md``: with momentum it
did worse on the digits. Besides these, a ``compressed-adamw`` spec (:func:`parse_optimizer`)."""


def parse_optimizer(text: str) -> str:
    """An optimizer's canonical text: a name of :data:`OPTIMIZERS`, or a ``compressed-adamw`` spec
    (:class:`~gradcomp.hooks.CompressedAdamWSpec`: AdamW whose momentum travels compressed).
    ValueError names what is wrong and the valid choices."""
    if is_compressed_adamw_spec(text):
        return str(CompressedAdamWSpec.parse(text))
    if text not in OPTIMIZERS:
        valid = ", ".join([*OPTIMIZERS, f"compressed-adamw:{','.join(f'{o}=...' for o in COMPRESSED_ADAMW_OPTIONS)}"])
        raise ValueError(f"unknown optimizer {text!r}; valid: {valid}")
    return text


def _constant(progress: float) -> float:
    return 1.0


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _linear(progress: float) -> float:
    return 1.0 - progress


SCHEDULES: dict[str, Callable[[float], float]] = {"constant": _constant, "cosine": _cosine, "linear": _linear}
"""The learning-rate factor as a function of progress (0 -> 1) through the steps after warmup."""


def make_optimizer(
    name: str, parameters: Iterable[nn.Parameter], lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (a name of :data:`OPTIMIZERS` or a ``compressed-adamw`` spec) over ``parameters``."""
    if is_compressed_adamw_spec(name):
        return CompressedAdamW.from_spec(parameters, CompressedAdamWSpec.parse(name), lr, weight_decay)
    return OPTIMIZERS[name](parameters, lr, momentum, weight_decay)


def make_schedule(
    optimizer: torch.optim.Optimizer, name: str, total_steps: int, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then the named schedule over the rest of ``total_steps``.
    Its state (the step count) goes into checkpoints; the function itself is rebuilt from the config."""
    shape = SCHEDULES[name]

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        return shape(min(1.0, (step - warmup_steps) / span))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
