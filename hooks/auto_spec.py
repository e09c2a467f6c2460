"""The ``auto`` hook's spec: ``auto`` or ``auto:candidates=a|b|c,recheck=500,...`` (see :mod:`gradcomp.hooks.auto`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradcomp.engine import rules
from gradcomp.engine.spec import ALLREDUCE, HookSpec, add_other_kind
from gradcomp.options import convert, split_nesting_spec

NAME = "auto"
DEFAULT_CANDIDATES = ("fp16", "powersgd:rank=4,ef=true", "topk:ratio=0.01,ef=true", "sign:ef=true")
"""Beside ``allreduce``: the lossless cast and error-feedback-protected compressors."""

add_other_kind(
    NAME,
    "auto is no compressor: it chooses among hooks itself; attach it with "
    "gradcomp.hooks.register(ddp_model, 'auto') (a training run's --hook auto; gradcomp.hooks.parse checks it)",
    {NAME: "measure the link and the candidates, then choose per bucket (auto:candidates=a|b,...)"},
)


@dataclasses.dataclass(frozen=True)
class AutoSpec:
    """A parsed ``auto`` spec."""

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    """Hook specs to choose among (canonical text), besides ``allreduce``."""
    measure_at: int = 4
    """The step at which it measures and decides first (DDP rebuilds its buckets at step 1)."""
    recheck: int = 1000
    """Measure and decide again every this many steps (0: never)."""
    check_every: int = 50
    """Compare the measured step with the prediction every this many steps (0: never)."""
    stray: float = 0.25
    """Measure again when the measured step differs from the prediction by more than this."""
    margin: float = 0.05
    """A choice must be predicted this much faster than the uncompressed gradient to be taken."""
    seed: int = 0
    """Seed of every candidate's generators (the same on every rank)."""

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("auto needs at least one candidate besides allreduce")
        parsed = [HookSpec.parse(candidate) for candidate in self.candidates]
        for spec in parsed:
            rules.check(spec, rules.Surface.AUTO)
        # the nodes are probed once, with one layout, and priced on one cluster of nodes
        sizes = sorted({spec.local_size for spec in parsed if spec.local_size > 1})
        if len(sizes) > 1:
            raise ValueError(f"auto's candidates across nodes take one node size, got local_size {sizes}")
        object.__setattr__(self, "candidates", tuple(str(spec) for spec in parsed))  # frozen: canonical once
        if self.measure_at < 2:
            raise ValueError(f"measure_at must be >= 2 (DDP's buckets are rebuilt at step 1), got {self.measure_at}")
        if self.recheck < 0 or self.check_every < 0:
            raise ValueError(f"recheck and check_every must be >= 0, got {self.recheck} and {self.check_every}")
        if self.stray <= 0 or not 0 <= self.margin < 1:
            raise ValueError(f"need stray > 0 and 0 <= margin < 1, got {self.stray} and {self.margin}")

    @classmethod
    def parse(cls, text: str, **defaults: Any) -> AutoSpec:
        """``auto`` or ``auto:candidates=a|b|c,recheck=500,...``: a candidate's own options (after a
        comma, as in ``topk:ratio=0.01,ef=true``) stay with it; ``auto``'s options start anew.
        ``defaults`` (``seed``, ...) apply where the text does not set them."""
        unknown = sorted(set(defaults) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown auto option(s) {unknown}; valid: {', '.join(OPTIONS)}")
        options = split_nesting_spec(text, NAME, OPTIONS, nesting=("candidates",))
        fields: dict[str, Any] = {}
        for key, value in options.items():
            if key == "candidates":
                fields[key] = tuple(str(HookSpec.parse(c)) for c in value.split("|") if c.strip())
            else:
                fields[key] = convert(key, value, type(getattr(cls, key)))
        return cls(**{**defaults, **fields})

    def __str__(self) -> str:
        """The canonical text: ``auto``, then every option that differs from its default."""
        changed = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "candidates":
                if value != tuple(str(HookSpec.parse(c)) for c in DEFAULT_CANDIDATES):
                    changed.append("candidates=" + "|".join(value))
            elif value != f.default:
                changed.append(f"{f.name}={value}")
        return NAME + (":" + ",".join(changed) if changed else "")

    @property
    def local_size(self) -> int:
        """The ranks per node of the candidates across nodes (``local_size``), 0 without any."""
        return max(HookSpec.parse(candidate).local_size for candidate in self.candidates)

    @property
    def hook_specs(self) -> list[HookSpec]:
        """``allreduce`` then the candidates, each once, with this spec's seed."""
        texts = dict.fromkeys([ALLREDUCE, *self.candidates])
        return [HookSpec.parse(text, seed=self.seed) for text in texts]


OPTIONS = tuple(f.name for f in dataclasses.fields(AutoSpec))


def is_auto_spec(text: object) -> bool:
    """Whether ``text`` is an ``auto`` spec (``auto`` or ``auto:...``)."""
    return isinstance(text, str) and text.strip().partition(":")[0] == NAME
