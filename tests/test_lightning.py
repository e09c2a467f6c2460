"""PyTorch Lightning with gradcomp's hook (``gradcomp.hooks.lightning``), 2 CPU processes started as
Lightning starts them (its own launcher re-runs the job's command for the second rank, gloo): the
hook averages every step, its statistics reach Lightning's logger, the ranks end identical, and a
run stopped at an epoch's end and resumed from Lightning's checkpoint ends bitwise where the run
straight through does (every rank's error-feedback residuals in the checkpoint). Lightning is a
declared extra of the development set-up (``gradcomp[lightning]``): without it these tests fail."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import lightning  # noqa: F401  (the extra: missing, this test fails rather than skips)
import pytest
import torch

SPEC = "topk:ratio=0.1,ef=true"
ROOT = Path(__file__).resolve().parents[1]


def job(out: Path, steps: int, resume: Path | None = None) -> None:
    """``tests/lightning_job.py`` as a user runs a script: Lightning starts the second rank itself."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "tests.lightning_job", str(out), SPEC, str(steps)]
    if resume is not None:
        command.append(str(resume))
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def parameters(out: Path, rank: int) -> list[torch.Tensor]:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


@pytest.mark.timeout(600)
def test_lightning_trains_with_a_gradcomp_hook_logs_it_and_resumes_bitwise(tmp_path: Path) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    job(straight, 6)
    rows = list(csv.DictReader((straight / "logs" / "version_0" / "metrics.csv").open()))
    logged = [row for row in rows if row.get("hook/wire_mb")]
    assert [int(row["step"]) for row in logged] == list(range(6)), "the hook's statistics at every step"
    assert all(float(row["hook/compression_ratio"]) > 3 for row in logged)
    assert all(torch.equal(a, b) for a, b in zip(parameters(straight, 0), parameters(straight, 1), strict=True))
    hooks_saved = torch.load(straight / "last.ckpt", weights_only=True)["callbacks"]["HookStatistics"]["ranks"]
    assert len(hooks_saved) == 2 and all(saved["compressor"] for saved in hooks_saved), "every rank's residuals"

    job(stopped, 3)  # one epoch, its checkpoint
    job(stopped, 6, resume=stopped / "last.ckpt")
    resumed = parameters(stopped, 0)
    assert all(torch.equal(a, b) for a, b in zip(resumed, parameters(straight, 0), strict=True))
