"""A training run's settings, refused when they cannot work, and the training script's command line,
which refuses a bad hook before any rank starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gradcomp.engine.spec import HookSpec
from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.run import main


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"hook": "topk:ratio=0.01,ef=true,warmup=100", "steps": 100}, "warmup=100 is the whole run"),
        ({"hook": "auto:candidates=topk:ratio=0.01,ef=true,warmup=50", "steps": 30}, "warmup=50 is the whole run"),
        ({}, "give steps or epochs"),
        ({"steps": 10, "epochs": 1.0}, "give steps or epochs"),
        ({"steps": 0}, "steps must be > 0"),
        ({"steps": 10, "lr": 0.0}, "lr must be > 0"),
        (
            {"steps": 10, "optimizer": "lion"},
            "unknown optimizer 'lion'; valid: sgd, nesterov, adam, adamw, compressed-adamw:freeze=...",
        ),
        ({"steps": 10, "schedule": "exp"}, "unknown schedule"),
        ({"steps": 10, "batch_size": 65, "ranks": 2}, "does not split evenly over 2 ranks"),
        ({"steps": 10, "task": "imagenet"}, "unknown task 'imagenet'"),
        ({"steps": 10, "model": "resnet18"}, "task 'digits' has no model 'resnet18'; valid: mlp, smallcnn"),
        ({"steps": 10, "task": "classify"}, "needs a data file"),
        ({"steps": 10, "task": "classify", "data": "/nonexistent.npz"}, "does not exist"),
        ({"steps": 10, "data": __file__}, "takes no data file"),
        ({"steps": 10, "backend": "mpi"}, "unknown backend"),
        ({"steps": 10, "momentum": 1.0}, "momentum must be < 1"),
        ({"steps": 10, "clip": -1.0}, "clip must be >= 0"),
        ({"steps": 10, "momentum": 0.9, "hook": "topk:ef=true,momentum=0.9"}, "momentum twice"),
        ({"steps": 10, "optimizer": "nesterov", "hook": "topk:ef=true,momentum=0.5"}, "momentum twice"),
        ({"steps": 10, "hook": "topk:ef=true,momentum=true"}, "takes the run's momentum, which is 0"),
        (
            {"steps": 10, "momentum": 0.9, "optimizer": "adam", "hook": "topk:ef=true,momentum=true"},
            "optimizer is adam",
        ),
        ({"steps": 10, "momentum": 0.9, "hook": "topk:momentum=true"}, "needs ef=true"),
        ({"steps": 10, "clip": 1.0, "hook": "topk:ef=true,clip=2"}, "clip twice"),
        ({"steps": 10, "clip": 1.0, "hook": "topk:ef=true,clip=0"}, "clip twice"),  # said off
        ({"steps": 10, "optimizer": "compressed-adamw:freeze=0"}, "freeze must be an integer >= 1"),
        ({"steps": 10, "optimizer": "compressed-adamw", "parallel": "fsdp", "hook": "none"}, "needs parallel ddp"),
        ({"steps": 10, "optimizer": "compressed-adamw", "sync": "diloco:every=5"}, "needs parallel ddp and sync none"),
        ({"steps": 10, "optimizer": "compressed-adamw", "hook": "torch:fp16"}, "the hook, a gradcomp spec"),
        ({"steps": 10, "optimizer": "compressed-adamw", "hook": "noop"}, "the hook, a gradcomp spec"),
        ({"steps": 10, "optimizer": "compressed-adamw", "hook": "sign:ef=true"}, "strand its residual"),
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


def test_the_runs_momentum_moves_into_a_hook_that_asks_for_it() -> None:
    """momentum=true: DGC's momentum correction takes the run's momentum; the optimizer goes without."""
    said = {"steps": 10, "momentum": 0.9, "hook": "topk:ratio=0.01,ef=true,momentum=true"}
    config = TrainConfig(**said)
    assert dataclasses.asdict(config) == {**dataclasses.asdict(TrainConfig(steps=1)), **said}  # kept as said
    effective = config.effective
    assert (effective.optimizer, effective.momentum) == ("sgd", 0.0)
    assert effective.hook == "topk:ratio=0.01,method=exact,tolerance=0.2,ef=true,momentum=0.9"
    assert config.to_dict() == dataclasses.asdict(effective)  # what run.json and checkpoints record
    assert config.hook_spec == HookSpec.parse(effective.hook)
    nesterov = TrainConfig(steps=10, optimizer="nesterov", hook="sign:ef=true,momentum=true").effective
    assert nesterov.hook == "sign:chunk=1024,ef=true,momentum=0.9,nesterov=true" and nesterov.optimizer == "sgd"
    assert TrainConfig(**config.to_dict()) == effective == effective.effective  # reads back the same


def test_the_runs_clipping_moves_into_a_hook_with_error_feedback() -> None:
    """With error feedback each rank clips its share before compression (the hook's clip); other
    hooks leave the averaged gradients to the run's clipping."""
    local = TrainConfig(steps=10, clip=2.0, hook="quantize:bits=2,ef=true")
    assert local.effective.hook.endswith("ef=true,clip=2.0") and not local.clips_averaged
    assert local.hook == "quantize:bits=2,ef=true"  # what was said stays
    averaged = TrainConfig(steps=10, clip=2.0, hook="fp16")
    assert averaged.effective.hook == "fp16" and averaged.clips_averaged
    assert not TrainConfig(steps=10, hook="quantize:bits=2,ef=true").clips_averaged


def test_a_batch_larger_than_the_data_is_refused_before_the_run_directory_is_claimed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 48, item 8: as ``sweep --dry-run`` refuses it, in one line, no rank started, and the same
    directory takes the corrected run without ``--overwrite``."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["--batch-size", "100000", "--steps", "5", "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "batch size 100000 is larger than the" in err
    assert "Traceback" not in err and "rank" not in err
    assert not out.exists()
