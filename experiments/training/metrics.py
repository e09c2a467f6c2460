"""What a run measures and where it goes: wire bytes from the hook, TensorBoard scalars and HParams,
and the run's curves against step, training time and wire bytes.

Rank 0 writes; the other ranks get a :class:`NullWriter`. Every TensorBoard event carries the wall
time ``origin + training seconds`` (the time the run started, plus the time spent in training steps,
which excludes evaluation and checkpoints, and carries over a resume), so TensorBoard's *Relative*
axis is training time. A resumed run opens its writer with ``purge_step`` one past its checkpoint:
TensorBoard then drops what the interrupted run wrote after the checkpoint, and the curves file is
cut the same way.

TensorBoard tags (``step`` is always the optimizer step):

- ``train/loss`` (mean over the ranks and the steps since the last point), ``train/lr``, ``train/steps_per_s``
- ``eval/<metric>``: ``loss``, ``accuracy`` (and ``perplexity`` for language models)
- ``time/<part>_ms``: per step: ``data``, ``forward``, ``backward_comm`` (backward, with the hooks'
  communication overlapping it), ``optimizer``, ``sync`` (local SGD's or DiLoCo's synchronization),
  ``step``; from the hook: ``compress``, ``communicate``, ``decompress`` (on the hook's thread,
  overlapping backward), and with ``--sync`` ``exposed`` (the time the training thread waited)
- ``comm/compression_ratio``, ``comm/sent_bytes_per_step``, ``comm/payload_bytes_per_step``, ``comm/wire_bytes``
- the ``auto`` hook's: ``hook/predicted_step_ms`` (its prediction of the step it chose), and in the Text
  dashboard ``hook/decision`` (each decision: every bucket's method and why)

plus a custom-scalars layout (:data:`LAYOUT`) that puts every run's curve of one tag on one chart.
Curves against training time and wire bytes, which TensorBoard's step cannot carry without
meaning something else, go to ``curves.jsonl`` (:mod:`gradcomp.experiments.training.curves`).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Mapping
from typing import Any, Protocol

from gradcomp.experiments.training import curves
from gradcomp.state import TrainingHookState

logger = logging.getLogger(__name__)


class WireMeter:
    """Bytes on the wire and time in the hook, per step, from the hook's statistics (its per-step
    records, read incrementally: only the steps since the last call).

    Wire bytes are what this rank's collectives sent (:attr:`StepStats.wire_bytes
    <gradcomp.engine.stats.StepStats.wire_bytes>`). The backend's native all-reduce does not report
    its traffic (``sent_bytes`` is None there: ``allreduce``, casts and PowerSGD with ``algo=native``,
    and torch's hooks); such steps count what its algorithm sends by its own count (``sent_estimate``:
    a ring all-reduce's ``2 (p - 1) / p`` times the payload, what gloo's and NCCL's rings send), and
    :attr:`estimated` says so. ``noop`` sends nothing. Hook times
    (compress, communicate, decompress) are summed where the hook measures them (gradcomp's hooks;
    torch's do not).
    """

    def __init__(
        self, state: TrainingHookState, total: int = 0, estimated: bool = False, across: float | None = 0.0
    ) -> None:
        self.state = state
        self.total, self.estimated = total, estimated
        self.across: float | None = across
        """Bytes sent to other nodes over the run, where the hook knows (hierarchical hooks:
        ``StepStats.inter_node_bytes``); None once a step did not say."""
        self.input_bytes = self.payload_bytes = 0  # this invocation's, for the mean compression ratio
        self.hook_seconds: dict[str, float | None] = dict.fromkeys(HOOK_TIMES)  # this invocation's; None: unmeasured
        self.steps = 0
        self._next: int | None = None  # the hook's next step to read; None: its first, whatever its number
        # (a hook numbers steps by its own clock: gradcomp's continue across a resume, torch's start at 0)
        self._window: dict[str, float] = {}
        self._decided = 0  # the auto hook's decisions already handed out

    def collect(self) -> None:
        """Take in the steps finished since the last call (after a backward, every bucket is in)."""
        steps = self.state.steps_since(self._next or 0)
        if steps and self._next is not None and steps[0].step != self._next:
            logger.warning("hook statistics of steps %d-%d were lost (read them more often)", self._next, steps[0].step)
        for s in steps:
            sent = round(s.wire_bytes)
            self.estimated |= s.sent_bytes is None
            self.total += sent
            self.input_bytes += s.input_bytes
            self.payload_bytes += s.payload_bytes
            self.steps += 1
            counts = (("steps", 1), ("sent", sent), ("input", s.input_bytes), ("payload", s.payload_bytes))
            for key, value in counts:
                self._window[key] = self._window.get(key, 0) + value
            if s.inter_node_bytes is not None:  # a hierarchical hook: the bytes across nodes apart
                self._window["across"] = self._window.get("across", 0) + s.inter_node_bytes
            if self.across is not None and s.inter_node_bytes is not None:
                self.across += s.inter_node_bytes
            else:
                self.across = None
            phases = s.phases()
            for key in HOOK_TIMES:
                seconds = phases.get(key)
                if seconds is not None:
                    self.hook_seconds[key] = (self.hook_seconds[key] or 0.0) + seconds
                    self._window[key] = self._window.get(key, 0) + seconds
            self._next = s.step + 1

    def drain(self) -> dict[str, float]:
        """Scalars for the steps collected since the last drain (per-step means)."""
        w, self._window = self._window, {}
        n = w.get("steps", 0)
        if not n:
            return {"comm/wire_bytes": self.total}  # noop: nothing sent, a flat line
        scalars = {
            "comm/wire_bytes": self.total,
            "comm/sent_bytes_per_step": w["sent"] / n,
            "comm/payload_bytes_per_step": w["payload"] / n,
            **{f"time/{key}_ms": 1e3 * w[key] / n for key in HOOK_TIMES if key in w},
        }
        if w["payload"]:
            scalars["comm/compression_ratio"] = w["input"] / w["payload"]
        if "across" in w:
            scalars["comm/inter_node_bytes_per_step"] = w["across"] / n
        predicted = getattr(self.state, "predicted_s", None)
        if predicted:  # the auto hook's prediction of its step
            scalars["hook/predicted_step_ms"] = 1e3 * predicted
        return scalars

    def decisions(self) -> list[dict[str, Any]]:
        """The ``auto`` hook's decisions since the last call (none for other hooks)."""
        made = getattr(self.state, "decisions", [])
        fresh, self._decided = made[self._decided :], len(made)
        return list(fresh)

    @property
    def compression_ratio(self) -> float | None:
        return self.input_bytes / self.payload_bytes if self.payload_bytes else None


HOOK_TIMES = ("compress", "communicate", "decompress", "exposed")
"""The phases (:meth:`StepStats.phases <gradcomp.engine.stats.StepStats.phases>`) whose times a run
reports: the hook's own (per step, on the hook's thread, overlapping backward), and infrequent
synchronization's ``exposed``: the time the training thread waited for it."""


class Writer(Protocol):
    """Where rank 0's metrics go (TensorBoard and the curves file); other ranks use :class:`NullWriter`."""

    def scalars(self, values: Mapping[str, float], step: int, elapsed: float) -> None: ...

    def points(self, kind: str, values: Mapping[str, float], step: int, elapsed: float, wire_bytes: int) -> None: ...

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float], step: int, elapsed: float) -> None: ...

    def text(self, tag: str, text: str, step: int, elapsed: float) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullWriter:
    def scalars(self, values: Mapping[str, float], step: int, elapsed: float) -> None:
        pass

    def points(self, kind: str, values: Mapping[str, float], step: int, elapsed: float, wire_bytes: int) -> None:
        pass

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float], step: int, elapsed: float) -> None:
        pass

    def text(self, tag: str, text: str, step: int, elapsed: float) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


LAYOUT = {
    "gradcomp: every run on one chart": {
        "eval accuracy": ["Multiline", [r"^eval/accuracy$"]],
        "eval loss": ["Multiline", [r"^eval/loss$"]],
        "train loss": ["Multiline", [r"^train/loss$"]],
        "step time (ms)": ["Multiline", [r"^time/step_ms$"]],
        "bytes sent per rank (cumulative)": ["Multiline", [r"^comm/wire_bytes$"]],
    }
}
"""TensorBoard's custom-scalars layout: with ``--logdir`` on a sweep, each chart holds every run's
curve of one tag (pick runs, a method per run, in the run selector)."""


def require_tensorboard() -> None:
    """Refuse, naming the extra, where TensorBoard is not installed (the core installs without it):
    a launcher calls it before any rank starts."""
    if importlib.util.find_spec("tensorboard") is None:
        missing = ModuleNotFoundError("No module named 'tensorboard'", name="tensorboard")
        raise ImportError("training runs log to TensorBoard: pip install 'gradcomp[experiments]'") from missing


class TensorBoardWriter:
    """Scalars, HParams and the layout in ``logdir``, every event at wall time ``origin + elapsed``;
    curve points in its ``curves.jsonl``.

    ``resume_step``: the step of the checkpoint a run resumes from. Events and curve points the
    interrupted run wrote after it are dropped (TensorBoard's ``purge_step``), so that curves
    continue without duplicates.
    """

    def __init__(self, logdir: str, origin: float, resume_step: int | None = None) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.origin = origin
        self.writer = SummaryWriter(logdir, flush_secs=10, purge_step=purge)
        self.curves = curves.Curves(logdir, resume_step)
        self.writer.add_custom_scalars(LAYOUT)

    def scalars(self, values: Mapping[str, float], step: int, elapsed: float) -> None:
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step, walltime=self.origin + elapsed)

    def points(self, kind: str, values: Mapping[str, float], step: int, elapsed: float, wire_bytes: int) -> None:
        self.curves.append(kind, values, step, elapsed, wire_bytes)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float], step: int, elapsed: float) -> None:
        """The HParams dashboard's row for this run: its settings and final metrics (written as
        scalars too, which is where the dashboard reads them)."""
        from torch.utils.tensorboard.summary import hparams as summarize

        plain = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
        finite = {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}
        walltime = self.origin + elapsed
        file_writer = self.writer._get_file_writer()  # add_hparams would start another writer, at the wall time
        for summary in summarize(plain, finite):
            file_writer.add_summary(summary, step, walltime)
        self.scalars(finite, step, elapsed)

    def text(self, tag: str, text: str, step: int, elapsed: float) -> None:
        """A note in TensorBoard's Text dashboard (the ``auto`` hook's decisions)."""
        self.writer.add_text(tag, text, step, walltime=self.origin + elapsed)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
