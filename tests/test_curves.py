"""A run's curves file and TensorBoard events after a resume: what the interrupted run wrote after its
checkpoint is gone, what came before stays, and nothing is doubled."""

from __future__ import annotations

from pathlib import Path

from gradcomp.experiments.training import curves
from gradcomp.experiments.training.metrics import TensorBoardWriter
from tests.training_runs import scalars


def write(logdir: Path, steps: range, resume_step: int | None = None) -> None:
    writer = TensorBoardWriter(str(logdir), origin=1_000.0, resume_step=resume_step)
    for step in steps:
        writer.scalars({"train/loss": 1.0 / step}, step, elapsed=0.1 * step)
        writer.points("train", {"loss": 1.0 / step}, step, elapsed=0.1 * step, wire_bytes=100 * step)
    writer.close()


def test_a_resume_drops_what_the_interrupted_run_wrote_after_its_checkpoint(tmp_path: Path) -> None:
    write(tmp_path, range(1, 11))  # interrupted after step 10; its last checkpoint was at step 6
    write(tmp_path, range(7, 13), resume_step=6)
    events = scalars(tmp_path)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))
    points = curves.read(str(tmp_path))
    assert [p["step"] for p in points] == list(range(1, 13))
    assert [p["wire_bytes"] for p in points] == [100 * s for s in range(1, 13)]
    assert points[0] == {"kind": "train", "step": 1, "time_s": 0.1, "wire_bytes": 100, "loss": 1.0}


def test_non_finite_values_stay_out_of_the_curves_and_kinds_filter(tmp_path: Path) -> None:
    log = curves.Curves(str(tmp_path))
    log.append("eval", {"accuracy": 0.5, "loss": float("nan")}, 3, 1.5, 42)
    log.append("train", {"loss": 2.0}, 4, 2.0, 50)
    expected = {"kind": "eval", "step": 3, "time_s": 1.5, "wire_bytes": 42, "accuracy": 0.5}
    assert curves.read(str(tmp_path), "eval") == [expected]
    assert [p["kind"] for p in curves.read(str(tmp_path))] == ["eval", "train"]
    assert curves.read(str(tmp_path / "absent")) == []
