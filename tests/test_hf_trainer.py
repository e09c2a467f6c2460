"""The Hugging Face Trainer with gradcomp's callback (``gradcomp.hooks.hf_trainer``), 2 CPU processes
started by ``accelerate launch`` (gloo), a GPT-2 built from a small config: with the ``allreduce`` hook
the Trainer ends bitwise where plain DDP does; top-k with error feedback logs its statistics with the
Trainer's, its ranks end identical, every rank's hook state is in the Trainer's checkpoint, and a run
resumed from it ends bitwise where the run straight through does, residuals included;
``CompressedAdamW`` as the Trainer's optimizer (clipped per rank after the freeze) keeps the ranks
identical and resumes bitwise. ``summary()`` of the run equals its steps summed by hand. transformers
is a declared extra of the development set-up (``gradcomp[transformers]``): without it these tests fail."""

from __future__ import annotations

import json
import math
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # noqa: F401  (the extra: missing, this test fails rather than skips)

from tests.jobs import alike, rank_parameters, run_job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def same(a: Any, b: Any) -> bool:
    """Whether two saved states are the same, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests/hf_trainer_job.py`` as a user launches a script (``accelerate launch``, two processes)."""
    path = tmp_path_factory.mktemp("hf_trainer")
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert launcher, "accelerate launch is not installed beside this Python"
    run_job([launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
             "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
             "-m", "tests.hf_trainer_job", str(path)], path)  # fmt: skip
    return path


@pytest.mark.timeout(300)
def test_the_allreduce_hook_through_the_trainer_is_plain_ddp_bitwise(out: Path) -> None:
    plain = rank_parameters(out / "plain", 0)
    assert alike(rank_parameters(out / "allreduce", 0), plain)
    assert alike(rank_parameters(out / "allreduce", 1), plain)
    assert not alike(plain, rank_parameters(out / "straight", 0)), "top-k trains otherwise: the hook is in use"


