"""Resuming a real 2-rank training run (tests.training_runs): stopped at step 17 and resumed, it must
end bitwise where the run straight through does, continue its curves without duplicates, and refuse
a checkpoint written with other settings."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

from gradcomp.experiments.training import curves
from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.run import launch
from tests.training_runs import SETTINGS, STOP, TrainingRun, scalars, tensors


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run stopped at STOP (its record and checkpoint), then resumed to the end (its record)."""
    out = tmp_path_factory.mktemp("runs") / "resumed"
    config = TrainConfig(**SETTINGS, out=str(out), resume="auto")
    stopped = launch(dataclasses.replace(config, stop_at=STOP))
    stopped_checkpoint = torch.load(config.checkpoint_path, weights_only=True)
    return {"out": out, "stopped": stopped, "stopped_checkpoint": stopped_checkpoint, "resumed": launch(config)}


@pytest.mark.timeout(240)
def test_a_resumed_run_ends_bitwise_where_the_straight_run_does(
    straight_run: TrainingRun, resumed: dict[str, Any]
) -> None:
    assert resumed["stopped"]["status"] == "stopped" and resumed["stopped"]["metrics"]["step"] == STOP
    assert resumed["stopped_checkpoint"]["step"] == STOP
    assert resumed["resumed"]["status"] == "finished" and resumed["resumed"]["resumed_from"] == STOP
    straight = torch.load(straight_run.out / "checkpoint.pt", weights_only=True)
    ended = torch.load(resumed["out"] / "checkpoint.pt", weights_only=True)
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, ended["model"][name]), name
    for a, b in zip(tensors(straight["hooks"]), tensors(ended["hooks"]), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(tensors(straight["optimizer"]), tensors(ended["optimizer"]), strict=True):
        assert torch.equal(a, b)
    assert ended["progress"]["wire_bytes"] == straight["progress"]["wire_bytes"]
    assert resumed["resumed"]["metrics"]["eval_accuracy"] == straight_run.record["metrics"]["eval_accuracy"]


@pytest.mark.timeout(240)
def test_a_resumed_run_continues_its_curves_without_duplicates(
    straight_run: TrainingRun, resumed: dict[str, Any]
) -> None:
    events = scalars(resumed["out"])
    # the stopped and the resumed run's event files, read in their names' order: both may be named in
    # the same second, so the points are compared as a set of steps (TensorBoard plots them by step)
    for tag in ("train/loss", "eval/accuracy", "comm/wire_bytes"):
        steps = [e.step for e in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
    assert sorted(e.step for e in events.Scalars("eval/accuracy")) == [0, 10, STOP, 20, 30, 40]
    points = curves.read(str(resumed["out"]))
    for kind in ("train", "eval"):
        steps = [p["step"] for p in points if p["kind"] == kind]
        assert steps == sorted(set(steps)), (kind, steps)
    evals = [p for p in points if p["kind"] == "eval"]
    assert [p["step"] for p in evals] == [0, 10, STOP, 20, 30, 40]
    wire = [p["wire_bytes"] for p in evals]
    assert wire == sorted(wire) and wire[-1] == straight_run.record["metrics"]["wire_bytes"]
    # the loss window that the stop split (steps 16-20) differs; all others are the straight run's
    same = {5, 10, 15, 25, 30, 35, 40}
    straight = scalars(straight_run.out)
    resumed_loss = {e.step: e.value for e in events.Scalars("train/loss") if e.step in same}
    straight_loss = {e.step: e.value for e in straight.Scalars("train/loss") if e.step in same}
    assert sorted(resumed_loss) == sorted(same)
    assert resumed_loss == pytest.approx(straight_loss)  # by step: the files' order may be either
    hparams = events.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams  # written once, by the run that finished


@pytest.mark.timeout(240)
def test_resuming_with_other_settings_is_refused(straight_run: TrainingRun) -> None:
    from gradcomp.experiments.training import checkpoint

    path = str(straight_run.out / "checkpoint.pt")
    other = TrainConfig(**{**SETTINGS, "lr": 0.1}, out=str(straight_run.out))
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.05 -> 0.1\)"):
        checkpoint.load(path, other, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="written by 2 ranks"):
        checkpoint.load(path, TrainConfig(**SETTINGS), 4, torch.device("cpu"))
    assert os.path.isfile(path)
    # through the launcher: refused before any rank starts, one error, the run left as it was
    record = (straight_run.out / "run.json").read_text()
    resumed = TrainConfig(**{**SETTINGS, "lr": 0.1}, out=str(straight_run.out), resume="auto")
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.05 -> 0.1\)"):
        launch(resumed)
    assert (straight_run.out / "run.json").read_text() == record


