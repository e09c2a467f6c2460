"""The warm-up as a schedule: what each step of a hook with ``warmup=N`` sends (``HookSpec.warmup``).

The engine asks :meth:`Warmup.at` once per step, in the caller's thread, and gets a :class:`WarmupStep`:
whether the step goes uncompressed (the all-reduce hook's sum, with error feedback's momentum
correction and clipping still applied: ``Compressor.dense_share``), and for ratio-based sparsifiers
(topk, randomk) the keep-ratio of the step, which falls exponentially to theirs (DGC's schedule,
:func:`gradcomp.engine.spec.warmup_ratio`). A step whose ratio would cost as many bytes as the
uncompressed gradient (``Capabilities.dense_from``) goes uncompressed instead: exact, and no dearer.
"""

from __future__ import annotations

import dataclasses

from gradcomp.compressors import Compressor
from gradcomp.engine.spec import HookSpec, warmup_ratio


@dataclasses.dataclass(frozen=True)
class WarmupStep:
    """What one step sends."""

    dense: bool
    """The step goes uncompressed."""
    ratio: float | None
    """The keep-ratio to compress at (ratio-based sparsifiers); None: the compressor's own."""
    settled: bool
    """The warm-up is over: payloads are the size they will keep (the padded all-gather may learn
    its capacity from them; learnt from a warm-up's larger payloads it would pad every later step)."""


class Warmup:
    """The schedule of ``spec.warmup`` steps for ``compressor`` (no warm-up: every step compressed)."""

    def __init__(self, spec: HookSpec, compressor: Compressor) -> None:
        self.steps = spec.warmup
        declared = compressor.capabilities
        self._ratio = declared.ratio if self.steps else None  # the config's (None: no ratio kept)
        self._dense_from = declared.dense_from

    def at(self, step: int) -> WarmupStep:
        """Step ``step`` (from 0, counted over the whole run, resumed ones included)."""
        settled = step >= self.steps
        if self._ratio is None:
            return WarmupStep(not settled, None, settled)
        if step > self.steps:
            return WarmupStep(False, None, True)  # the compressor's own ratio, set at the warm-up's last step
        ratio = warmup_ratio(self._ratio, self.steps, step)
        return WarmupStep(not settled and ratio >= self._dense_from, ratio, settled)
