"""Sync specs: how often replicas synchronize and how the outer step treats what they send.

A sync spec is written like every other spec (Python, the command line, sweep configs)::

    "localsgd:every=8"                              # average the replicas every 8 steps
    "localsgd:every=8,state=true"                   # ... and the inner optimizer's state too
    "diloco:every=50"                               # DiLoCo: outer Nesterov SGD, lr 0.7, momentum 0.9
    "diloco:every=50,fragments=4,delay=2"           # Streaming DiLoCo: 4 fragments, each landing 2 steps late
    "diloco:every=50,fragments=4,delay=2,early=true"  # ... each starting 2 steps early, landing on time (torchft's)
    "diloco:every=50,outer_lr=0.5,momentum=0.8,nesterov=false,mix=0.3"

What travels, and how (a compressor, error feedback, the all-reduce algorithm), is a separate hook spec
(``gradcomp.engine.HookSpec``), given beside it. :meth:`SyncSpec.parse` checks everything without a
process group; ``str()`` is the canonical text, which parses back to an equal spec.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from gradcomp.engine.spec import add_other_kind, split_hook_spec
from gradcomp.options import convert, format_value

KINDS = ("localsgd", "diloco")
"""``localsgd``: the replicas' average (outer SGD, lr 1, no momentum); ``diloco``: DiLoCo's outer
Nesterov step on the averaged outer gradient."""
DEFAULTS: dict[str, dict[str, Any]] = {
    "localsgd": {"every": 8, "outer_lr": 1.0, "momentum": 0.0, "nesterov": False},
    "diloco": {"every": 50, "outer_lr": 0.7, "momentum": 0.9, "nesterov": True},
}
"""Each kind's defaults: DiLoCo's are the paper's (Douillard et al., 2023)."""
OUTER_OPTIONS = ("outer_lr", "momentum", "nesterov")
"""DiLoCo's outer optimizer; local SGD averages, so it takes none of them."""
DELAYED_MIX = 0.5
"""The mixing factor of a delayed synchronization unless ``mix`` is given (Streaming DiLoCo's)."""

add_other_kind("localsgd", "localsgd is a sync spec, not a hook spec: gradcomp.sync.LocalSGD, or a run's --sync")
add_other_kind("diloco", "diloco is a sync spec, not a hook spec: gradcomp.sync.DiLoCo, or a run's --sync")


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """A parsed sync spec. Each rank trains its replica alone for ``every`` steps; then each fragment
    of the parameters sends its outer gradient (the last synchronized parameters minus the local
    ones), averaged over the group, to an outer SGD step that every replica adopts."""

    kind: str
    """``localsgd`` or ``diloco`` (:data:`KINDS`)."""
    every: int
    """Inner steps between two synchronizations of a fragment (DiLoCo's H)."""
    outer_lr: float
    """The outer SGD's learning rate (1 with no momentum: the outer step lands on the replicas' average)."""
    momentum: float
    """The outer SGD's momentum."""
    nesterov: bool
    """Nesterov momentum in the outer SGD (needs momentum > 0)."""
    fragments: int = 1
    """Parts of the parameters (contiguous, about equal in size) synchronized at staggered steps, an
    ``every / fragments`` apart (Streaming DiLoCo): the same bytes, spread over time, and a peak
    ``fragments`` times lower."""
    delay: int = 0
    """Inner steps a synchronization runs in the background before it is applied (Streaming DiLoCo's
    tau); 0 waits for it at once."""
    early: bool = False
    """Start each synchronization ``delay`` steps before its step in the schedule, so that it lands on
    that step (torchft's DiLoCo's schedule: prepare early, sync on time); default: start on it and land
    ``delay`` steps later (the Streaming DiLoCo paper's). Needs ``delay`` below ``every / fragments``
    (the first fragment's step)."""
    mix: float | None = None
    """How much of its own parameters a replica keeps when a synchronization lands (Streaming DiLoCo's
    alpha): 0 adopts the outer step's result, 1 ignores it. Default: 0.5 with a delay (the replica has
    trained on meanwhile), else 0."""
    state: bool = False
    """Also average the inner optimizer's state (momentum, Adam's moments) at each synchronization."""
    local_size: int = 0
    """Ranks per node that train one replica together, DDP averaging their gradients every step inside
    the node, the synchronization running across nodes (for the training runner: ``docs/local-sgd.md``);
    0: every rank its own replica."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown synchronization {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.every < 1:
            raise ValueError(f"every must be >= 1 step, got {self.every}")
        if not 1 <= self.fragments <= self.every:
            raise ValueError(
                f"fragments must be 1..every ({self.every}): each fragment synchronizes at a step of its own; "
                f"got {self.fragments}"
            )
        if not 0 <= self.delay < self.every:
            raise ValueError(
                f"delay must be 0..every-1 ({self.every - 1}): a fragment's synchronization lands before its next "
                f"one starts; got {self.delay}"
            )
        if self.early and self.delay >= self.every // self.fragments:
            raise ValueError(
                f"early starts a synchronization delay={self.delay} steps before its step; the first fragment's is "
                f"step {self.every // self.fragments}: use a delay below it"
            )
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0")
        if self.mix is not None and not 0 <= self.mix <= 1:
            raise ValueError(f"mix must be in [0, 1], got {self.mix}")
        if isinstance(self.local_size, bool) or not isinstance(self.local_size, int) or self.local_size < 0:
            raise ValueError(f"local_size must be a whole number of ranks per node (0: flat), got {self.local_size!r}")
        if self.state and self.delay:
            raise ValueError("state=true averages the optimizer's state when a synchronization lands; with a delay "
                             "it would be stale: use delay=0")  # fmt: skip

    @classmethod
    def parse(cls, spec: SyncSpecLike) -> SyncSpec:
        """Parse ``"kind:key=value,..."`` or ``(kind, {key: value})``; the kind's defaults
        (:data:`DEFAULTS`) fill what it does not set. Raises ValueError naming what is wrong and the
        valid choices."""
        if isinstance(spec, SyncSpec):
            return spec
        kind, options = split_hook_spec(spec)
        if kind not in KINDS:
            raise ValueError(f"unknown synchronization {kind!r}; valid: {', '.join(KINDS)}")
        valid = [f.name for f in dataclasses.fields(cls) if f.name != "kind"]
        if kind == "localsgd":
            valid = [name for name in valid if name not in OUTER_OPTIONS]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            hint = " (local SGD averages: outer_lr, momentum and nesterov are diloco's)" if kind == "localsgd" else ""
            raise ValueError(f"unknown option(s) {unknown} for {kind}{hint}; valid options: {', '.join(valid)}")
        hints = typing.get_type_hints(cls)
        values = {key: convert(key, value, hints[key]) for key, value in options.items()}
        return cls(kind, **{**DEFAULTS[kind], **values})

    @property
    def mixing(self) -> float:
        """The mixing factor in force (:attr:`mix`, or its default)."""
        if self.mix is not None:
            return self.mix
        return DELAYED_MIX if self.delay else 0.0

    def __str__(self) -> str:
        """The canonical text: the kind, ``every``, then each option that differs from its default."""
        defaults = {**{f.name: f.default for f in dataclasses.fields(self)}, **DEFAULTS[self.kind]}
        options = [
            f"{f.name}={format_value(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if f.name not in ("kind", "every") and getattr(self, f.name) != defaults[f.name]
        ]
        return f"{self.kind}:" + ",".join([f"every={self.every}", *options])


SyncSpecLike = str | tuple[str, Mapping[str, Any]] | SyncSpec
"""Anything :meth:`SyncSpec.parse` takes."""
