"""The spec of :class:`~gradcomp.hooks.compressed_adamw.CompressedAdamW`, as training runs and sweeps
write it: ``compressed-adamw`` or ``compressed-adamw:freeze=30,carrier=topk:ratio=0.01,ef=true``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gradcomp.engine import rules
from gradcomp.engine.spec import HookSpec
from gradcomp.options import convert, format_value, split_nesting_spec

NAME = "compressed-adamw"
AUTO = "auto"
"""``freeze=auto``: freeze once Adam's variance has settled."""
SETTLE_EVERY = 10
"""``freeze=auto`` compares AdamW's denominator with its value this many steps before (and reads that
one number on the host, every this many steps of the warm-up only)."""
DEFAULT_CARRIER = "sign:ef=true"


@dataclasses.dataclass(frozen=True)
class CompressedAdamWSpec:
    """A parsed ``compressed-adamw`` spec: the optimizer's options besides AdamW's learning rate and
    weight decay (which a run sets with ``--lr`` and ``--weight-decay``)."""

    freeze: int | str = 100
    """Uncompressed (warm-up) steps: AdamW on the gradient the DDP hook averages; then Adam's
    variance is frozen and the momentum travels through ``carrier``. ``"auto"``: freeze once the
    variance has settled (``settle``), measured every :data:`SETTLE_EVERY` steps."""
    carrier: str = DEFAULT_CARRIER
    """The hook spec the momentum travels by after the freeze (canonical text): any gradcomp spec
    but ``noop``; error feedback (``ef=true``) keeps what a biased compressor leaves out."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    bound: float = 1.0
    """After the freeze, the largest step of a coordinate in units of the learning rate (a coordinate
    whose variance froze at 0 would otherwise step by ``lr * m / eps``)."""
    variance_every: int = 0
    """0: the variance stays frozen after the freeze (1-bit Adam). N > 0: after the freeze each rank
    keeps learning the variance from its own gradients, and every N steps the ranks' variances are
    averaged through ``variance_carrier`` into the one every rank divides by: the variance keeps up
    with training for a share of 1 / N of a step's gradient bytes (a bf16 carrier: half that)."""
    variance_carrier: str = "bf16"
    """The hook spec the variances travel by every ``variance_every`` steps."""
    scaled: bool = False
    """Compress in Adam's units: each exchange (the warm-up's gradient, then the momentum) is divided
    by AdamW's denominator before its compressor and multiplied back after the average, so that the
    compressor's error weighs on every coordinate as it weighs on its update (a chunk's small-gradient
    coordinates, layer norms' and biases', no longer drown in its large ones' rounding)."""
    settle: float = 0.1
    """With ``freeze=auto``: the relative change of AdamW's denominator ``sqrt(v / (1 - b2^t))`` (its
    L1 norm's) over the last :data:`SETTLE_EVERY` steps below which the variance counts as settled
    and freezes."""

    def __post_init__(self) -> None:
        counted = not isinstance(self.freeze, bool) and isinstance(self.freeze, int) and self.freeze >= 1
        if self.freeze != AUTO and not counted:
            raise ValueError(
                f"freeze must be an integer >= 1 (Adam's variance needs uncompressed steps) or 'auto' (when it has "
                f"settled), got {self.freeze!r}"
            )
        if not (math.isfinite(self.settle) and 0 < self.settle < 1):
            raise ValueError(f"settle must be in (0, 1): a relative change of Adam's denominator, got {self.settle}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value < 1.0):
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        for name in ("eps", "bound"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        carrier = HookSpec.parse(self.carrier)
        rules.check(carrier, rules.Surface.CARRIER)
        object.__setattr__(self, "carrier", str(carrier))  # frozen: canonical once
        every = self.variance_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"variance_every must be an integer >= 0, got {every!r}")
        variance = HookSpec.parse(self.variance_carrier)
        rules.check(variance, rules.Surface.CARRIER)
        object.__setattr__(self, "variance_carrier", str(variance))

    @classmethod
    def parse(cls, text: str) -> CompressedAdamWSpec:
        """``compressed-adamw`` or ``compressed-adamw:freeze=30,carrier=sign:ef=true``: a carrier's
        own options (after a comma, as in ``topk:ratio=0.01,ef=true``) stay with it; the optimizer's
        options start anew. ValueError names what is wrong and the valid options."""
        options = split_nesting_spec(text, NAME, OPTIONS, nesting=SPECS)
        hints = {f.name: type(f.default) for f in dataclasses.fields(cls)}
        hints["freeze"] = int
        if options.get("freeze", AUTO) != AUTO and not str(options["freeze"]).strip().lstrip("-").isdigit():
            raise ValueError(f"freeze must be an integer >= 1 or 'auto' (when the variance has settled), "
                             f"got {options['freeze']!r}")  # fmt: skip
        values: dict[str, Any] = {
            key: value if (key, value) == ("freeze", AUTO) else convert(key, value, hints[key])
            for key, value in options.items()
        }
        return cls(**values)

    def __str__(self) -> str:
        """The canonical text: the name, then every option that differs from its default."""
        changed = [
            f"{f.name}={format_value(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != (str(HookSpec.parse(str(f.default))) if f.name in SPECS else f.default)
        ]
        return NAME + (":" + ",".join(changed) if changed else "")


OPTIONS = tuple(f.name for f in dataclasses.fields(CompressedAdamWSpec))
SPECS = ("carrier", "variance_carrier")
"""The options that are hook specs (their own options follow them after commas)."""


def is_compressed_adamw_spec(text: object) -> bool:
    """Whether ``text`` is a ``compressed-adamw`` spec."""
    return isinstance(text, str) and text.strip().partition(":")[0] == NAME
