"""A training run's settings, refused when they cannot work, and the training script's command line,
which refuses a bad hook before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.run import main


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


def test_help_is_plain_text_with_the_real_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from gradcomp.experiments.training.run import command_parser

    text = command_parser().format_help()
    assert "``" not in text and "(default: None)" not in text
    assert "(default: 200)" in " ".join(text.split())  # --steps: the command line's default
    assert "--overwrite [OVERWRITE]" in text  # a flag: --overwrite alone means true
