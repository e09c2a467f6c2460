"""Per-step wire bytes: measured where gradcomp moved the bytes, the engine's estimate where the backend did."""

from __future__ import annotations

import pytest

from gradcomp.collectives.link import Traffic
from gradcomp.engine.stats import BucketRecord, per_step, wire_bytes


def _step(sent: int | None, payload: int) -> dict[str, object]:
    record = BucketRecord(step=0, bucket=0, input_bytes=4 * payload, queued=0.0, payload_bytes=payload)
    record.sent_bytes = sent
    return per_step([record])[0]


def test_measured_traffic_is_taken_as_it_is() -> None:
    assert wire_bytes(_step(sent=1234, payload=1000), world_size=4) == 1234


def test_native_collectives_count_the_engines_estimate() -> None:
    """The backend moved part of the step unobserved: measured bytes plus its algorithm's own count."""
    record = BucketRecord(step=0, bucket=0, input_bytes=4000, queued=0.0, payload_bytes=1000)
    record.add_traffic(Traffic(sent=300, received=300))
    record.add_traffic(None, native=1500.0)
    (step,) = per_step([record])
    assert step["sent_bytes"] is None
    assert wire_bytes(step, world_size=4) == 1800


@pytest.mark.parametrize(("world", "factor"), [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_a_step_without_an_estimate_counts_as_a_ring_all_reduce(world: int, factor: float) -> None:
    """torch's own hooks record no estimate: their payload went through the backend's ring all-reduce."""
    step = {"sent_bytes": None, "payload_bytes": 1000}
    assert wire_bytes(step, world_size=world) == pytest.approx(1000 * factor)


def test_the_tail_runs_from_the_last_hand_over_to_the_last_finish() -> None:
    """Two buckets of one step: the tail is what backward could not hide (the last bucket was handed
    over at 5.0, and the step's work ended at 7.5), whatever order the buckets finished in."""
    first = BucketRecord(step=3, bucket=0, input_bytes=8, queued=1.0, finished=7.5)
    last = BucketRecord(step=3, bucket=1, input_bytes=8, queued=5.0, finished=6.0)
    (step,) = per_step([first, last])
    assert step["step"] == 3 and step["buckets"] == 2
    assert step["tail_s"] == 2.5


def test_phases_show_in_torch_profiler_traces() -> None:
    from torch.profiler import profile

    record = BucketRecord(step=0, bucket=0, input_bytes=8, queued=0.0)
    with profile() as trace:
        with record.phase("compress"):
            pass
        with record.phase("decompress"):
            pass
    names = {event.name for event in trace.events()}
    assert {"gradcomp.compress", "gradcomp.decompress"} <= names
    assert record.compress_s >= 0 and [name for name, _, _ in record.spans] == ["compress", "decompress"]
