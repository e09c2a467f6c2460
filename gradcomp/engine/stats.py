"""What the engine measures per bucket (:class:`BucketRecord`), summed per step (:class:`StepStats`),
and a Chrome/Perfetto trace of it.

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
from typing import Any, Protocol, TypeVar

import torch

from gradcomp import host
from gradcomp.collectives.link import Traffic


@dataclasses.dataclass
class BucketRecord:
    """One bucket of one step."""

    step: int
    bucket: int
    input_bytes: int
    queued: float
    uncompressed_bytes: int = 0
    """Of :attr:`input_bytes`, what the spec's per-tensor policy sent uncompressed."""
    started: float = 0.0
    finished: float = 0.0
    payload_bytes: int = 0
    sent_bytes: int | None = 0
    received_bytes: int | None = 0
    sent_estimate: float = 0.0
    compress_s: float = 0.0
    communicate_s: float = 0.0
    decompress_s: float = 0.0
    host_reads: int = 0
    """Reads of tensor values on the host in the bucket's phases (:mod:`gradcomp.host`)."""
    intra_node_bytes: float | None = None
    """Of :attr:`sent_estimate`, the bytes sent to ranks of this rank's own node (a hierarchical hook,
    ``local_size``: the node's reduce-scatter and all-gather); None: a flat hook, which does not
    know where its peers are."""
    part: int = 0
    """Which part of the bucket this is, when the bucket travels in parts (``HookSpec.pieces``):
    each part has its own record, and the step counts the bucket once."""
    routes: str = ""
    """The routes its plan sent it by, as ``gradcomp explain`` names them (``gather (in_flight) +
    dense``); empty where no plan names them (the sharded reduce-scatter)."""
    spans: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a ``compress``, ``communicate`` or ``decompress`` phase (they may alternate) and count
        its host reads; it also shows in ``torch.profiler`` traces as the range ``gradcomp.<name>``."""
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"gradcomp.{name}"), host.counting(self):
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

    def starts_step(self, key: Any) -> bool:
        """Whether a call for ``key`` now would be its step's first."""
        return not self._seen or key in self._seen

    def number(self, key: Any) -> tuple[int, int]:
        """``(step, index within the step)`` of a call for ``key``."""
        if key in self._seen:
            self.step += 1
            self._seen.clear()
        self._seen.add(key)
        return self.step, len(self._seen) - 1


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one step cost this rank: the sum of its buckets (what every hook state's ``steps()``
    returns, one per step). Records add up (``a + b``: counts and times summed, a figure that is
    None on either side None) from :meth:`zero`. A field is None where its hook cannot observe it:
    torch's own hooks time no phase and count no buckets, and the backend's native collectives do
    not report their traffic."""

    step: int
    """The step's number, by the hook's step clock: gradcomp's DDP, HSDP and ``auto`` hooks count the
    run's steps (``Engine.steps_done``, saved in their checkpoints: a resumed run continues the
    numbering); torch's own hooks and FSDP2's reduce-scatter count this process's, from 0."""
    buckets: int | None = 0
    """Buckets averaged in the step (DDP's buckets, FSDP2's module calls, the synchronizer's
    fragments); None for torch's own DDP hooks, which do not count them."""
    input_bytes: int = 0
    """The gradient bytes handed to the hook (for FSDP2: what an uncompressed reduce-scatter sends)."""
    uncompressed_bytes: int = 0
    """Of :attr:`input_bytes`, the tensors the spec's per-tensor policy sent uncompressed (``min_numel``,
    ``vectors=dense``); their payload is themselves."""
    payload_bytes: int = 0
    """The payload the compressor produced (every round), exactly as ``Compressor.wire_bytes`` counts."""
    sent_bytes: int | None = 0
    """What this rank's collectives sent, as measured; None where the backend's native collectives
    moved any of the step's bytes (their traffic is not observable)."""
    received_bytes: int | None = 0
    """What this rank's collectives received; None where :attr:`sent_bytes` is."""
    sent_estimate: float = 0.0
    """The bytes sent, measured, plus what the backend's collectives send by their algorithm's own
    count (a ring's): always there (torch's own hooks: a ring all-reduce of the payload)."""
    compress_s: float | None = 0.0
    """Seconds compressing (on the engine's threads, overlapping backward); None: not timed (torch's hooks)."""
    communicate_s: float | None = 0.0
    """Seconds in the collectives (their wall time on this rank); None: not timed."""
    decompress_s: float | None = 0.0
    """Seconds decompressing; None: not timed."""
    host_reads: int | None = 0
    """Reads of tensor values on the host (:mod:`gradcomp.host`): on a GPU, each one waits for the
    device (a synchronization in backward's thread); None: not observed (torch's hooks)."""
    intra_node_bytes: float | None = None
    """Of the bytes sent, those to ranks of the same node (hierarchical hooks: ``local_size``), the
    rest crossing nodes (:attr:`inter_node_bytes`); None where the hook does not know the nodes."""
    tail_s: float | None = 0.0
    """From the step's last hand-over of a bucket (when backward produced its last gradients) to the
    end of the last bucket's work: the communication and decompression that backward could not
    hide, which a training step waits for; None: not timed."""

    @classmethod
    def zero(cls: type[_Stats], step: int) -> _Stats:
        """A step in which nothing was averaged (what a step's parts add up from)."""
        return cls(step, intra_node_bytes=0.0)

    def __add__(self: _Stats, other: StepStats) -> _Stats:
        """Both summed, field by field (None where either is None; a field ``other`` lacks counts 0),
        with this one's step and kind."""
        summed = {
            f.name: _plus(getattr(self, f.name), getattr(other, f.name, 0))
            for f in dataclasses.fields(self)
            if f.name != "step"
        }
        return dataclasses.replace(self, **summed)

    @property
    def compression_ratio(self) -> float:
        """Gradient bytes over payload bytes (inf for a step without a payload)."""
        return self.input_bytes / self.payload_bytes if self.payload_bytes else float("inf")

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sent in the step: as measured, or, where the backend's native collectives
        moved the payload (unobservable), :attr:`sent_estimate`."""
        return float(self.sent_bytes if self.sent_bytes is not None else self.sent_estimate)

    @property
    def inter_node_bytes(self) -> float | None:
        """Bytes this rank sent to other nodes in the step (:attr:`wire_bytes` less those inside its
        node); None where the hook does not know the nodes (a flat hook)."""
        return None if self.intra_node_bytes is None else self.wire_bytes - self.intra_node_bytes

    def phases(self) -> dict[str, float | None]:
        """Seconds per phase, by name: ``compress``, ``communicate``, ``decompress`` and ``tail``."""
        return {"compress": self.compress_s, "communicate": self.communicate_s, "decompress": self.decompress_s,
                "tail": self.tail_s}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The fields, :attr:`compression_ratio` and :attr:`inter_node_bytes` as a plain dict (for
        JSON, or a table)."""
        return {**dataclasses.asdict(self), "compression_ratio": self.compression_ratio,
                "inter_node_bytes": self.inter_node_bytes}  # fmt: skip


