"""Hugging Face Accelerate with gradcomp's hook (``gradcomp.hooks.accelerate``), 2 CPU processes started
by ``accelerate launch`` (gloo): the hook averages once per optimizer step of two accumulated
micro-batches, its statistics reach TensorBoard through ``accelerator.log``, the ranks end identical,
and a run resumed from ``accelerator.save_state`` ends bitwise where the run straight through does
(every rank's residuals in the state). Accelerate is a declared extra of the development set-up
(``gradcomp[accelerate]``): without it these tests fail."""

from __future__ import annotations

import json
import shutil
import socket
import sys
from pathlib import Path

import accelerate  # noqa: F401  (the extra: missing, this test fails rather than skips)
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.jobs import alike, rank_parameters, run_job

SPEC = "topk:ratio=0.1,ef=true"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(out: Path, steps: int) -> tuple[Path, Path]:
    """``tests/accelerate_job.py`` as a user launches a script (``accelerate launch``, two processes):
    the run straight through and the one resumed from the state it saved after 3 steps."""
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert launcher, "accelerate launch is not installed beside this Python"
    run_job([launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
             "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
             "-m", "tests.accelerate_job", str(out), SPEC, str(steps)], out)  # fmt: skip
    return out / "straight", out / "resumed"


@pytest.mark.timeout(600)
def test_accelerate_trains_with_a_gradcomp_hook_logs_it_and_resumes_bitwise(tmp_path: Path) -> None:
    straight, resumed = launch(tmp_path, 6)
    logged = json.loads((straight / "logged.json").read_text())
    assert len(logged) == 6 and all(step["hook/compression_ratio"] > 3 for step in logged), logged
    events = EventAccumulator(str(next((straight / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert [e.step for e in events.Scalars("hook/wire_mb")] == list(range(6)), "the statistics in TensorBoard"
    assert alike(rank_parameters(straight, 0), rank_parameters(straight, 1))
    # the resumed run, from the state saved after 3 steps
    assert alike(rank_parameters(resumed, 0), rank_parameters(straight, 0))
    assert alike(rank_parameters(resumed, 1), rank_parameters(straight, 1))


def test_one_process_needs_no_hook_and_a_lone_accelerator_among_several_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelerate import Accelerator

    from gradcomp.hooks import accelerate as gradcomp_accelerate
    from tests.toy_ddp import toy_model

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(toy_model())
    assert gradcomp_accelerate.register(accelerator, model, SPEC) is None  # nothing to average
    assert gradcomp_accelerate.Statistics(accelerator, None).log(0) == {}
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for a script whose Accelerator runs alone
    with pytest.raises(RuntimeError, match=r"launched as 2 processes.*Accelerator\(cpu=True\)"):
        gradcomp_accelerate.register(accelerator, model, SPEC)
