"""Hook specs: which compressor, and how the engine moves its payloads, parsed once.

A hook spec is a compressor spec plus the engine's options, written the same way everywhere (Python,
the command line, sweep configs)::

    "topk:ratio=0.01,ef=true"                      # a compressor spec (gradcomp compressors lists them)
    "topk:ratio=0.01,ef=true,algo=ring,aggregation=two_phase,seed=3"
    ("topk", {"ratio": 0.01, "ef": True, "algo": "ring"})
    "allreduce"                                    # the uncompressed gradient, as DDP's default
    "noop"                                         # no communication: the compute floor of benchmarks

:meth:`HookSpec.parse` checks everything without a process group, so a bad spec fails before any
rank starts. ``str()`` of a :class:`HookSpec` is its canonical text (see :meth:`HookSpec.__str__`):
run names, TensorBoard's HParams and the ranks' agreement check at the first step all use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gradcomp.collectives import FLAT_ALGORITHMS
from gradcomp.compressors import REGISTRY, Aggregation, Spec, parse_spec
from gradcomp.compressors.registry import SpecLike
from gradcomp.options import convert, split_spec

ALGORITHMS = ("native", *FLAT_ALGORITHMS)
"""All-reduce algorithms for ``sum`` payloads (hierarchical needs a local size: not offered here)."""
AGGREGATIONS = ("auto", "gather", "two_phase")
"""How ``gather`` payloads travel: all-gathered, two-phase, or ``auto`` (the engine decides by world size)."""
ALLREDUCE, NOOP = "allreduce", "noop"
"""Hook names beside the compressors: the uncompressed gradient (compressor ``none``), and nothing at all."""
ENGINE_OPTIONS = ("algo", "aggregation", "seed")


@dataclasses.dataclass(frozen=True)
class HookSpec:
    """A parsed hook spec: what travels (``compressor``) and how (the engine's options)."""

    compressor: Spec | None
    """The compressor spec of every tensor; None for ``noop`` (nothing is averaged)."""
    algo: str = "native"
    """All-reduce algorithm for ``sum`` payloads: native (the backend's), ring, tree or halving_doubling."""
    aggregation: str = "auto"
    """For ``gather`` compressors: ``gather`` (every payload all-gathered: p - 1 compressed tensors
    received per rank), ``two_phase`` (compressed reduce-scatter then all-gather: about 2 (p - 1) / p,
    at the price of a second compression error) or ``auto`` (two-phase from 8 ranks on)."""
    seed: int = 0
    """Seed of the compressor's generators; the same on every rank."""

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {self.algo!r}; valid: {', '.join(ALGORITHMS)}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; valid: {', '.join(AGGREGATIONS)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        name = self.compressor.name if self.compressor else NOOP
        if self.aggregation == "two_phase" and self.compressor and REGISTRY[name].aggregation is Aggregation.SUM:
            raise ValueError(f"two_phase is for gather compressors; {name} sums its payloads (all-reduce)")

    @classmethod
    def parse(cls, spec: HookSpecLike, **defaults: Any) -> HookSpec:
        """Parse a hook spec; ``defaults`` (``algo``, ``aggregation``, ``seed``) apply where the spec's
        text does not set them (a :class:`HookSpec` sets them all: it comes back as it is). Raises
        ValueError naming what is wrong and the valid choices."""
        if isinstance(spec, HookSpec):
            return spec
        unknown = sorted(set(defaults) - set(ENGINE_OPTIONS))
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid: {', '.join(ENGINE_OPTIONS)}")
        name, options = split_hook_spec(spec)
        engine = {**defaults, **{key: options.pop(key) for key in ENGINE_OPTIONS if key in options}}
        if "seed" in engine:
            try:
                engine["seed"] = convert("seed", engine["seed"], int)
            except ValueError:
                raise ValueError(f"seed must be an integer, got {engine['seed']!r}") from None
        if name == NOOP:
            if options:
                raise ValueError(f"noop takes no options, got {sorted(options)}")
            return cls(None, **engine)
        if name not in REGISTRY and name != ALLREDUCE:
            valid = ", ".join([ALLREDUCE, NOOP, *sorted(REGISTRY)])
            raise ValueError(f"unknown compressor {name!r}; valid hook names: {valid}")
        return cls(parse_spec(("none" if name == ALLREDUCE else name, options)), **engine)

    @property
    def noop(self) -> bool:
        return self.compressor is None

    def __str__(self) -> str:
        """The canonical text: the compressor spec with every option of its config (``allreduce`` for
        ``none``), then ``ef=true`` if on, then each engine option that differs from its default.
        It parses back to an equal spec."""
        if self.compressor is None:
            text = NOOP
        else:
            text = str(self.compressor)
            if self.compressor.name == "none":
                text = ALLREDUCE + text[len("none") :]
        engine = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if f.name in ENGINE_OPTIONS and getattr(self, f.name) != f.default
        ]
        if not engine:
            return text
        return f"{text}{',' if ':' in text else ':'}{','.join(engine)}"


HookSpecLike = str | tuple[str, Mapping[str, Any]] | Spec | HookSpec
"""Anything :meth:`HookSpec.parse` takes."""


def split_hook_spec(spec: str | tuple[str, Mapping[str, Any]] | SpecLike) -> tuple[str, dict[str, Any]]:
    """A hook spec's name and options (text, a ``(name, options)`` pair or a compressor :class:`Spec`)."""
    if isinstance(spec, str):
        return split_spec(spec)
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        return spec[0].strip(), dict(spec[1])
    if isinstance(spec, Spec):
        return spec.name, {**dataclasses.asdict(spec.config), "ef": spec.ef}
    raise TypeError(f"a hook spec is a string or a (name, options) pair, got {spec!r}")
