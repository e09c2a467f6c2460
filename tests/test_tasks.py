"""The experiments' tasks: scikit-learn's digits, generated signals, Python's own text, and own data
files; each batched in a seeded order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gradcomp.experiments.tasks import build_task, parse_task
from gradcomp.experiments.tasks.classify import load as load_dataset
from gradcomp.experiments.tasks.signal import generate


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
