"""Runs and sweeps never mix, never write a finished run off, and refuse before any rank starts what
could only fail later (an unusable --out, a directory name too long or outside --out, a batch
larger than the data); checkpoints that cannot be read are named as such."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from gradcomp.experiments.sweep import plan, runner
from gradcomp.experiments.training import checkpoint, run, runinfo
from gradcomp.experiments.training.config import TrainConfig
from gradcomp.experiments.training.run import launch, main


def _a_run(out: Path, status: str = "finished") -> None:
    runinfo.write(str(out), {"name": out.name, "config": {"hook": "fp16"}, "status": status})
    (out / "events.out.tfevents.1.host").write_bytes(b"")


def test_a_directory_holding_another_run_is_refused_unless_resuming_or_overwriting(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _a_run(out)
    checkpoint_path = str(out / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"holds a finished run of 'fp16': continue it with --resume auto"):
        runinfo.prepare(str(out), checkpoint_path, None, overwrite=False)
    assert sorted(os.listdir(out)) == ["events.out.tfevents.1.host", "run.json"]  # untouched
    runinfo.prepare(str(out), checkpoint_path, "auto", overwrite=False)  # nothing to resume: starts over
    assert os.listdir(out) == []
    _a_run(out)
    Path(checkpoint_path).write_bytes(b"x")
    runinfo.prepare(str(out), checkpoint_path, "auto", overwrite=False)  # resumes: keeps everything
    assert len(os.listdir(out)) == 3
    runinfo.prepare(str(out), checkpoint_path, None, overwrite=True)
    assert os.listdir(out) == []


def test_the_command_refuses_before_starting_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    _a_run(out)
    with pytest.raises(SystemExit) as exit_info:
        main(["--ranks", "2", "--steps", "2", "--out", str(out)])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert runinfo.read(str(out))["status"] == "finished"  # type: ignore[index]


def test_a_failure_before_the_run_starts_leaves_a_finished_run_finished(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _a_run(out)
    runinfo.record_failure(str(out), "run", {}, "a refused resume")
    assert runinfo.read(str(out))["status"] == "finished"  # type: ignore[index]
    _a_run(out, status="running")
    runinfo.record_failure(str(out), "run", {}, "it crashed")
    record = runinfo.read(str(out))
    assert record is not None and record["status"] == "failed" and record["error"] == "it crashed"


def test_an_unusable_out_is_refused(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        runinfo.check_out(str(afile))
    with pytest.raises(ValueError, match="is a file"):
        runinfo.check_out(str(afile / "below"))
    runinfo.check_out(str(tmp_path / "new" / "deeper"))  # created later, under a writable directory


def test_atomic_writes_leave_no_temporary_and_never_half_a_file(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    with pytest.raises(RuntimeError), runinfo.atomic(str(target), "w") as file:
        file.write("half")
        raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []
    with runinfo.atomic(str(target), "w") as file:
        file.write("whole")
    assert os.listdir(tmp_path) == ["x.json"] and target.read_text() == "whole"


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", b"PK\x03\x04truncated"])
def test_an_unreadable_checkpoint_is_named(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(content)
    config = TrainConfig(steps=1, out=str(tmp_path))
    with pytest.raises(ValueError, match=f"{path} is not a readable checkpoint"):
        checkpoint.load(str(path), config, 1, torch.device("cpu"))


def test_a_truncated_checkpoint_is_named(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(str(path), {"step": 1})
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        checkpoint.load(str(path), TrainConfig(steps=1, out=str(tmp_path)), 1, torch.device("cpu"))


def test_a_checkpoint_damaged_on_disk_is_refused_naming_the_member(tmp_path: Path) -> None:
    """2000 bytes overwritten inside a tensor: torch.load alone loads it (its zip's CRCs unchecked)."""
    path = tmp_path / "checkpoint.pt"
    weights = torch.full((4000,), 1.25)
    checkpoint.save(str(path), {"step": 1, "model": {"weight": weights}})
    data = bytearray(path.read_bytes())
    start = data.index(weights[:8].numpy().tobytes()) + 4000
    data[start : start + 2000] = os.urandom(2000)
    path.write_bytes(bytes(data))
    assert not torch.equal(torch.load(path, weights_only=True)["model"]["weight"], weights)  # silently
    config = TrainConfig(steps=1, out=str(tmp_path))
    with pytest.raises(ValueError, match=r"is damaged: its member '\S+/data/0' fails its CRC-32 check") as info:
        checkpoint.load(str(path), config, 1, torch.device("cpu"))
    assert "\n" not in str(info.value)


def test_a_save_removes_the_temporaries_of_dead_writers_only(tmp_path: Path) -> None:
    """A save killed (SIGKILL) leaves its temporary, a checkpoint's size: the next save or run start
    removes those of no live writer (and of an earlier version, whose names hold no pid)."""
    dead, old, live = ".tmp-999999999-abcd1234", ".tmp-k3x9q2ab", f".tmp-{os.getpid()}-efgh5678"
    for name in (dead, old, live):
        (tmp_path / name).write_bytes(b"x" * 1000)
    checkpoint.save(str(tmp_path / "checkpoint.pt"), {"step": 1})
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoint.pt", live])
    (tmp_path / dead).write_bytes(b"x")
    runinfo.prepare(str(tmp_path), str(tmp_path / "checkpoint.pt"), "auto", overwrite=False)
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoint.pt", live])


def test_a_second_run_in_the_same_directory_is_refused(tmp_path: Path) -> None:
    holder = rf"another run is writing in {tmp_path / 'run'} \(pid {os.getpid()}\): wait for it to end"
    out = str(tmp_path / "run")
    with runinfo.lock(out), pytest.raises(ValueError, match=holder), runinfo.lock(out):
        pass
    with runinfo.lock(out):  # released
        pass
    with runinfo.lock(out), pytest.raises(ValueError, match=holder):  # the launcher too, before any rank starts
        launch(TrainConfig(task="digits", steps=1, batch_size=32, out=out, resume="auto"))


def test_sigterm_to_the_launcher_stops_its_ranks_and_records_the_run_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's ranks (here: ranks that hang) are killed, and run.json no longer says running."""
    from gradcomp import launch as launcher
    from tests.test_launch import _running, note_pid_and_hang

    out = tmp_path / "run"
    files = [tmp_path / f"rank{rank}" for rank in range(2)]

    def hanging_ranks(*args: object, **options: object) -> list[object]:
        runinfo.write(str(out), {"name": "run", "config": {}, "status": "running"})  # as rank 0 does
        return launcher.spawn(2, note_pid_and_hang, (str(tmp_path),), timeout=60)

    def terminate_once_started() -> None:
        deadline = time.monotonic() + 30
        while not all(f.exists() and f.read_text() for f in files) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(run, "spawn", hanging_ranks)
    threading.Thread(target=terminate_once_started, daemon=True).start()
    with pytest.raises(run.Terminated, match="interrupted by SIGTERM"):
        launch(TrainConfig(task="digits", steps=1, batch_size=32, out=str(out)))
    record = runinfo.read(str(out))
    assert record is not None and record["status"] == "interrupted", record
    assert not any(_running(int(f.read_text())) for f in files), "ranks outlived the interrupted launcher"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # its handler was the launch's only


def test_a_second_sweep_on_the_same_out_is_refused(tmp_path: Path) -> None:
    holder = rf"another sweep is running in {tmp_path} \(pid {os.getpid()}\)"
    with runner.lock(str(tmp_path)), pytest.raises(ValueError, match=holder), runner.lock(str(tmp_path)):
        pass
    with runner.lock(str(tmp_path)):  # released
        pass


def test_a_sweep_stopped_by_sigterm_says_so_and_how_to_continue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a run's launcher raises on SIGTERM (its ranks ended, its run.json interrupted) ends the
    sweep as Ctrl-C does, in a line, instead of a traceback."""
    from gradcomp.experiments.sweep import command

    def terminated(*args: object, **options: object) -> None:
        raise run.Terminated("interrupted by SIGTERM")

    monkeypatch.setattr(command, "run_sweep", terminated)
    (tmp_path / "sweep.toml").write_text(SWEEP)
    assert command.main([str(tmp_path / "sweep.toml"), "--out", str(tmp_path / "out")]) == 128 + signal.SIGTERM
    assert "sweep interrupted by SIGTERM: run the same command again" in capsys.readouterr().err


SWEEP = """
[sweep]
task = "digits"
steps = 10
batch_size = 32

[grid]
hooks = ["allreduce"]
"""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("[grid]", '[[tasks]]\nname = "../../x"\n[grid]'), "name must be letters, digits and"),
        (('hooks = ["allreduce"]', 'hooks = ["topk:ratio=0.01,ef=true"]'), None),
        (("batch_size = 32", "batch_size = 4096"), "batch size 4096 is larger than the 1400 training samples"),
    ],
)
def test_sweep_configs_that_would_fail_later_are_refused_now(
    tmp_path: Path, change: tuple[str, str], message: str | None
) -> None:
    document = SWEEP.replace(*change)
    (tmp_path / "sweep.toml").write_text(document)
    if message is None:
        plan.load(str(tmp_path / "sweep.toml"), str(tmp_path / "out"))  # a valid variation: accepted
        return
    with pytest.raises(ValueError, match=message):
        plan.load(str(tmp_path / "sweep.toml"), str(tmp_path / "out"))


def test_a_run_name_too_long_for_a_directory_is_refused(tmp_path: Path) -> None:
    long_name = "x" * 250
    (tmp_path / "sweep.toml").write_text(SWEEP.replace("[grid]", f'[[tasks]]\nname = "{long_name}"\n[grid]'))
    with pytest.raises(ValueError, match="a directory name takes at most 255"):
        plan.load(str(tmp_path / "sweep.toml"), str(tmp_path / "out"))


def test_a_sweep_into_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "sweep.toml").write_text(SWEEP)
    (tmp_path / "out").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        plan.load(str(tmp_path / "sweep.toml"), str(tmp_path / "out"))
