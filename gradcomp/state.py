"""What every state that averages a model over its ranks offers a training loop: :class:`TrainingHookState`.

gradcomp's hooks (``gradcomp.hooks.HookState``, DDP's and FSDP2's), the ``auto`` hook's
(``AutoState``), torch's own hooks recorded (``TorchHookState``, ``TorchFSDPState``) and the
synchronizer of local SGD and DiLoCo (:class:`gradcomp.sync.Synchronizer`) keep per-step statistics,
write traces, save and restore their state, and keep the error that failed them. Code that takes
any of them (training runs, benchmarks) names this protocol. Each of the five inherits it, which
gives it :meth:`~TrainingHookState.steps` and lets mypy check it against the protocol where it is
declared. It lives in the core because the synchronizer, which must not import
``gradcomp.hooks``, is one of them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from gradcomp.engine.stats import StepStats


class TrainingHookState(Protocol):
    """A hook's (or synchronizer's) state, as a training loop uses it."""

    error: BaseException | None
    """The first exception that failed the averaging (later ones are its consequences), as gradcomp
    raised it (DDP's ``backward`` gets a RuntimeError with its text): a
    :class:`gradcomp.errors.PeerError` names the peer. None while nothing failed."""

    def steps_since(self, first: int) -> Sequence[StepStats]:
        """:meth:`steps` from step ``first`` on, reading only the newest (cheap at every step)."""
        ...

    def steps(self) -> Sequence[StepStats]:
        """Per step (numbered by the hook's step clock, :attr:`StepStats.step`), what averaging cost:
        one :class:`~gradcomp.engine.stats.StepStats` each, the latest ones (each state keeps a
        bounded history). Read it after a step's backward (DDP has waited for every bucket by then)."""
        return self.steps_since(0)

    def summary(self) -> RunSummary:
        """What averaging cost over the run: the totals of :meth:`steps`, as :class:`RunSummary`. They
        cover the steps the state keeps (a bounded history: :attr:`RunSummary.first_step` says where it
        starts; a resumed process's since it resumed); :class:`RunTotals` keeps a longer run's."""
        return RunSummary.of(self.steps())

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """A Chrome / Perfetto JSON trace of what was recorded (open it at ui.perfetto.dev): per
        bucket, when it was handed over, its wait, and its compress / communicate / decompress phases."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly, with the spec and world size that made it:
        tensors and plain values, loadable with ``torch.load(..., weights_only=True)``."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, from a state of the same spec and world size:
        anything else is refused, naming both."""
        ...


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """A run's totals, what ``state.summary()`` returns: the steps' :class:`StepStats` summed (bytes,
    seconds, reads), with the run's compression ratio and the mean of its steps'. ``str()`` reads as a
    line for a log; :meth:`to_dict` is for JSON. A figure is None where a step could not observe it
    (torch's own hooks time nothing), as in :class:`StepStats`."""

    steps: int
    """Steps summed."""
    first_step: int | None
    """The first one's number, by the hook's step clock (None: no step)."""
    last_step: int | None
    """The last one's."""
    input_bytes: int
    """Gradient bytes handed to the hook: what an uncompressed payload would have been."""
    uncompressed_bytes: int
    """Of :attr:`input_bytes`, what the spec's per-tensor policy sent uncompressed."""
    payload_bytes: int
    """The payloads the compressor produced."""
    wire_bytes: float
    """Bytes this rank sent (each step's :attr:`StepStats.wire_bytes`: measured, or the estimate)."""
    inter_node_bytes: float | None
    """Of those, the bytes to other nodes (None: a flat hook, which does not know the nodes)."""
    mean_ratio: float
    """The mean of the steps' compression ratios (those with a payload; inf: none had one)."""
    compress_s: float | None
    communicate_s: float | None
    decompress_s: float | None
    tail_s: float | None
    """Seconds after backward's last bucket that the steps waited for (:attr:`StepStats.tail_s`)."""
    host_reads: int | None

    @classmethod
    def of(cls, steps: Iterable[StepStats]) -> RunSummary:
        """The totals of ``steps`` (each step once)."""
        totals = RunTotals()
        for step in steps:
            totals.add(step)
        return totals.summary()

    @property
    def compression_ratio(self) -> float:
        """The run's gradient bytes over its payload bytes (inf without a payload): its bytes against
        the uncompressed."""
        return self.input_bytes / self.payload_bytes if self.payload_bytes else math.inf

    def to_dict(self) -> dict[str, Any]:
        """The fields and :attr:`compression_ratio`, as a plain dict."""
        return {**dataclasses.asdict(self), "compression_ratio": self.compression_ratio}

    def __str__(self) -> str:
        if not self.steps:
            return "no step averaged"
        where = f"{self.first_step}" if self.steps == 1 else f"{self.first_step}-{self.last_step}"
        text = (
            f"{self.steps} {'step' if self.steps == 1 else 'steps'} ({where}): {_size(self.wire_bytes)} sent, "
            f"{_size(self.payload_bytes)} of payload for {_size(self.input_bytes)} of gradients "
            f"({self.compression_ratio:.1f}x fewer bytes, {self.mean_ratio:.1f}x a step on average)"
        )
        if self.inter_node_bytes is not None:
            text += f", {_size(self.inter_node_bytes)} across nodes"
        if self.communicate_s is not None:
            text += f", {self.communicate_s:.3f} s communicating"
        return text


class RunTotals:
    """A run's totals kept as it goes, for a run longer than the history a state keeps (gradcomp's
    hooks keep their engine's latest 10,000 buckets: about 1,100 steps of a 9-bucket model), which
    ``state.summary()`` covers. Call :meth:`update` with the state every few steps (after the optimizer
    step: each call reads only the steps not read yet) and :meth:`summary` at any time. What it keeps
    is a few numbers, whatever the run's length.

    >>> totals = RunTotals()
    >>> ...                       # each step: backward, optimizer.step(), then
    >>> totals.update(state)
    >>> print(totals.summary())
    """

    def __init__(self) -> None:
        self._total: StepStats | None = None
        self._first: int | None = None
        self._last: int | None = None
        self._count = 0
        self._wire = 0.0
        self._inter: float | None = 0.0
        self._ratios = 0.0  # the steps' compression ratios summed, of the steps with a payload
        self._with_payload = 0
        self.next = 0
        """The first step :meth:`update` has not read yet, by the state's step clock."""

    def update(self, state: TrainingHookState) -> None:
        """Add the steps ``state`` has recorded since the last call (each step once)."""
        for step in state.steps_since(self.next):
            self.add(step)
            self.next = step.step + 1

    def add(self, step: StepStats) -> None:
        """Add one step."""
        self._total = step if self._total is None else self._total + step
        self._first = step.step if self._first is None else self._first
        self._last = step.step
        self._count += 1
        self._wire += step.wire_bytes
        inter = step.inter_node_bytes
        self._inter = None if self._inter is None or inter is None else self._inter + inter
        if step.payload_bytes:
            self._ratios += step.compression_ratio
            self._with_payload += 1

    def summary(self) -> RunSummary:
        """The totals so far."""
        total = self._total if self._total is not None else StepStats.zero(0)
        return RunSummary(
            steps=self._count,
            first_step=self._first,
            last_step=self._last,
            input_bytes=total.input_bytes,
            uncompressed_bytes=total.uncompressed_bytes,
            payload_bytes=total.payload_bytes,
            wire_bytes=self._wire,
            inter_node_bytes=self._inter if self._count else None,
            mean_ratio=self._ratios / self._with_payload if self._with_payload else math.inf,
            compress_s=total.compress_s,
            communicate_s=total.communicate_s,
            decompress_s=total.decompress_s,
            tail_s=total.tail_s,
            host_reads=total.host_reads,
        )


def _size(count: float) -> str:
    """Bytes as a reader takes them in (decimal units: 1 MB = 1e6 bytes, as the ``hook/*_mb`` metrics)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.0f} B"
