"""Per-step statistics: one record (StepStats) that adds up; wire bytes measured where gradcomp moved
the bytes, the engine's estimate where the backend did."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gradcomp.collectives.link import Traffic
from gradcomp.engine.stats import BucketRecord, StepStats, newest, per_step
from gradcomp.sync import SyncStepStats


def _step(sent: int | None, payload: int) -> StepStats:
    record = BucketRecord(step=0, bucket=0, input_bytes=4 * payload, queued=0.0, payload_bytes=payload)
    record.sent_bytes = sent
    return per_step([record])[0]


def test_measured_traffic_is_taken_as_it_is() -> None:
    assert _step(sent=1234, payload=1000).wire_bytes == 1234


def test_native_collectives_count_the_engines_estimate() -> None:
    """The backend moved part of the step unobserved: measured bytes plus its algorithm's own count."""
    record = BucketRecord(step=0, bucket=0, input_bytes=4000, queued=0.0, payload_bytes=1000)
    record.add_traffic(Traffic(sent=300, received=300))
    record.add_traffic(None, native=1500.0)
    (step,) = per_step([record])
    assert step.sent_bytes is None and step.received_bytes is None
    assert step.wire_bytes == 1800


def test_the_tail_runs_from_the_last_hand_over_to_the_last_finish() -> None:
    """Two buckets of one step: the tail is what backward could not hide (the last bucket was handed
    over at 5.0, and the step's work ended at 7.5), whatever order the buckets finished in."""
    first = BucketRecord(step=3, bucket=0, input_bytes=8, queued=1.0, finished=7.5)
    last = BucketRecord(step=3, bucket=1, input_bytes=8, queued=5.0, finished=6.0)
    (step,) = per_step([first, last])
    assert step.step == 3 and step.buckets == 2
    assert step.tail_s == 2.5


def test_buckets_sum_into_one_record_per_step_in_step_order() -> None:
    records = [
        BucketRecord(step=1, bucket=0, input_bytes=40, queued=0.0, payload_bytes=10, sent_bytes=12,
                     received_bytes=12, sent_estimate=12.0, compress_s=0.5, communicate_s=1.0, decompress_s=0.25),
        BucketRecord(step=0, bucket=0, input_bytes=8, queued=0.0, payload_bytes=8),
        BucketRecord(step=1, bucket=1, input_bytes=20, queued=0.0, payload_bytes=5, sent_bytes=6,
                     received_bytes=7, sent_estimate=6.0, compress_s=0.25, communicate_s=2.0, decompress_s=0.5),
    ]  # fmt: skip
    zero, one = per_step(records)
    assert zero.step == 0 and one.step == 1
    assert one == StepStats(1, buckets=2, input_bytes=60, payload_bytes=15, sent_bytes=18, received_bytes=19,
                            sent_estimate=18.0, compress_s=0.75, communicate_s=3.0, decompress_s=0.75,
                            tail_s=0.0)  # fmt: skip
    assert one.compression_ratio == 4.0 and one.phases() == {"compress": 0.75, "communicate": 3.0,
                                                             "decompress": 0.75, "tail": 0.0}  # fmt: skip
    assert newest([zero, one], 1) == [one] and newest([zero, one], 0) == [zero, one]


def test_records_add_from_zero_and_unobservable_figures_stay_unobservable() -> None:
    measured = StepStats(2, buckets=1, input_bytes=8, payload_bytes=2, sent_bytes=2, received_bytes=2,
                         sent_estimate=2.0, compress_s=0.5)  # fmt: skip
    native = StepStats(9, buckets=1, input_bytes=8, payload_bytes=8, sent_bytes=None, received_bytes=None,
                       sent_estimate=8.0, compress_s=None)  # fmt: skip
    zero = StepStats.zero(2)
    assert zero + measured == measured and zero.compression_ratio == math.inf and zero.wire_bytes == 0
    total = zero + measured + native
    assert total.step == 2 and total.buckets == 2 and total.input_bytes == 16 and total.payload_bytes == 10
    assert total.sent_bytes is None and total.received_bytes is None and total.compress_s is None
    assert total.sent_estimate == 10.0 and total.wire_bytes == 10.0


def test_a_synchronizers_step_adds_a_hooks_and_its_own() -> None:
    hook = StepStats(4, buckets=1, input_bytes=8, payload_bytes=4, sent_bytes=4, received_bytes=4)
    step = SyncStepStats.zero(0) + hook + SyncStepStats(0, exposed_s=0.5, synchronized=1)
    assert isinstance(step, SyncStepStats) and step.step == 0
    assert (step.input_bytes, step.synchronized, step.skipped, step.exposed_s) == (8, 1, 0, 0.5)
    assert step.phases()["exposed"] == 0.5


def test_the_dict_has_every_field_and_the_ratio() -> None:
    """A record as a plain dict (for JSON): the layout per-step dicts had."""
    step = _step(sent=10, payload=10)
    assert step.to_dict() == {**dataclasses.asdict(step), "compression_ratio": 4.0, "inter_node_bytes": None}
    assert list(step.to_dict()) == ["step", "buckets", "input_bytes", "uncompressed_bytes", "payload_bytes",
                                    "sent_bytes", "received_bytes", "sent_estimate", "compress_s", "communicate_s",
                                    "decompress_s", "host_reads", "intra_node_bytes", "tail_s", "compression_ratio",
                                    "inter_node_bytes"]  # fmt: skip


def test_bytes_inside_and_across_nodes_are_known_only_to_hierarchical_hooks() -> None:
    flat = BucketRecord(0, 0, 100, 0.0, sent_bytes=40, received_bytes=40, sent_estimate=40)
    node = BucketRecord(0, 1, 100, 0.0, sent_bytes=30, received_bytes=30, sent_estimate=30, intra_node_bytes=25)
    (alone,) = per_step([node])
    assert (alone.intra_node_bytes, alone.inter_node_bytes) == (25, 5)
    (mixed,) = per_step([flat, node])
    assert mixed.intra_node_bytes is None and mixed.inter_node_bytes is None


def test_records_are_values() -> None:
    step = StepStats.zero(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.input_bytes = 1  # type: ignore[misc]


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
