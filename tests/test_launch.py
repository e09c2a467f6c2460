"""The rank launcher: results in rank order, and every failure mode a clear error, never a hang."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradcomp import launch
from gradcomp.launch import RankError, spawn

LAYERS = ("gradcomp.hooks", "gradcomp.experiments.training.run")
"""Modules of the layers above the core that add themselves to the fork server's preload list."""
IMPORTED_FIRST = [name for name in LAYERS if name in sys.modules]
"""In a rank: those of them that its process had imported before it imported this module."""


def identify(rank: int, world: int, offset: int) -> tuple[int, int, int]:
    return rank + offset, world, dist.get_world_size()


def fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def die_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(7)
    return rank


def hang(rank: int, world: int) -> None:
    time.sleep(3600)


def test_results_come_back_in_rank_order() -> None:
    assert spawn(3, identify, (10,), timeout=60) == [(10, 3, 3), (11, 3, 3), (12, 3, 3)]


def tensors(rank: int, world: int) -> list[torch.Tensor]:
    """Many tensors, one of them in shared memory: the parent reads them after the rank has exited."""
    return [torch.full((256,), float(100 * rank + i)) for i in range(63)] + [torch.ones(3).share_memory_()]


def test_ranks_return_tensors() -> None:
    """By value: shared through file descriptors (the queue's own pickler) they were served by a rank
    that exits as soon as it has put them, and the parent's read failed (connection refused or reset)."""
    for rank, returned in enumerate(spawn(2, tensors, timeout=60)):
        assert [float(t[0]) for t in returned[:-1]] == [float(100 * rank + i) for i in range(63)]
        assert torch.equal(returned[-1], torch.ones(3))


def test_a_raising_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed.*ValueError: rank one is unhappy"):
        spawn(2, fail_on_rank_one, timeout=60)


def refuse(rank: int, world: int, alike: bool) -> None:
    if alike:
        raise ValueError("unknown compressor 'topkk' (did you mean 'topk'?); valid: ...")
    raise ValueError(f"rank {rank} refuses")


def test_a_user_error_of_every_rank_is_one_line_once() -> None:
    with pytest.raises(RankError) as info:
        spawn(2, refuse, (True,), timeout=60)
    line = "unknown compressor 'topkk' (did you mean 'topk'?); valid: ... (all 2 ranks)"
    assert str(info.value) == info.value.summary == line and info.value.user_error
    assert info.value.report.count("Traceback") == 2 and "rank 1 of 2 failed:" in info.value.report
    with pytest.raises(RankError) as info:  # not alike: every traceback
        spawn(2, refuse, (False,), timeout=60)
    assert not info.value.user_error and str(info.value).count("Traceback") == 2
    assert info.value.summary == "rank 0 of 2: ValueError: rank 0 refuses"


def failures(*errors: BaseException) -> dict[int, launch.Failure]:
    """What ranks that raised ``errors`` (one each) send back."""
    made = {}
    for rank, error in enumerate(errors):
        made[rank] = launch.Failure("Traceback ...", launch.one_line(error), launch.is_user_error(error),
                                    launch.one_line(error, named=False))  # fmt: skip
    return made


def test_only_the_same_user_error_of_every_rank_is_one_line() -> None:
    typed = TypeError("gradients must be floating point,\ngot torch.int64")  # a message of two lines: one
    assert str(launch.failure_of(failures(typed, typed), 2)) == (
        "gradients must be floating point, got torch.int64 (all 2 ranks)"
    )
    broken = RuntimeError("something broke")  # a defect, or a failure between ranks: its tracebacks
    error = launch.failure_of(failures(broken, broken), 2)
    assert not error.user_error and error.summary == "rank 0 of 2: RuntimeError: something broke"
    assert not launch.failure_of(failures(ValueError("x")), 2).user_error  # one rank of two


def test_the_training_command_reports_a_user_error_of_its_ranks_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The spec parses, and every rank refuses it (its node size does not divide the world): one line,
    and run.json keeps every rank's traceback."""
    from gradcomp.experiments.training import runinfo
    from gradcomp.experiments.training.run import main

    out = str(tmp_path / "run")
    assert main(["--ranks", "2", "--hook", "topk:ratio=0.01,local_size=3", "--steps", "2", "--out", out]) == 2
    assert capsys.readouterr().err == (
        "gradcomp.experiments.train: error: local_size must be >= 1 and divide the world size 2, got 3 "
        f"(all 2 ranks); recorded in {runinfo.path(out)}\n"
    )
    record = runinfo.read(out)
    assert record is not None and record["status"] == "failed" and record["error"].count("Traceback") == 2


