"""A real 2-rank training run's artefacts (tests.training_runs): TensorBoard scalars and HParams,
run.json and a weights_only-loadable checkpoint, each saying what the run did."""

from __future__ import annotations

import json

import pytest
import torch

from gradcomp.engine.spec import HookSpec
from gradcomp.experiments.training import curves
from tests.training_runs import SETTINGS, STEPS, TrainingRun, scalars, tensors


@pytest.mark.timeout(240)
def test_a_run_writes_every_scalar_against_step_time_and_wire_bytes(straight_run: TrainingRun) -> None:
    events = scalars(straight_run.out)
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "comm/wire_bytes", "comm/compression_ratio", "eval/loss", "eval/accuracy"}
    expected |= {
        f"time/{part}_ms"
        for part in ("forward", "backward_comm", "optimizer", "step", "compress", "communicate", "decompress")
    }
    assert expected <= tags, expected - tags
    assert not [tag for tag in tags if tag.startswith("eval_vs")]  # TensorBoard's step is always the step
    assert "custom_scalars__config__" in events.Tags()["tensors"]  # the layout of shared charts
    metrics = straight_run.record["metrics"]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 10, 20, 30, 40]
    # Against training time and wire bytes: the curves file, with the same values as TensorBoard's
    evals = curves.read(str(straight_run.out), "eval")
    assert [p["step"] for p in evals] == [0, 10, 20, 30, 40]
    assert [p["accuracy"] for p in evals] == pytest.approx([e.value for e in events.Scalars("eval/accuracy")])
    sent = [p["wire_bytes"] for p in evals]
    assert sent[0] == 0 and sent == sorted(sent) and sent[-1] == metrics["wire_bytes"]
    times = [p["time_s"] for p in evals]
    assert times[0] == 0 and times == sorted(times) and times[-1] == pytest.approx(metrics["train_time_s"])
    trains = curves.read(str(straight_run.out), "train")
    assert [p["step"] for p in trains] == [e.step for e in events.Scalars("train/loss")]
    assert trains[-1]["loss"] == pytest.approx(metrics["train_loss"]) and trains[-1]["wire_bytes"] == sent[-1]
    accuracy = events.Scalars("eval/accuracy")
    assert accuracy[-1].value == pytest.approx(metrics["eval_accuracy"])
    assert accuracy[-1].value > accuracy[0].value + 0.3  # it learns
    # TensorBoard's "Relative" axis is training time: every event at origin + training seconds
    assert accuracy[-1].wall_time - accuracy[0].wall_time == pytest.approx(metrics["train_time_s"], abs=1e-3)
    ratios = [e.value for e in events.Scalars("comm/compression_ratio")]
    assert all(ratio > 5 for ratio in ratios)  # 5% of values, with their indices


@pytest.mark.timeout(240)
def test_a_run_writes_hparams_with_its_settings_and_final_metrics(straight_run: TrainingRun) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = scalars(straight_run.out).PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.session_start_info.hparams.items()}
    assert (
        hparams["hook"] == str(HookSpec.parse(SETTINGS["hook"]))
        and hparams["world_size"] == 2
        and hparams["network"] == "loopback"
    )
    assert hparams["lr"] == pytest.approx(0.05) and hparams["task"] == "digits"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {"final/eval_accuracy", "final/wire_bytes", "final/train_time_s"} <= {
        m.name.tag for m in experiment.metric_infos
    }


@pytest.mark.timeout(240)
def test_run_json_says_what_ran_where_and_how_it_ended(straight_run: TrainingRun) -> None:
    with open(straight_run.out / "run.json") as file:
        record = json.load(file)
    assert {k: v for k, v in record.items() if k != "updated"} == straight_run.record
    assert record["status"] == "finished" and record["world_size"] == 2 and record["resumed_from"] is None
    assert record["config"]["hook"] == str(HookSpec.parse(SETTINGS["hook"])) and record["config"]["steps"] == STEPS
    assert record["environment"]["torch"] == torch.__version__ and record["environment"]["python"]
    assert (
        record["task"]["headline"] == "eval_accuracy" and record["task"]["parameters"] == 64 * 128 + 128 + 128 * 10 + 10
    )
    metrics = record["metrics"]
    assert metrics["step"] == STEPS and 0 <= metrics["eval_accuracy"] <= 1
    assert metrics["wire_bytes"] > 0 and metrics["wire_bytes_estimated"] is False  # gather traffic is measured
    assert metrics["compression_ratio"] > 5 and metrics["train_time_s"] > 0
    for part in ("forward", "backward_comm", "optimizer", "compress", "communicate", "decompress"):
        assert metrics[f"{part}_ms"] > 0


@pytest.mark.timeout(240)
def test_the_checkpoint_holds_every_ranks_hook_state_and_loads_weights_only(straight_run: TrainingRun) -> None:
    checkpoint = torch.load(straight_run.out / "checkpoint.pt", weights_only=True)
    assert checkpoint["step"] == STEPS and checkpoint["world_size"] == 2
    assert {"model", "optimizer", "scheduler", "hooks", "rng", "progress"} <= set(checkpoint)
    assert len(checkpoint["hooks"]) == len(checkpoint["rng"]) == 2
    residuals = [tensors(state) for state in checkpoint["hooks"]]
    assert residuals[0] and len(residuals[0]) == len(residuals[1])
    assert any(not torch.equal(a, b) for a, b in zip(*residuals, strict=True))  # error feedback is per rank
    assert checkpoint["progress"]["wire_bytes"] == straight_run.record["metrics"]["wire_bytes"]
