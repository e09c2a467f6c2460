"""Names to compressors, and the spec strings that configure them.

A spec names a compressor and its options, the same way in Python, on the command line and in
sweep configs::

    "topk:ratio=0.01,method=sampled"
    ("topk", {"ratio": 0.01})
    "quantize:bits=2,ef=true"        # ef wraps the compressor in error feedback
    "topk:ratio=0.01,ef=true,momentum=0.9,clip=5"   # and what DGC adds to it (feedback.Feedback)

Options are the fields of the compressor's config dataclass; string values are converted by the
field's type (:mod:`gradcomp.options`). Unknown names and options raise an error that lists the
valid ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from gradcomp.compressors.base import Capabilities, Compressor, CompressorConfig, spec_text
from gradcomp.compressors.feedback import FEEDBACK_OPTIONS, ErrorFeedback, Feedback
from gradcomp.options import options_from, split_spec, unknown

REGISTRY: dict[str, type[Compressor]] = {}
"""Every registered compressor, by name."""

NO_FEEDBACK = Feedback()
WRAPPER_OPTIONS = FEEDBACK_OPTIONS
"""Options every spec accepts besides the compressor's own: ``ef`` turns on error feedback, and
``momentum``, ``nesterov``, ``mask`` and ``clip`` configure it (:class:`Feedback`)."""

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
    feedback: Feedback = NO_FEEDBACK

    @property
    def ef(self) -> bool:
        """Whether the compressor is wrapped in error feedback (either variant)."""
        return self.feedback.variant is not None

    @property
    def capabilities(self) -> Capabilities:
        """What the compressor this spec builds declares, error feedback's changes included: the
        same record as the built compressor's ``capabilities``, for code that holds only the spec
        (the engine's checks, the cost model), without building one."""
        return self.feedback.applied_to(REGISTRY[self.name].declare(self.config))

    def __str__(self) -> str:
        return spec_text(self.name, self.config, self.feedback.words())


SpecLike = str | tuple[str, Mapping[str, Any]] | Spec


def parse_spec(spec: SpecLike, *, names: Sequence[str] = (), options: Sequence[str] = ()) -> Spec:
    """Parse ``"name:key=value,..."``, ``(name, {key: value})`` or a :class:`Spec` into a :class:`Spec`.

    An unknown name or option is a one-line ValueError with the closest valid one ("did you mean") and
    every valid one; ``names`` and ``options`` are what the caller takes besides a compressor's (a hook
    spec's ``allreduce`` and the engine's ``algo``, ...), listed with them."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, str):
        name, given = split_spec(spec)
    elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        name, given = spec[0].strip(), dict(spec[1])
    else:
        raise TypeError(f"a compressor spec is a string or a (name, options) pair, got {spec!r}")
    if name not in REGISTRY:
        raise ValueError(unknown("compressor", name, [*names, *sorted(REGISTRY)]))
    try:
        feedback = Feedback.parse({key: given.pop(key) for key in WRAPPER_OPTIONS if key in given})
    except ValueError as error:
        raise ValueError(f"invalid options for {name!r}: {error}") from None
    also = list(dict.fromkeys([*WRAPPER_OPTIONS, *options]))
    config = options_from(REGISTRY[name].Config, given, repr(name), also_valid=also)
    problem = REGISTRY[name].declare(config).feedback_problem if feedback.variant else None
    if problem:
        raise ValueError(f"{name!r} with {feedback.words()[0]}: {problem}")
    return Spec(name, config, feedback)


def make_compressor(spec: SpecLike, *, seed: int = 0, rank: int = 0) -> Compressor:
    """Build the compressor a spec describes, wrapped in error feedback when it says ``ef=true``."""
    parsed = parse_spec(spec)
    compressor = REGISTRY[parsed.name](parsed.config, seed=seed, rank=rank)
    if parsed.ef:
        return ErrorFeedback(compressor, parsed.feedback)
    return compressor