def test_under_torchrun_a_ranks_first_line_is_its_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from gradcomp.experiments.training import run

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    argv = ["--steps", "2", "--out", str(tmp_path / "run")]
    assert run.main([*argv, "--network", "1gbit"]) == 2  # a user's error: the line alone
    line = "gradcomp.experiments.train: error: rank 1 of 2: --network emulates links between ranks started here"
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1  # one line, nothing before it
    assert json.loads(error_file.read_text())["message"]["message"].startswith(line)  # what torchrun's summary shows

    def broken(config: object) -> None:
        raise RuntimeError("a peer died")

    monkeypatch.setattr(run, "_torchrun", broken)
    assert run.main(argv) == 1  # anything else: the line, then its traceback
    err = capsys.readouterr().err
    assert err.startswith("gradcomp.experiments.train: error: rank 1 of 2: RuntimeError: a peer died\nTraceback")


def test_a_dying_rank_is_reported() -> None:
    with pytest.raises(RankError, match=r"ranks \[1\] died without a result \(exit codes \{1: 7\}\)"):
        spawn(2, die_on_rank_one, timeout=60)


def test_a_hanging_rank_times_out_and_is_killed() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0\] of 1 did not finish within 3 s"):
        spawn(1, hang, timeout=3)
    assert time.monotonic() - start < 30


def abort_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        os.abort()  # what gloo does on a collective mismatch
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_named() -> None:
    with pytest.raises(RankError, match=r"ranks \[1\] died without a result \(exit codes \{1: SIGABRT\}\)"):
        spawn(2, abort_on_rank_one, timeout=60, group_timeout=10)


def listening(rank: int, world: int) -> list[str]:
    """The addresses this rank's process listens on (after a collective: gloo's pairs are up)."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(4))
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[len("socket:[") : -1])
    addresses = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in mine:  # LISTEN, and this process's socket
                    addresses.append(fields[1][:width])
    return addresses


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
"""127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net/tcp{,6} write them."""


def test_local_ranks_listen_on_loopback_only() -> None:
    for addresses in spawn(2, listening, timeout=60):
        assert addresses and set(addresses) <= LOOPBACK, addresses


def test_a_world_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="world_size"):
        spawn(0, identify)


def environment_and_start(rank: int, world: int, name: str) -> tuple[str | None, str]:
    return os.environ.get(name), multiprocessing.get_start_method()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_start_as_asked_and_see_the_callers_environment_of_now(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADCOMP_START_METHOD", method)
    spawn(1, identify, (0,))  # a fork server, if any, starts here, before the variable below exists
    monkeypatch.setenv("GRADCOMP_TEST_VARIABLE", "set later")
    results = spawn(2, environment_and_start, ("GRADCOMP_TEST_VARIABLE",))
    assert results == [("set later", method)] * 2


def imported_first(rank: int, world: int) -> list[str]:
    return IMPORTED_FIRST


@pytest.mark.skipif(os.environ.get("GRADCOMP_START_METHOD") == "spawn", reason="ranks start from no fork server")
def test_ranks_start_with_the_layers_above_imported() -> None:
    """The core names no layer above it: they add themselves to the fork server's preload list when
    imported (here, by the test session), and its ranks start with them imported."""
    import gradcomp.experiments.training.run  # noqa: F401  (and the hooks: as the session already has)

    assert set(LAYERS) <= set(launch.PRELOAD)
    assert spawn(2, imported_first) == [list(LAYERS)] * 2


def test_an_unknown_start_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADCOMP_START_METHOD", "fork")
    with pytest.raises(ValueError, match="valid start methods are forkserver and spawn"):
        spawn(1, identify, (0,))


def note_pid_and_hang(rank: int, world: int, directory: str) -> None:
    with open(os.path.join(directory, f"rank{rank}"), "w") as file:
        file.write(str(os.getpid()))
    time.sleep(3600)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper this container may lack)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")
def test_ranks_end_when_their_launcher_is_killed(tmp_path: Path) -> None:
    """Under the fork server, whose children a killed launcher leaves behind (spawned ranks run the
    same watch)."""
    code = (
        "from gradcomp.launch import spawn; from tests.test_launch import note_pid_and_hang; "
        f"spawn(2, note_pid_and_hang, ({str(tmp_path)!r},), timeout=600)"
    )
    environment = {**os.environ, "GRADCOMP_START_METHOD": "forkserver"}
    launcher = subprocess.Popen([sys.executable, "-c", code], env=environment, stderr=subprocess.DEVNULL)
    try:
        files = [tmp_path / f"rank{rank}" for rank in range(2)]
        deadline = time.monotonic() + 60
        while not all(f.exists() and f.read_text() for f in files):
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.05)
        ranks = [int(f.read_text()) for f in files]
        assert all(_running(pid) for pid in ranks)
    finally:
        launcher.kill()  # SIGKILL: no cleanup of its own runs
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in ranks), "ranks outlived their launcher"