@pytest.mark.timeout(240)
def test_a_dgc_run_resumed_inside_its_warm_up_ends_bitwise(tmp_path: os.PathLike[str]) -> None:
    """Momentum moved into the hook (momentum=true), local clipping, and a ratio warm-up of 20 steps:
    stopped at step 17, inside the warm-up, and resumed, the run ends bitwise where the run straight
    through does (velocities, residuals, the engine's step count and the ratio schedule all resume)."""
    settings = {**SETTINGS, "hook": "topk:ratio=0.05,ef=true,momentum=true,warmup=20", "clip": 1.0}
    effective = TrainConfig(**settings).effective
    assert effective.hook.endswith("ef=true,momentum=0.9,clip=1.0,warmup=20") and effective.momentum == 0.0
    _, ended = _straight_and_resumed(settings, tmp_path)
    for rank_state in ended["hooks"]:  # every rank's hook state holds its velocities and the step count
        assert rank_state["compressor"]["velocities"] and rank_state["engine"]["steps"] == SETTINGS["steps"]


@pytest.mark.timeout(240)
def test_a_compressed_adamw_run_resumed_after_its_freeze_ends_bitwise(tmp_path: os.PathLike[str]) -> None:
    """AdamW whose momentum travels as signs after 10 uncompressed steps, stopped at step 17 (past the
    freeze: error feedback's residuals per rank, the frozen variance) and resumed: it ends bitwise
    where the run straight through does, having sent the gradient for 10 steps and signs after."""
    optimizer = "compressed-adamw:freeze=10,carrier=sign:ef=true"
    settings = {**SETTINGS, "hook": "allreduce", "optimizer": optimizer, "momentum": 0.0, "lr": 3e-3}
    record, ended = _straight_and_resumed(settings, tmp_path)
    gradient_bytes = 4 * sum(t.numel() for t in tensors(ended["model"]))
    sent = record["metrics"]["wire_bytes"]  # 10 steps of the all-reduce (a ring's count), then signs
    assert 10 * gradient_bytes <= sent < (10 + (SETTINGS["steps"] - 10) / 20) * gradient_bytes


def _straight_and_resumed(settings: dict[str, Any], tmp_path: os.PathLike[str]) -> tuple[dict[str, Any], Any]:
    """Run ``settings`` straight through, and again stopped at :data:`STOP` and resumed; assert that
    both end bitwise alike (model, every rank's hook state, optimizer); the straight run's record and
    the resumed run's final checkpoint."""
    straight = TrainConfig(**settings, out=os.path.join(tmp_path, "straight"))
    record = launch(straight)
    config = TrainConfig(**settings, out=os.path.join(tmp_path, "resumed"), resume="auto")
    assert launch(dataclasses.replace(config, stop_at=STOP))["status"] == "stopped"
    assert launch(config)["resumed_from"] == STOP
    expected = torch.load(straight.checkpoint_path, weights_only=True)
    ended = torch.load(config.checkpoint_path, weights_only=True)
    for part in ("model", "hooks", "optimizer"):
        for a, b in zip(tensors(expected[part]), tensors(ended[part]), strict=True):
            assert torch.equal(a, b), part
    return record, ended
