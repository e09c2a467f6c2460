"""What the engine measures per bucket, summed per step, and a Chrome/Perfetto trace of it.

Times are ``time.perf_counter`` seconds on this rank. ``payload_bytes`` is what the compressor
produced (every round), exactly as ``Compressor.wire_bytes`` counts; ``sent_bytes`` and
``received_bytes`` are what this rank's collectives moved, None where the backend's native
collectives did the moving (their traffic is not observable). ``sent_estimate`` is always there:
the bytes measured, plus, for the backend's collectives, what their algorithm sends by its own
count (a ring's), which the engine knows from the collective it issued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from gradcomp.collectives.cost_model import ring_traffic
from gradcomp.collectives.link import Traffic


@dataclasses.dataclass
class BucketRecord:
    """One bucket of one step."""

    step: int
    bucket: int
    input_bytes: int
    queued: float
    started: float = 0.0
    finished: float = 0.0
    payload_bytes: int = 0
    sent_bytes: int | None = 0
    received_bytes: int | None = 0
    sent_estimate: float = 0.0
    compress_s: float = 0.0
    communicate_s: float = 0.0
    decompress_s: float = 0.0
    spans: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a ``compress``, ``communicate`` or ``decompress`` phase (they may alternate); it
        also shows in ``torch.profiler`` traces as the range ``gradcomp.<name>``."""
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"gradcomp.{name}"):
                yield
        finally:
            self.add_span(name, start, time.perf_counter())

    def add_span(self, name: str, start: float, end: float) -> None:
        """Count a phase that ran from ``start`` to ``end`` (a collective timed from the thread it lands on)."""
        setattr(self, f"{name}_s", getattr(self, f"{name}_s") + end - start)
        self.spans.append((name, start, end))

    def add_traffic(self, traffic: Traffic | None, native: float = 0.0) -> None:
        """Count a collective's traffic; None where the backend moved the bytes unobserved, and
        ``native`` is then what its algorithm sends by its own count (for :attr:`sent_estimate`)."""
        self.sent_estimate += native if traffic is None else traffic.sent
        if traffic is None or self.sent_bytes is None or self.received_bytes is None:
            self.sent_bytes = self.received_bytes = None
        else:
            self.sent_bytes += traffic.sent
            self.received_bytes += traffic.received


class CallSteps:
    """Numbers calls into steps where nothing says where a step ends: FSDP2 reduce-scatters each
    module once per backward, so a key seen again starts the next step."""

    def __init__(self) -> None:
        self.step = 0
        self._seen: set[Any] = set()

    def number(self, key: Any) -> tuple[int, int]:
        """``(step, index within the step)`` of a call for ``key``."""
        if key in self._seen:
            self.step += 1
            self._seen.clear()
        self._seen.add(key)
        return self.step, len(self._seen) - 1


def steps_since(records: Sequence[BucketRecord], first: int) -> list[dict[str, Any]]:
    """:func:`per_step` of the records of step ``first`` on, reading only the newest (cheap at every step)."""
    fresh = []
    for record in reversed(records):
        if record.step < first:
            break
        fresh.append(record)
    return per_step(reversed(fresh))


def per_step(records: Iterable[BucketRecord]) -> list[dict[str, Any]]:
    """Sum bucket records into one dict per step (in step order).

    ``tail_s`` is the time from the step's last hand-over of a bucket (when backward produced its
    last gradients) to the end of the last bucket's work: the communication and decompression
    that backward could not hide, which a training step waits for.
    """
    steps: dict[int, dict[str, Any]] = {}
    for r in records:
        s = steps.setdefault(
            r.step,
            {"step": r.step, "buckets": 0, "input_bytes": 0, "payload_bytes": 0, "sent_bytes": 0,
             "received_bytes": 0, "sent_estimate": 0.0, "compress_s": 0.0, "communicate_s": 0.0, "decompress_s": 0.0,
             "last_queued": r.queued, "last_finished": r.finished},
        )  # fmt: skip
        s["buckets"] += 1
        s["last_queued"] = max(s["last_queued"], r.queued)
        s["last_finished"] = max(s["last_finished"], r.finished)
        for name in ("input_bytes", "payload_bytes", "sent_estimate", "compress_s", "communicate_s", "decompress_s"):
            s[name] += getattr(r, name)
        for name in ("sent_bytes", "received_bytes"):
            value = getattr(r, name)
            s[name] = None if value is None or s[name] is None else s[name] + value
    for s in steps.values():
        s["tail_s"] = max(0.0, s.pop("last_finished") - s.pop("last_queued"))
        s["compression_ratio"] = s["input_bytes"] / s["payload_bytes"] if s["payload_bytes"] else float("inf")
    return [steps[k] for k in sorted(steps)]


def wire_bytes(step: dict[str, Any], world_size: int) -> float:
    """Bytes one rank sent in a step (a :func:`per_step` dict): as measured, or, where the backend's
    native collectives moved the payload (unobservable), the engine's ``sent_estimate``; a step
    without one (torch's own hooks) counts what a ring all-reduce sends: 2 (p - 1) / p x payload."""
    if step["sent_bytes"] is not None:
        return float(step["sent_bytes"])
    if "sent_estimate" in step:
        return float(step["sent_estimate"])
    return step["payload_bytes"] * ring_traffic(world_size)


def write_trace(records: Iterable[BucketRecord], path: str | os.PathLike[str], rank: int = 0) -> None:
    """A Chrome / Perfetto trace (open it at ui.perfetto.dev or chrome://tracing): per bucket, when
    DDP handed it over (``ready``), its wait in the queue, and its compress / communicate /
    decompress phases, on a timeline against which backward's progress shows as the ready marks."""
    events: list[dict[str, Any]] = []

    def us(seconds: float) -> float:
        return seconds * 1e6

    for r in records:
        label = f"step {r.step} bucket {r.bucket}"
        args = {"step": r.step, "bucket": r.bucket, "input_bytes": r.input_bytes, "payload_bytes": r.payload_bytes}
        events.append({"name": f"ready {label}", "ph": "i", "s": "t", "ts": us(r.queued), "pid": rank, "tid": "ddp"})
        events.append({"name": "queued", "ph": "X", "ts": us(r.queued), "dur": us(r.started - r.queued),
                       "pid": rank, "tid": "gradcomp", "args": args})  # fmt: skip
        for name, start, end in r.spans:
            events.append({"name": name, "ph": "X", "ts": us(start), "dur": us(end - start), "pid": rank,
                           "tid": "gradcomp", "args": args})  # fmt: skip
    with open(path, "w") as file:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, file)