_Stats = TypeVar("_Stats", bound=StepStats)


def _plus(a: Any, b: Any) -> Any:
    return None if a is None or b is None else a + b


class _Stepped(Protocol):
    @property
    def step(self) -> int: ...


_Item = TypeVar("_Item", bound=_Stepped)


def newest(items: Sequence[_Item], first: int) -> list[_Item]:
    """The ``items`` (records or steps, in step order) of step ``first`` on, reading only the newest
    (cheap at every step)."""
    fresh = []
    for item in reversed(items):
        if item.step < first:
            break
        fresh.append(item)
    return fresh[::-1]


def steps_since(records: Sequence[BucketRecord], first: int) -> list[StepStats]:
    """:func:`per_step` of the records of step ``first`` on, reading only the newest (cheap at every step)."""
    return per_step(newest(records, first))


def per_step(records: Iterable[BucketRecord]) -> list[StepStats]:
    """Sum bucket records into one :class:`StepStats` per step (in step order), with the step's tail."""
    steps: dict[int, list[BucketRecord]] = {}
    for r in records:
        steps.setdefault(r.step, []).append(r)
    return [_summed(step, steps[step]) for step in sorted(steps)]


def _summed(step: int, records: list[BucketRecord]) -> StepStats:
    parts = (
        StepStats(step, buckets=int(r.part == 0), input_bytes=r.input_bytes, uncompressed_bytes=r.uncompressed_bytes,
                  payload_bytes=r.payload_bytes,
                  sent_bytes=r.sent_bytes, received_bytes=r.received_bytes, sent_estimate=r.sent_estimate,
                  compress_s=r.compress_s, communicate_s=r.communicate_s, decompress_s=r.decompress_s,
                  host_reads=r.host_reads, intra_node_bytes=r.intra_node_bytes)
        for r in records
    )  # fmt: skip
    tail = max(0.0, max(r.finished for r in records) - max(r.queued for r in records))
    return dataclasses.replace(sum(parts, StepStats.zero(step)), tail_s=tail)


def write_trace(records: Iterable[BucketRecord], path: str | os.PathLike[str], rank: int = 0) -> None:
    """A Chrome / Perfetto trace (open it at ui.perfetto.dev or chrome://tracing): per bucket, when
    DDP handed it over (``ready``), its wait in the queue, and its compress / communicate /
    decompress phases, on a timeline against which backward's progress shows as the ready marks."""
    events: list[dict[str, Any]] = []

    def us(seconds: float) -> float:
        return seconds * 1e6

    for r in records:
        label = f"step {r.step} bucket {r.bucket}" + (f" part {r.part}" if r.part else "")
        args = {"step": r.step, "bucket": r.bucket, "routes": r.routes, "input_bytes": r.input_bytes,
                "payload_bytes": r.payload_bytes, "host_reads": r.host_reads}
        events.append({"name": f"ready {label}", "ph": "i", "s": "t", "ts": us(r.queued), "pid": rank, "tid": "ddp"})
        events.append({"name": "queued", "ph": "X", "ts": us(r.queued), "dur": us(r.started - r.queued),
                       "pid": rank, "tid": "gradcomp", "args": args})  # fmt: skip
        for name, start, end in r.spans:
            events.append({"name": name, "ph": "X", "ts": us(start), "dur": us(end - start), "pid": rank,
                           "tid": "gradcomp", "args": args})  # fmt: skip
    with open(path, "w") as file:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, file)
