"""Names to compressors, and the spec strings that configure them.

A spec names a compressor and its options, the same way in Python, on the command line and in
sweep configs::

    "topk:ratio=0.01,method=sampled"
    ("topk", {"ratio": 0.01})
    "quantize:bits=2,ef=true"        # ef wraps the compressor in error feedback

Options are the fields of the compressor's config dataclass; string values are converted by the
field's type (:mod:`gradcomp.options`). Unknown names and options raise an error that lists the
valid ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from gradcomp.compressors.base import Compressor, CompressorConfig, spec_text
from gradcomp.compressors.feedback import ErrorFeedback
from gradcomp.options import convert, options_from, split_spec

REGISTRY: dict[str, type[Compressor]] = {}
"""Every registered compressor, by name."""

WRAPPER_OPTIONS = ("ef",)
"""Options every spec accepts besides the compressor's own: ``ef`` turns on error feedback."""

C = TypeVar("C", bound=type[Compressor])


def register(cls: C) -> C:
    """Class decorator: make a compressor available by its ``name``."""
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} is already registered by {REGISTRY[cls.name].__name__}")
    REGISTRY[cls.name] = cls
    return cls


@dataclasses.dataclass(frozen=True)
class Spec:
    """A parsed spec: a compressor name, its validated config and the wrapper options."""

    name: str
    config: CompressorConfig
    ef: bool = False

    def __str__(self) -> str:
        return spec_text(self.name, self.config, ["ef=true"] if self.ef else [])


SpecLike = str | tuple[str, Mapping[str, Any]] | Spec


def parse_spec(spec: SpecLike) -> Spec:
    """Parse ``"name:key=value,..."``, ``(name, {key: value})`` or a :class:`Spec` into a :class:`Spec`."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, str):
        name, options = split_spec(spec)
    elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        name, options = spec[0].strip(), dict(spec[1])
    else:
        raise TypeError(f"a compressor spec is a string or a (name, options) pair, got {spec!r}")
    if name not in REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(sorted(REGISTRY))}")
    ef = convert("ef", options.pop("ef", False), bool)
    config = options_from(REGISTRY[name].Config, options, repr(name), also_valid=WRAPPER_OPTIONS)
    problem = REGISTRY[name].feedback_problem(config) if ef else None
    if problem:
        raise ValueError(f"{name!r} with ef=true: {problem}")
    return Spec(name, config, ef)


def make_compressor(spec: SpecLike, *, seed: int = 0, rank: int = 0) -> Compressor:
    """Build the compressor a spec describes, wrapped in error feedback when it says ``ef=true``."""
    parsed = parse_spec(spec)
    compressor = REGISTRY[parsed.name](parsed.config, seed=seed, rank=rank)
    if parsed.ef:
        return ErrorFeedback(compressor)
    return compressor
