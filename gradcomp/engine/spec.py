"""Hook specs: which compressor, and how the engine moves its payloads, parsed once.

A hook spec is a compressor spec plus the engine's options, written the same way everywhere (Python,
the command line, sweep configs)::

    "topk:ratio=0.01,ef=true"                      # a compressor spec (gradcomp compressors lists them)
    "topk:ratio=0.01,ef=true,algo=ring,aggregation=two_phase,seed=3"
    "topk:ratio=0.001,ef=true,momentum=0.9,warmup=500"   # DGC: momentum correction, ratio warm-up
    ("topk", {"ratio": 0.01, "ef": True, "algo": "ring"})
    "allreduce"                                    # the uncompressed gradient, as DDP's default
    "noop"                                         # no communication: the compute floor of benchmarks

:meth:`HookSpec.parse` checks everything without a process group, so a bad spec fails before any
rank starts. ``str()`` of a :class:`HookSpec` is its canonical text (see :meth:`HookSpec.__str__`):
run names, TensorBoard's HParams and the ranks' agreement check at the first step all use it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

from gradcomp.collectives import FLAT_ALGORITHMS
from gradcomp.compressors import REGISTRY, Spec, parse_spec
from gradcomp.compressors.registry import SpecLike
from gradcomp.engine import rules
from gradcomp.options import convert, did_you_mean, split_spec, unknown

ALGORITHMS = ("native", *FLAT_ALGORITHMS)
"""All-reduce algorithms for ``sum`` payloads (across nodes, with ``local_size``: the same)."""
AGGREGATIONS = ("auto", "gather", "two_phase")
"""How ``gather`` payloads travel: all-gathered, two-phase, or ``auto`` (the engine decides by world size)."""
ALLREDUCE, NOOP = "allreduce", "noop"
"""Hook names beside the compressors: the uncompressed gradient (compressor ``none``), and nothing at all."""
ENGINE_OPTIONS = ("algo", "aggregation", "seed", "warmup", "min_numel", "vectors", "pieces", "local_size")
VECTORS = ("compressed", "dense")
"""What the engine does with 1-D tensors (biases, norms' scales): compress them as any other, or
send them uncompressed (:attr:`HookSpec.vectors`)."""
TWO_PHASE_FROM = 8
"""``aggregation="auto"`` all-gathers below this many ranks: there all-gather sends at most
(p - 1) = 7 compressed tensors per rank against two-phase's 2 (p - 1) / p ~ 2, and skips the second
compression error; from 8 ranks on, bytes dominate."""


OTHER_KINDS: dict[str, str] = {}
"""Spec names of other kinds that a hook spec is not, each with where it goes (a user's likely mix-up):
added by the modules that own them when imported (:func:`add_other_kind`), the engine naming none.
With only the engine imported, such a name is refused as any unknown compressor is."""
HOOK_NAMES: dict[str, str] = {}
"""What a DDP hook takes besides the engine's specs (``auto``, ``torch:fp16``, ...), each with what it
is: registered with :func:`add_other_kind` by the modules that own them, and listed wherever a hook
spec's valid names are (an unknown name's message, ``gradcomp compressors``)."""
SHARDED_NAMES: dict[str, str] = {}
"""The same for sharded (FSDP2) runs (FSDP2's own ``torch:reduce_scatter``, ...): :func:`add_hook_names`."""


def add_hook_names(names: Mapping[str, str], *, sharded: bool = False) -> None:
    """Names a DDP hook (or, ``sharded``, an FSDP2 run) takes besides the engine's specs, each with a few
    words on what it is, from the module that owns them, to be listed with the valid names."""
    (SHARDED_NAMES if sharded else HOOK_NAMES).update(names)


def add_other_kind(name: str, message: str, hook_names: Mapping[str, str] | None = None) -> None:
    """Refuse ``name`` (a spec's name before any ``:``) as a hook spec with ``message``, which says where
    such a spec goes, before its options are read as the engine's. For the modules that own a kind of
    spec beside the engine's (:mod:`gradcomp.sync` its ``localsgd`` and ``diloco``, the layers above
    the core theirs), which call it for themselves when imported. ``hook_names``: the spellings of a
    kind that a DDP hook takes (``gradcomp.hooks.parse``), each with a few words on what it is."""
    if name in REGISTRY or name in (ALLREDUCE, NOOP):
        raise ValueError(f"{name!r} is a hook spec's name already; another kind of spec needs another name")
    OTHER_KINDS[name] = message
    add_hook_names(hook_names or {})


KINDS_GROUP = "gradcomp.specs"
"""The entry-point group of the modules that add kinds of spec when imported (:func:`add_other_kind`):
an installed layer above the core declares its module there, for a process that never imported it
(``gradcomp compressors``) to list its names."""


def load_other_kinds() -> None:
    """Import the modules of :data:`KINDS_GROUP`, so that the kinds they add are known here; one that
    cannot be imported (an extra not installed) is left out with a warning."""
    for entry in entry_points(group=KINDS_GROUP):
        try:
            entry.load()
        except ImportError as error:
            logging.getLogger(__name__).warning("gradcomp: the specs of %r unavailable: %s", entry.name, error)


def hook_names() -> dict[str, str]:
    """What a hook spec may be besides a compressor spec, each with a few words on what it is."""
    return {
        ALLREDUCE: "the gradient itself, all-reduced: bitwise DDP's default",
        NOOP: "no communication at all: the compute floor, for benchmarks",
        **HOOK_NAMES,
    }


def option_lines() -> list[str]:
    """The engine's options as ``gradcomp compressors`` lists them: ``algo=native (native | ring | ...)``."""
    choices = {"algo": ALGORITHMS, "aggregation": AGGREGATIONS, "vectors": VECTORS}
    return [
        f"{f.name}={f.default} ({' | '.join(choices.get(f.name, ('int',)))})"
        for f in dataclasses.fields(HookSpec)
        if f.name in ENGINE_OPTIONS
    ]


def valid_names() -> list[str]:
    """Every name a hook spec may start with: ``allreduce``, ``noop``, what the layers above add
    (:data:`HOOK_NAMES`: ``auto``, ``torch:fp16``, ...) and every compressor."""
    return [ALLREDUCE, NOOP, *HOOK_NAMES, *sorted(REGISTRY)]


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
    warmup: int = 0
    """Steps before the compressor takes over: uncompressed (the all-reduce hook's sum, bitwise), or
    for the ratio-based sparsifiers (topk, randomk) an exponential ratio schedule from 1 down to
    theirs, ``ratio ** ((t + 1) / (warmup + 1))`` at step t (DGC's; :func:`warmup_ratio`), with the
    steps whose ratio would cost the uncompressed gradient's bytes sent uncompressed (topk: from 0.5)."""
    min_numel: int = 0
    """Tensors with fewer elements travel uncompressed (their share of an all-reduce, as in a warm-up
    step), whatever the compressor: small tensors cost little to send and much to compress (a
    payload's fixed overhead, a kernel's launch), and error there is error in every weight they scale."""
    vectors: str = "compressed"
    """``dense``: 1-D tensors (biases, normalization scales) travel uncompressed too, as PowerSGD's
    vectors and most production setups leave them; ``compressed``: as any other tensor."""
    local_size: int = 0
    """Ranks per node (torchrun's ``LOCAL_WORLD_SIZE``): with L > 1 a bucket is reduce-scattered
    uncompressed inside each node, each local rank's shard compressed across nodes, and all-gathered
    inside the node (:mod:`gradcomp.engine.hierarchical`); 0: one flat group (as 1)."""
    pieces: int = 1
    """The step's last bucket travels in up to this many parts, each compressed while the one before
    it is on the wire (:mod:`gradcomp.engine.pieces`), with tensors of at least ``pieces`` x 256K
    elements compressed as pieces of their rows in every bucket. For compressors local to elements or
    chunks (casts, quantizers, sign, fp8), whose pieces compress as the whole tensor does; 1: whole."""

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(unknown("all-reduce algorithm", self.algo, ALGORITHMS))
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(unknown("aggregation", self.aggregation, AGGREGATIONS))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for option in ("warmup", "min_numel"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{option} must be an integer >= 0, got {value!r}")
        if isinstance(self.local_size, bool) or not isinstance(self.local_size, int) or self.local_size < 0:
            raise ValueError(f"local_size must be a whole number of ranks per node (0: flat), got {self.local_size!r}")
        if isinstance(self.pieces, bool) or not isinstance(self.pieces, int) or self.pieces < 1:
            raise ValueError(f"pieces must be an integer >= 1, got {self.pieces!r}")
        if self.vectors not in VECTORS:
            close = did_you_mean(self.vectors, VECTORS)
            raise ValueError(f"vectors must be one of {', '.join(VECTORS)}, got {self.vectors!r}{close}")
        rules.check(self)  # how the options combine: the one table (gradcomp.engine.rules)

    @classmethod
    def parse(cls, spec: HookSpecLike, **defaults: Any) -> HookSpec:
        """Parse a gradcomp hook spec; ``defaults`` (``algo``, ``aggregation``, ``seed``) apply where the spec's
        text does not set them (a :class:`HookSpec` sets them all: it comes back as it is). Raises
        ValueError naming what is wrong, the closest valid choice and all of them, in one line.

        The engine's own specs only: ``auto`` and torch's hooks (``torch:fp16``) are the DDP hooks'
        (refused here, saying so); :func:`gradcomp.hooks.parse` checks any spec a DDP hook takes."""
        return cls.parse_among(spec, defaults)

    @classmethod
    def parse_among(
        cls,
        spec: HookSpecLike,
        defaults: Mapping[str, Any],
        names: Sequence[str] | None = None,
        more_options: Sequence[str] = (),
    ) -> HookSpec:
        """:meth:`parse`, for a caller that takes other names or more options than a DDP hook (a sharded
        run): an unknown name's message lists ``names`` (default :func:`valid_names`), an unknown
        option's ``more_options`` (taken out of the spec by the caller first) with the others."""
        if isinstance(spec, HookSpec):
            return spec
        wrong = sorted(set(defaults) - set(ENGINE_OPTIONS))
        if wrong:
            raise TypeError(f"unknown engine option(s) {wrong}; valid: {', '.join(ENGINE_OPTIONS)}")
        if isinstance(spec, str):
            _check_name(spec.partition(":")[0].strip(), names)  # before its options are read as ours
        name, options = split_hook_spec(spec)
        engine = {**defaults, **{key: options.pop(key) for key in ENGINE_OPTIONS if key in options}}
        for key in ("seed", "warmup", "min_numel", "pieces", "local_size"):
            if key in engine:
                try:
                    engine[key] = convert(key, engine[key], int)
                except ValueError:
                    raise ValueError(f"{key} must be an integer, got {engine[key]!r}") from None
        if name == NOOP:
            if options:
                raise ValueError(f"noop takes no options, got {sorted(options)}")
            return cls(None, **engine)
        _check_name(name, names)
        compressor = parse_spec(
            ("none" if name == ALLREDUCE else name, options), options=[*ENGINE_OPTIONS, *more_options]
        )
        return cls(compressor, **engine)

    @property
    def noop(self) -> bool:
        return self.compressor is None

    @property
    def keeps_some_dense(self) -> bool:
        """Whether the spec sends some tensors uncompressed (``min_numel``, ``vectors=dense``)."""
        return self.min_numel > 0 or self.vectors == "dense"

    def uncompressed(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` travels uncompressed under the spec's per-tensor policy."""
        return math.prod(shape) < self.min_numel or (self.vectors == "dense" and len(shape) <= 1)

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


def _check_name(name: str, names: Sequence[str] | None = None) -> None:
    """Refuse a name that is no hook's: with where it goes for a spec of another kind
    (:data:`OTHER_KINDS`), else with the closest valid name and all of them (``names``, or a DDP hook's)."""
    if name not in REGISTRY and name not in (ALLREDUCE, NOOP):
        raise ValueError(OTHER_KINDS.get(name) or unknown("compressor", name, names or valid_names()))


def split_hook_spec(spec: str | tuple[str, Mapping[str, Any]] | SpecLike) -> tuple[str, dict[str, Any]]:
    """A hook spec's name and options (text, a ``(name, options)`` pair or a compressor :class:`Spec`)."""
    if isinstance(spec, str):
        return split_spec(spec)
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        return spec[0].strip(), dict(spec[1])
    if isinstance(spec, Spec):
        return spec.name, {**dataclasses.asdict(spec.config), **spec.feedback.options()}
    raise TypeError(f"a hook spec is a string or a (name, options) pair, got {spec!r}")


def warmup_ratio(ratio: float, warmup: int, step: int) -> float:
    """The keep-ratio of a ratio-based sparsifier at ``step`` (from 0) under a warm-up of ``warmup``
    steps: ``ratio ** ((step + 1) / (warmup + 1))`` during it, falling exponentially from near 1
    (DGC's schedule, per step rather than per epoch: with 4 steps and ratio 0.001, 25%, 6.3%, 1.6%
    and 0.4%), then ``ratio``."""
    if step >= warmup:
        return ratio
    return float(ratio ** ((step + 1) / (warmup + 1)))
