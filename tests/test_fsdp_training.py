"""Sharded training runs (``--parallel fsdp``) on 2 real gloo ranks: FSDP2's own reduce-scatter
trains exactly as DDP's all-reduce does; 4-bit quantization with error feedback reaches the
uncompressed run's accuracy on the digits (within 1 point) with a fraction of the bytes, also with
8-bit weights in the parameter all-gather; a run
stopped and resumed ends bitwise where the run straight through does (sharded parameters, momentum
and the hook's residuals); bad sharded specs are refused before any rank starts. Only the
accuracies need :data:`SETTINGS`' 120 steps; the resumed run is compared bitwise at :data:`SHORT`'s 20."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.run import launch
from gradcomp.hooks import fsdp2
from tests.training_runs import same_checkpoints

pytestmark = pytest.mark.skipif(not fsdp2.available(), reason="this torch has no FSDP2 custom reduce-scatter")

SETTINGS: dict[str, Any] = {
    "task": "digits",
    "parallel": "fsdp",
    "steps": 120,
    "batch_size": 64,
    "optimizer": "sgd",
    "momentum": 0.9,
    "lr": 0.05,
    "schedule": "cosine",
    "ranks": 2,
    "seed": 1,
    "eval_every": 40,
    "log_every": 10,
    "timeout": 200,
    "group_timeout": 60,
}
SHORT: dict[str, Any] = {**SETTINGS, "steps": 20, "eval_every": 10}
"""The resumed run and its straight twin: stopped at :data:`STOP`, it evaluates after it."""
STOP = 8
QUANTIZED = "quantize:bits=4,ef=true"


def train(out: Path, hook: str, **changes: Any) -> dict[str, Any]:
    return launch(TrainConfig(**{**SETTINGS, **changes}, hook=hook, out=str(out)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    config = TrainConfig(**SHORT, hook=QUANTIZED, out=str(out / "resumed"), resume="auto")
    return {
        "out": out,
        "fsdp": train(out / "fsdp", "torch:reduce_scatter"),
        "ddp": train(out / "ddp", "torch:allreduce", parallel="ddp"),
        "quantized": train(out / "quantized", QUANTIZED),
        "weights": train(out / "weights", f"{QUANTIZED},param_bits=8"),
        "straight": train(out / "straight", QUANTIZED, **SHORT),
        "stopped": launch(dataclasses.replace(config, stop_at=STOP)),
        "resumed": launch(config),
    }


@pytest.mark.timeout(600)
def test_fsdp2s_own_reduce_scatter_trains_as_ddp_does(runs: dict[str, Any]) -> None:
    fsdp, ddp = runs["fsdp"]["metrics"], runs["ddp"]["metrics"]
    assert fsdp["eval_accuracy"] == ddp["eval_accuracy"]
    assert fsdp["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)
    # a reduce-scatter sends half of what an all-reduce does, at 2 ranks
    assert fsdp["wire_bytes"] == pytest.approx(ddp["wire_bytes"] / 2, rel=0.01)


@pytest.mark.timeout(600)
def test_4_bit_quantization_with_error_feedback_reaches_the_uncompressed_accuracy(runs: dict[str, Any]) -> None:
    quantized, exact = runs["quantized"]["metrics"], runs["fsdp"]["metrics"]
    assert exact["eval_accuracy"] > 0.9
    assert quantized["eval_accuracy"] >= exact["eval_accuracy"] - 0.01
    assert quantized["wire_bytes"] < exact["wire_bytes"] / 5  # 4-bit codes and a scale per 1024 values
    weights = runs["weights"]["metrics"]  # and 8-bit weights in every forward and backward (qwZ)
    assert weights["eval_accuracy"] >= exact["eval_accuracy"] - 0.01
    assert weights["train_loss"] != quantized["train_loss"]  # the weights were quantized


@pytest.mark.timeout(600)
def test_a_resumed_sharded_run_ends_bitwise_where_the_straight_run_does(runs: dict[str, Any]) -> None:
    assert runs["stopped"]["status"] == "stopped" and runs["resumed"]["resumed_from"] == STOP
    straight = torch.load(runs["out"] / "straight" / "checkpoint.pt", weights_only=True)
    ended = torch.load(runs["out"] / "resumed" / "checkpoint.pt", weights_only=True)
    assert (
        sorted(straight["model"])
        == sorted(ended["model"])
        == sorted(name for name, _ in build_digits_model().named_parameters())
    ), "the checkpoint holds the whole model, by its own parameter names"
    same_checkpoints(straight, ended)
    assert runs["resumed"]["metrics"]["eval_accuracy"] == runs["straight"]["metrics"]["eval_accuracy"]


def build_digits_model() -> torch.nn.Module:
    from gradcomp.experiments.tasks import build_task

    return build_task("digits").build_model(None)


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ("powersgd:rank=4,ef=true", "needs each tensor's shape"),
        ("auto", "auto chooses among DDP"),
        ("torch:powersgd", "unknown FSDP2 reduction"),
    ],
)
def test_bad_sharded_specs_are_refused_before_any_rank_starts(hook: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**SETTINGS, hook=hook)


def test_a_sharded_runs_hook_is_kept_in_its_canonical_text() -> None:
    assert TrainConfig(**SETTINGS).effective.hook == "none"  # the default, allreduce: the uncompressed reduce-scatter
    assert TrainConfig(**SETTINGS, hook="quantize:bits=4,ef=true,local_size=1").effective.hook.endswith("local_size=1")
