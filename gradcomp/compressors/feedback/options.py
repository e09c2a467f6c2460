"""Error feedback's options, as a spec writes them (``ef=true``, ``ef=ef21``, ``momentum``,
``nesterov``, ``mask``, ``clip``), parsed once into a :class:`Feedback`, and what they change in a
compressor's :class:`~gradcomp.compressors.capabilities.Capabilities`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from gradcomp.compressors.capabilities import Capabilities
from gradcomp.options import convert, format_value

Variant = Literal["classic", "ef21"]
FEEDBACK_OPTIONS = ("ef", "momentum", "nesterov", "mask", "clip")
"""Options every compressor spec accepts besides its own (``make_compressor`` wraps it then)."""


@dataclasses.dataclass(frozen=True)
class Feedback:
    """The error-feedback options of a spec: ``ef=true`` (classic) or ``ef=ef21``, and DGC's
    momentum correction, momentum factor masking and local clipping (:mod:`gradcomp.compressors.feedback`)."""

    variant: Variant | None = None
    """None: no error feedback; ``classic`` (``ef=true``) or ``ef21`` (``ef=ef21``)."""
    momentum: float = 0.0
    """Momentum correction's m, in [0, 1); needs ``ef=true``. 0: off."""
    nesterov: bool = False
    """Nesterov's form of the momentum correction; needs ``momentum``."""
    mask: bool = False
    """Momentum factor masking: clear the velocity where a sparsifier sent (topk, randomk, threshold)."""
    clip: float = 0.0
    """Clip each tensor's share g / p to the L2 norm clip / sqrt(p) before it is accumulated; 0: off."""

    def __post_init__(self) -> None:
        if self.variant not in (None, "classic", "ef21"):
            raise ValueError(f"ef must be true, false or ef21, got {self.variant!r}")
        if not (math.isfinite(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.momentum and self.variant != "classic":
            raise ValueError("momentum correction accumulates into error feedback's residual: it needs ef=true")
        if self.nesterov and not self.momentum:
            raise ValueError("nesterov needs momentum")
        if not (math.isfinite(self.clip) and self.clip >= 0.0):
            raise ValueError(f"clip must be a finite number >= 0, got {self.clip}")
        if self.clip and self.variant is None:
            raise ValueError("clip bounds what error feedback accumulates: it needs ef=true or ef=ef21")

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> Feedback:
        """From a spec's options (strings or typed values); ValueError names what is wrong."""
        values = dict(options)
        ef = values.pop("ef", False)
        try:
            variant: Variant | None = "ef21" if ef == "ef21" else ("classic" if convert("ef", ef, bool) else None)
        except ValueError:
            raise ValueError(f"option 'ef' must be true, false or ef21; got {ef!r}") from None
        if "mask" in values and not float(convert("momentum", values.get("momentum", 0.0), float)):
            raise ValueError("mask applies to the momentum correction: it needs momentum")
        hints = {"momentum": float, "nesterov": bool, "mask": bool, "clip": float}
        if str(values.get("momentum", "")).strip().lower() == "true":
            raise ValueError(
                "momentum=true takes a training run's own momentum (on its command line); "
                "everywhere else give the number: momentum=0.9"
            )
        return cls(variant, **{key: convert(key, value, hints[key]) for key, value in values.items()})

    def words(self) -> list[str]:
        """The options as a spec writes them, defaults left out: ``["ef=true", "momentum=0.9"]``."""
        if self.variant is None:
            return []
        words = ["ef=true" if self.variant == "classic" else "ef=ef21"]
        defaults = Feedback(self.variant)
        for name in ("momentum", "nesterov", "mask", "clip"):
            if getattr(self, name) != getattr(defaults, name):
                words.append(f"{name}={format_value(getattr(self, name))}")
        return words

    def options(self) -> dict[str, Any]:
        """The options as a ``(name, options)`` spec pair carries them."""
        return dict(word.split("=", 1) for word in self.words())

    def applied_to(self, inner: Capabilities) -> Capabilities:
        """The record of a compressor declaring ``inner`` inside this error feedback: the same
        payloads, rounds and aggregation; keyed state, so nothing element-wise; biased; local as
        ``inner`` except with clipping, which takes the norm of the whole tensor; a whole part at once
        as ``inner``, in classic error feedback with or without momentum correction
        (:mod:`gradcomp.compressors.feedback.rows`)."""
        if self.variant is None:
            return inner
        by_rows = self.variant == "classic" and not self.clip and inner.rounds == 1  # momentum follows too
        return dataclasses.replace(
            inner,
            elementwise=False,
            local=inner.local and not self.clip,
            unbiased=False,
            whole_part=inner.whole_part and by_rows,
            feedback_problem="it has error feedback already",
        )
