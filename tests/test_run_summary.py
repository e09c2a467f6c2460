"""``state.summary()`` (:class:`gradcomp.state.RunSummary`): a run's totals, equal to its steps'
:class:`StepStats` summed by hand, with a figure None where a step could not observe it. The same
on a real run's hook, through the Hugging Face Trainer: tests/test_hf_trainer.py."""

from __future__ import annotations

import math

from gradcomp.engine.stats import StepStats
from gradcomp.state import RunSummary, RunTotals

MEASURED = StepStats(4, buckets=2, input_bytes=4_000_000, payload_bytes=100_000, sent_bytes=100_000,
                     received_bytes=100_000, sent_estimate=100_000.0, communicate_s=0.02,
                     intra_node_bytes=40_000.0)  # fmt: skip
NATIVE = StepStats(5, buckets=2, input_bytes=4_000_000, payload_bytes=400_000, sent_bytes=None, received_bytes=None,
                   sent_estimate=400_000.0, communicate_s=0.01, intra_node_bytes=0.0)  # fmt: skip


def test_a_summary_is_its_steps_summed_by_hand() -> None:
    summary = RunSummary.of([MEASURED, NATIVE])
    assert (summary.steps, summary.first_step, summary.last_step) == (2, 4, 5)
    assert summary.input_bytes == 8_000_000 and summary.payload_bytes == 500_000
    assert summary.wire_bytes == 100_000 + 400_000, "each step's own: measured, or the estimate"
    assert summary.inter_node_bytes == 60_000 + 400_000
    assert summary.compression_ratio == 16.0, "the run's bytes against the uncompressed"
    assert summary.mean_ratio == (40.0 + 10.0) / 2, "the steps' ratios, averaged"
    assert math.isclose(summary.communicate_s or 0, 0.03)
    assert summary.to_dict()["compression_ratio"] == 16.0
    assert str(summary) == (
        "2 steps (4-5): 500 kB sent, 500 kB of payload for 8 MB of gradients (16.0x fewer bytes, "
        "25.0x a step on average), 460 kB across nodes, 0.030 s communicating"
    )


def test_what_a_step_could_not_observe_stays_unknown() -> None:
    untimed = StepStats(6, buckets=None, input_bytes=1000, payload_bytes=500, sent_bytes=None, received_bytes=None,
                        sent_estimate=500.0, compress_s=None, communicate_s=None, decompress_s=None,
                        host_reads=None, tail_s=None)  # fmt: skip
    summary = RunSummary.of([MEASURED, untimed])
    assert summary.communicate_s is None and summary.host_reads is None and summary.inter_node_bytes is None
    assert summary.wire_bytes == 100_500
    assert "communicating" not in str(summary) and "across nodes" not in str(summary)


def test_an_empty_run_and_one_without_payload() -> None:
    assert RunSummary.of([]).steps == 0 and str(RunSummary.of([])) == "no step averaged"
    nothing = RunSummary.of([StepStats(0, input_bytes=1000)])
    assert nothing.compression_ratio == math.inf and nothing.mean_ratio == math.inf
    assert str(nothing).startswith("1 step (0): 0 B sent")


class Forgetful:
    """A state that keeps the latest 2 steps only, as every state keeps a bounded history."""

    def __init__(self) -> None:
        self.kept: list[StepStats] = []

    def record(self, step: StepStats) -> None:
        self.kept = [*self.kept, step][-2:]

    def steps_since(self, first: int) -> list[StepStats]:
        return [step for step in self.kept if step.step >= first]


def test_run_totals_keep_a_run_longer_than_the_history() -> None:
    state, totals = Forgetful(), RunTotals()
    run = [StepStats(i, buckets=1, input_bytes=1000, payload_bytes=100 * (1 + i % 2), sent_bytes=100,
                     received_bytes=100, sent_estimate=100.0) for i in range(7)]  # fmt: skip
    for step in run:
        state.record(step)
        if step.step % 2 == 0:  # every other step is enough with a history of 2
            totals.update(state)  # type: ignore[arg-type]
    assert totals.summary() == RunSummary.of(run), "every step once"
    assert RunSummary.of(state.kept).steps == 2, "what the history alone covers"
