"""Experiments: models, tasks, run settings, and real 2-rank training runs with every artefact.

The distributed part trains the digits MLP three times at 2 gloo ranks with top-k and error
feedback, momentum and a cosine schedule (so the optimizer, the schedule and the hook all carry
state): once straight through, once stopped at step 17 and resumed. The resumed run must end
bitwise where the straight one does, and every artefact (TensorBoard scalars and HParams,
run.json, a weights_only-loadable checkpoint) must say what the run did.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradcomp.engine.spec import HookSpec
from gradcomp.experiments import models
from gradcomp.experiments.tasks import build_task, parse_task
from gradcomp.experiments.tasks.classify import load as load_dataset
from gradcomp.experiments.tasks.signal import generate
from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.run import launch, main

# -- models -------------------------------------------------------------------------------------


def test_benchmark_mlp_has_the_documented_size() -> None:
    assert models.parameter_count(models.MLP(1024, [2048, 2048], 10)) == 6_316_042


def test_resnet18_is_the_cifar_variant() -> None:
    net = models.ResNet18()
    assert models.parameter_count(net) == 11_173_962
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert models.ResNet18(num_classes=7, in_channels=1)(torch.randn(1, 1, 16, 16)).shape == (1, 7)


def test_small_models_fit_their_tasks() -> None:
    assert models.SmallCNN()(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    assert models.SignalCNN()(torch.randn(3, 1, 128)).shape == (3, 10)
    assert set(models.MODELS) >= {"mlp", "resnet18", "smallcnn", "signalcnn", "chartransformer"}


def test_char_transformer_is_causal() -> None:
    torch.manual_seed(0)
    net = models.CharTransformer(vocab_size=30, context=16, d_model=32, heads=4, layers=2)
    tokens = torch.randint(0, 30, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 30
    before, after = net(tokens), net(changed)
    assert before.shape == (2, 16, 30)
    assert torch.equal(before[:, :10], after[:, :10])  # the past never sees the future
    assert not torch.allclose(before[:, 10:], after[:, 10:])
    with pytest.raises(ValueError, match="longer than the context"):
        net(torch.zeros(1, 17, dtype=torch.long))


# -- tasks --------------------------------------------------------------------------------------


def test_digits_are_scikit_learns() -> None:
    from sklearn.datasets import load_digits

    task = build_task("digits")
    digits = load_digits()
    x = torch.cat([task.train_x, task.eval_x]).flatten(1) * 16  # type: ignore[attr-defined]
    y = torch.cat([task.train_y, task.eval_y])  # type: ignore[attr-defined]
    order = torch.tensor(digits.data, dtype=torch.float32)
    assert len(x) == 1797 and len(task.eval_set()[0]) == 397
    # the same 1,797 images, each with its label (the split only reorders them)
    ours = sorted(zip(map(tuple, x.tolist()), y.tolist(), strict=True))
    theirs = sorted(zip(map(tuple, order.tolist()), digits.target.tolist(), strict=True))
    assert ours == theirs


def test_an_epoch_visits_every_training_sample_once_in_a_seeded_order() -> None:
    task = build_task("digits")
    per_epoch = task.steps_per_epoch(100)
    assert per_epoch == 14
    seen = torch.cat([task.batch(step, 100, seed=5)[1] for step in range(per_epoch)])
    assert len(seen) == 1400
    assert torch.equal(seen.sort().values, task.train_y.sort().values)  # type: ignore[attr-defined]
    assert torch.equal(task.batch(3, 100, 5)[0], build_task("digits").batch(3, 100, 5)[0])
    assert not torch.equal(task.batch(3, 100, 5)[0], task.batch(3, 100, 6)[0])
    assert not torch.equal(task.batch(0, 100, 5)[0], task.batch(per_epoch, 100, 5)[0])  # a new order each epoch


def test_signals_are_generated_deterministically_up_to_100k() -> None:
    x, y = generate(2000, 128, 1.25, seed=0)
    again, labels = generate(2000, 128, 1.25, seed=0)
    other, _ = generate(2000, 128, 1.25, seed=1)
    assert x.shape == (2000, 1, 128) and torch.equal(x, again) and torch.equal(y, labels)
    assert not torch.equal(x, other)
    counts = torch.bincount(y, minlength=10)
    assert counts.min() > 150  # all ten classes, roughly balanced
    _, options = parse_task("signal:samples=100000")
    assert options.samples == 100_000
    with pytest.raises(ValueError, match=r"samples must be in 100\.\.100000"):
        parse_task("signal:samples=100001")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['frequency'\] for task 'signal'"):
        parse_task("signal:frequency=3")
    with pytest.raises(ValueError, match="'noise' must be a finite number"):
        parse_task("signal:noise=inf")


def test_the_language_model_text_ships_with_python_and_is_reproducible() -> None:
    import platform

    task = build_task("charlm:chars=50000,context=32")
    again = build_task("charlm:chars=50000,context=32")
    assert task.info["python"] == platform.python_version()
    assert task.info["sha256"] == again.info["sha256"] and len(task.info["sha256"]) == 64
    assert "argparse.py" in task.info["modules"]
    x, y = task.batch(7, 4, seed=0)
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    assert not torch.equal(x, task.batch(7, 4, seed=1)[0]) and not torch.equal(x, task.batch(8, 4, seed=0)[0])
    metrics = task.eval_metrics(torch.tensor([2.0 * 100, 30.0, 100.0]))
    assert metrics["perplexity"] == pytest.approx(np.exp(2.0))


def test_own_data_in_npz_and_pt_files(tmp_path: Path) -> None:
    x = np.random.default_rng(0).normal(size=(50, 3, 20)).astype(np.float32)
    y = np.arange(50) % 4
    np.savez(tmp_path / "data.npz", x=x, y=y)
    torch.save({"x": torch.from_numpy(x), "y": torch.from_numpy(y), "x_eval": torch.zeros(5, 3, 20),
                "y_eval": torch.zeros(5, dtype=torch.long)}, tmp_path / "data.pt")  # fmt: skip
    task = build_task("classify", str(tmp_path / "data.npz"))
    assert task.info["classes"] == 4 and len(task.eval_set()[0]) == 5  # a tenth held out
    assert set(task.models) == {"mlp", "signalcnn"}  # (N, channels, length): 1-D models
    assert task.build_model("signalcnn")(task.batch(0, 8, 0)[0]).shape == (8, 4)
    fixed = build_task("classify", str(tmp_path / "data.pt"))
    assert len(fixed.eval_set()[0]) == 5 and len(fixed.train_x) == 50  # type: ignore[attr-defined]
    np.savez(tmp_path / "labels.npz", x=x, y=y.astype(np.float32))
    with pytest.raises(ValueError, match="y must be integer labels"):
        load_dataset(str(tmp_path / "labels.npz"))
    np.savez(tmp_path / "nolabels.npz", x=x)
    with pytest.raises(ValueError, match="missing"):
        load_dataset(str(tmp_path / "nolabels.npz"))
    with pytest.raises(ValueError, match=r"\.pt or \.npz"):
        load_dataset(str(tmp_path / "data.csv"))


# -- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "give steps or epochs"),
        ({"steps": 10, "epochs": 1.0}, "give steps or epochs"),
        ({"steps": 0}, "steps must be > 0"),
        ({"steps": 10, "lr": 0.0}, "lr must be > 0"),
        ({"steps": 10, "optimizer": "lion"}, "unknown optimizer 'lion'; valid: sgd, nesterov, adam, adamw"),
        ({"steps": 10, "schedule": "exp"}, "unknown schedule"),
        ({"steps": 10, "batch_size": 65, "ranks": 2}, "does not split evenly over 2 ranks"),
        ({"steps": 10, "task": "imagenet"}, "unknown task 'imagenet'"),
        ({"steps": 10, "model": "resnet18"}, "task 'digits' has no model 'resnet18'; valid: mlp, smallcnn"),
        ({"steps": 10, "task": "classify"}, "needs a data file"),
        ({"steps": 10, "task": "classify", "data": "/nonexistent.npz"}, "does not exist"),
        ({"steps": 10, "data": __file__}, "takes no data file"),
        ({"steps": 10, "backend": "mpi"}, "unknown backend"),
        ({"steps": 10, "momentum": 1.0}, "momentum must be < 1"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TrainConfig(**settings)


def test_the_script_refuses_a_bad_hook_before_starting_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["--hook", "topk:ratio=2", "--steps", "5", "--out", str(out)])
    assert exit_.value.code == 2
    assert "ratio must be in (0, 1]" in capsys.readouterr().err
    assert not out.exists()


# -- real runs ----------------------------------------------------------------------------------

STEPS, STOP = 40, 17
SETTINGS = {
    "task": "digits",
    "steps": STEPS,
    "batch_size": 32,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.05,
    "schedule": "cosine",
    "warmup_steps": 5,
    "hook": "topk:ratio=0.05,ef=true",
    "ranks": 2,
    "seed": 3,
    "eval_every": 10,
    "log_every": 5,
    "timeout": 120,
    "group_timeout": 60,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("runs")
    straight = TrainConfig(**SETTINGS, out=str(root / "straight"))
    resumed = TrainConfig(**SETTINGS, out=str(root / "resumed"), resume="auto")
    results = {"straight": launch(straight)}
    results["stopped"] = launch(dataclasses.replace(resumed, stop_at=STOP))
    results["stopped_checkpoint"] = torch.load(resumed.checkpoint_path, weights_only=True)
    results["resumed"] = launch(resumed)
    return {"root": root, **results}


def _scalars(directory: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return events


@pytest.mark.timeout(240)
def test_a_run_writes_every_scalar_against_step_time_and_wire_bytes(runs: dict[str, Any]) -> None:
    events = _scalars(runs["root"] / "straight")
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "comm/wire_bytes", "comm/compression_ratio"}
    expected |= {
        f"{group}/{m}" for group in ("eval", "eval_vs_time_ms", "eval_vs_wire_bytes") for m in ("loss", "accuracy")
    }
    expected |= {
        f"time/{part}_ms"
        for part in ("forward", "backward_comm", "optimizer", "step", "compress", "communicate", "decompress")
    }
    assert expected <= tags, expected - tags
    metrics = runs["straight"]["metrics"]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 10, 20, 30, 40]
    by_bytes = [e.step for e in events.Scalars("eval_vs_wire_bytes/accuracy")]
    assert by_bytes[0] == 0 and by_bytes == sorted(by_bytes) and by_bytes[-1] == metrics["wire_bytes"]
    by_time = [e.step for e in events.Scalars("eval_vs_time_ms/accuracy")]
    assert by_time == sorted(by_time) and by_time[-1] == round(1000 * metrics["train_time_s"])
    accuracy = events.Scalars("eval/accuracy")
    assert accuracy[-1].value == pytest.approx(metrics["eval_accuracy"])
    assert accuracy[-1].value > accuracy[0].value + 0.3  # it learns
    # TensorBoard's "Relative" axis is training time: every event at origin + training seconds
    assert accuracy[-1].wall_time - accuracy[0].wall_time == pytest.approx(metrics["train_time_s"], abs=1e-3)
    ratios = [e.value for e in events.Scalars("comm/compression_ratio")]
    assert all(ratio > 5 for ratio in ratios)  # 5% of values, with their indices


@pytest.mark.timeout(240)
def test_a_run_writes_hparams_with_its_settings_and_final_metrics(runs: dict[str, Any]) -> None:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = _scalars(runs["root"] / "straight").PluginTagToContent("hparams")
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
def test_run_json_says_what_ran_where_and_how_it_ended(runs: dict[str, Any]) -> None:
    with open(runs["root"] / "straight" / "run.json") as file:
        record = json.load(file)
    assert {k: v for k, v in record.items() if k != "updated"} == runs["straight"]
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
def test_the_checkpoint_holds_every_ranks_hook_state_and_loads_weights_only(runs: dict[str, Any]) -> None:
    checkpoint = torch.load(runs["root"] / "straight" / "checkpoint.pt", weights_only=True)
    assert checkpoint["step"] == STEPS and checkpoint["world_size"] == 2
    assert {"model", "optimizer", "scheduler", "hooks", "rng", "progress"} <= set(checkpoint)
    assert len(checkpoint["hooks"]) == len(checkpoint["rng"]) == 2
    residuals = [_tensors(state) for state in checkpoint["hooks"]]
    assert residuals[0] and len(residuals[0]) == len(residuals[1])
    assert any(not torch.equal(a, b) for a, b in zip(*residuals, strict=True))  # error feedback is per rank
    assert checkpoint["progress"]["wire_bytes"] == runs["straight"]["metrics"]["wire_bytes"]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in _tensors(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.timeout(240)
def test_a_resumed_run_ends_bitwise_where_the_straight_run_does(runs: dict[str, Any]) -> None:
    assert runs["stopped"]["status"] == "stopped" and runs["stopped"]["metrics"]["step"] == STOP
    assert runs["stopped_checkpoint"]["step"] == STOP
    assert runs["resumed"]["status"] == "finished" and runs["resumed"]["resumed_from"] == STOP
    straight = torch.load(runs["root"] / "straight" / "checkpoint.pt", weights_only=True)
    resumed = torch.load(runs["root"] / "resumed" / "checkpoint.pt", weights_only=True)
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name
    for a, b in zip(_tensors(straight["hooks"]), _tensors(resumed["hooks"]), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_tensors(straight["optimizer"]), _tensors(resumed["optimizer"]), strict=True):
        assert torch.equal(a, b)
    assert resumed["progress"]["wire_bytes"] == straight["progress"]["wire_bytes"]
    assert runs["resumed"]["metrics"]["eval_accuracy"] == runs["straight"]["metrics"]["eval_accuracy"]


@pytest.mark.timeout(240)
def test_a_resumed_run_continues_its_curves_without_duplicates(runs: dict[str, Any]) -> None:
    events = _scalars(runs["root"] / "resumed")
    for tag in ("train/loss", "eval/accuracy", "comm/wire_bytes"):
        steps = [e.step for e in events.Scalars(tag)]
        assert steps == sorted(set(steps)), (tag, steps)
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 10, STOP, 20, 30, 40]
    wire = [e.step for e in events.Scalars("eval_vs_wire_bytes/accuracy")]
    assert wire == sorted(wire) and wire[-1] == runs["straight"]["metrics"]["wire_bytes"]
    # the loss window that the stop split (steps 16-20) differs; all others are the straight run's
    same = {5, 10, 15, 25, 30, 35, 40}
    straight = _scalars(runs["root"] / "straight")
    assert [e.value for e in events.Scalars("train/loss") if e.step in same] == pytest.approx(
        [e.value for e in straight.Scalars("train/loss") if e.step in same]
    )
    hparams = events.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hparams  # written once, by the run that finished


def test_resuming_with_other_settings_is_refused(runs: dict[str, Any]) -> None:
    from gradcomp.experiments.training import checkpoint

    path = str(runs["root"] / "straight" / "checkpoint.pt")
    other = TrainConfig(**{**SETTINGS, "lr": 0.1}, out=str(runs["root"] / "straight"))
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.05 -> 0.1\)"):
        checkpoint.load(path, other, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="written by 2 ranks"):
        checkpoint.load(path, TrainConfig(**SETTINGS), 4, torch.device("cpu"))
    assert os.path.isfile(path)