@pytest.mark.timeout(300)
def test_the_callback_logs_keeps_every_ranks_state_and_resumes_bitwise(out: Path) -> None:
    straight, resumed = out / "straight", out / "resumed"
    assert alike(rank_parameters(straight, 0), rank_parameters(straight, 1))
    logged = [entry for entry in json.loads((straight / "log.json").read_text()) if "hook/wire_mb" in entry]
    assert [entry["step"] for entry in logged] == [1, 2, 3, 4, 5, 6], "every logging step"
    assert all(entry["hook/compression_ratio"] > 3 for entry in logged)
    losses = [entry for entry in json.loads((straight / "log.json").read_text()) if "loss" in entry]
    assert len(losses) == 6, "the Trainer's own lines are still there"
    for rank in (0, 1):
        saved = torch.load(straight / "checkpoint-3" / f"gradcomp_rank{rank}.pt", weights_only=True)
        residuals = saved["hook"]["compressor"]["residuals"]
        assert saved["step"] == 3 and residuals and any(r["residual"].abs().sum() > 0 for r in residuals)
        # resumed from that checkpoint: the same parameters and the same hook state at the end
        assert alike(rank_parameters(resumed, rank), rank_parameters(straight, rank))
        final = torch.load(resumed / f"hook{rank}.pt", weights_only=True)
        assert same(final["compressor"], torch.load(straight / f"hook{rank}.pt", weights_only=True)["compressor"])
    ranks = [torch.load(straight / "checkpoint-3" / f"gradcomp_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert not same(ranks[0]["hook"]["compressor"], ranks[1]["hook"]["compressor"]), "each rank's own residuals"


@pytest.mark.timeout(300)
def test_compressed_adamw_as_the_trainers_optimizer_keeps_the_ranks_identical_and_resumes(out: Path) -> None:
    adamw, resumed = out / "adamw", out / "adamw_resumed"
    assert alike(rank_parameters(adamw, 0), rank_parameters(adamw, 1))
    assert not alike(rank_parameters(adamw, 0), rank_parameters(out / "plain", 0))
    saved = torch.load(adamw / "checkpoint-3" / "gradcomp_rank0.pt", weights_only=True)["hook"]
    assert saved["compressor"]["residuals"], "past the freeze: the carrier's residuals"
    for rank in (0, 1):
        assert alike(rank_parameters(resumed, rank), rank_parameters(adamw, rank))


@pytest.mark.timeout(300)
def test_the_documented_10x_recipe_freezes_where_measured_and_resumes_before_the_freeze(out: Path) -> None:
    """docs/hooks.md's 10x recipe through the Trainer: ``freeze="auto"`` finds the step (a check every
    10 steps, never the first) and compresses after it, the ranks end identical, and a run resumed from
    the checkpoint of the last check before the freeze (whose snapshot of the variance, in the
    Trainer's optimizer state, the freeze is measured against) freezes at the same step and ends
    bitwise where the run straight through does."""
    recipe, resumed = out / "recipe", out / "recipe_resumed"
    frozen_at = json.loads((recipe / "frozen.json").read_text())["frozen_at"]
    assert frozen_at % 10 == 0 and 20 <= frozen_at < 50, frozen_at
    assert json.loads((resumed / "frozen.json").read_text())["frozen_at"] == frozen_at
    for rank in (0, 1):
        assert alike(rank_parameters(resumed, rank), rank_parameters(recipe, rank))
    assert alike(rank_parameters(recipe, 0), rank_parameters(recipe, 1))
    before = torch.load(resumed / f"checkpoint-{frozen_at - 10}" / "gradcomp_rank0.pt", weights_only=True)["hook"]
    assert not before["compressor"]["residuals"], "before the freeze: no carrier residuals yet"
    after = torch.load(recipe / "hook0.pt", weights_only=True)  # at the end
    assert after["compressor"]["residuals"], "past the freeze: the momentum's 2 bits with error feedback"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("whose", ["callback", "state"])
def test_the_summary_is_the_steps_summed_by_hand(out: Path, whose: str) -> None:
    """The callback's (kept step by step) and the hook state's (its history: all 6 steps here)."""
    steps = json.loads((out / "straight" / "steps.json").read_text())
    summary = json.loads((out / "straight" / "summary.json").read_text())[whose]
    assert summary["steps"] == len(steps) == 6 and (summary["first_step"], summary["last_step"]) == (0, 5)
    for field in ("input_bytes", "payload_bytes", "uncompressed_bytes", "host_reads"):
        assert summary[field] == sum(step[field] for step in steps), field
    wire = sum(s["sent_bytes"] if s["sent_bytes"] is not None else s["sent_estimate"] for s in steps)
    assert summary["wire_bytes"] == wire
    assert math.isclose(summary["communicate_s"], sum(step["communicate_s"] for step in steps))
    assert summary["compression_ratio"] == summary["input_bytes"] / summary["payload_bytes"]
    assert math.isclose(summary["mean_ratio"], sum(s["compression_ratio"] for s in steps) / len(steps))


class Saved:
    """A hook state as :func:`gradcomp.hooks.trainers.save_own` and ``load_own`` see one."""

    def __init__(self, residual: torch.Tensor) -> None:
        self.residual = residual

    def state_dict(self) -> dict[str, Any]:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residual = state["residual"]


def test_a_rank_file_of_another_step_or_none_at_all_is_refused(tmp_path: Path) -> None:
    from gradcomp.hooks import trainers

    path = trainers.save_own(Saved(torch.ones(3)), tmp_path, step=3)  # type: ignore[arg-type]
    assert path == tmp_path / "gradcomp_rank0.pt"
    restored = Saved(torch.zeros(3))
    trainers.load_own(restored, tmp_path, step=3)  # type: ignore[arg-type]
    assert torch.equal(restored.residual, torch.ones(3))
    with pytest.raises(ValueError, match="holds the hook state of step 3; the run resumes at step 6"):
        trainers.load_own(restored, tmp_path, step=6)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=r"no gradcomp hook state at .*gradcomp_rank0\.pt"):
        trainers.load_own(restored, tmp_path / "elsewhere", step=3)  # type: ignore[arg-type]
