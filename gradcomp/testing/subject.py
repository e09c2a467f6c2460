"""The compressor a conformance check builds: from a spec or a class, per seed and rank, with and
without error feedback."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Capabilities, Compressor, CompressorConfig, Key, Payload, spec_text
from gradcomp.compressors.feedback import ErrorFeedback
from gradcomp.compressors.registry import REGISTRY, SpecLike, make_compressor, parse_spec


class Skip(Exception):
    """A property that does not apply to this compressor (the reason is the message)."""


class Subject:
    """What is checked: ``compressor`` is a spec (``"mysign:ef=true"``, a registered name) or a
    :class:`~gradcomp.compressors.base.Compressor` subclass (built with its default config)."""

    def __init__(self, compressor: SpecLike | type[Compressor]) -> None:
        if isinstance(compressor, type):
            if not issubclass(compressor, Compressor):
                raise TypeError(f"check_compressor takes a spec or a Compressor subclass, got {compressor.__name__}")
            self.cls: type[Compressor] = compressor
            self.config: CompressorConfig = compressor.Config()
            self.spec: SpecLike | None = None
            self.label = f"{compressor.__module__}.{compressor.__qualname__}"
        else:
            parsed = parse_spec(compressor)
            self.cls, self.config, self.spec = REGISTRY[parsed.name], parsed.config, parsed
            self.label = str(parsed)

    def make(self, seed: int = 0, rank: int = 0) -> Compressor:
        """The compressor checked, as rank ``rank`` of a run seeded ``seed`` builds it."""
        if self.spec is not None:
            return make_compressor(self.spec, seed=seed, rank=rank)
        return self.cls(self.config, seed=seed, rank=rank)

    def plain(self, seed: int = 0, rank: int = 0) -> Compressor:
        """The compressor without any error feedback the spec adds."""
        return self.cls(self.config, seed=seed, rank=rank)

    @property
    def declared(self) -> Capabilities:
        """What the class declares with the config checked (without any error feedback)."""
        return self.cls.declare(self.config)

    @property
    def feedback_problem(self) -> str | None:
        """Why error feedback cannot wrap this compressor (None: it can)."""
        return self.declared.feedback_problem

    def with_feedback(self, seed: int = 0, rank: int = 0) -> ErrorFeedback:
        """The compressor inside classic error feedback (``ef=true``); :class:`Skip` where it cannot be."""
        if self.feedback_problem:
            raise Skip(f"error feedback does not wrap it: {self.feedback_problem}")
        return ErrorFeedback(self.plain(seed, rank))

    @property
    def spec_text(self) -> str:
        """The compressor's spec without error feedback: ``name:key=value,...``."""
        return spec_text(self.cls.name, self.config)


def rounds(compressor: Compressor, tensor: Tensor, key: Key = None) -> tuple[list[Payload], Any]:
    """Every round's payload of one rank alone (a world of one: each round's sum is its own
    payload), and the last context."""
    payload, ctx = compressor.compress(tensor, key)
    payloads = [payload]
    for _ in range(1, compressor.capabilities.rounds):
        payload, ctx = compressor.next_round(tuple(t.clone() for t in payload), ctx)
        payloads.append(payload)
    return payloads, ctx


def gaussian(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Tensor:
    """A gradient-like tensor: normal values whose magnitude grows along the tensor (so chunks and
    top elements differ), from its own generator."""
    n = 1
    for size in shape:
        n *= size
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (values * torch.linspace(0.1, 3.0, n, dtype=torch.float64)).view(shape).to(dtype)
