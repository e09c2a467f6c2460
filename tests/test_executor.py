"""The ordered executor: submission order, errors through wait(), synchronous and issuing-only calls in place."""

from __future__ import annotations

import threading
import time

import pytest

from gradcomp.collectives.executor import Executor
from gradcomp.collectives.link import Traffic


def test_operations_run_one_at_a_time_in_submission_order() -> None:
    executor = Executor()
    order: list[int] = []
    running = threading.Lock()

    def step(i: int, pause: float) -> tuple[int, Traffic | None]:
        assert running.acquire(blocking=False), "two operations ran at once"
        time.sleep(pause)
        order.append(i)
        running.release()
        return i, Traffic(sent=i)

    handles = [executor.submit(lambda i=i: step(i, 0.01 if i % 2 else 0.0)) for i in range(10)]
    # a synchronous call behind queued ones waits its turn instead of running in place
    assert executor.submit(lambda: step(10, 0.0), wait=True).wait() == 10
    assert [h.wait() for h in handles] == list(range(10))
    assert order == list(range(11))
    assert handles[3].traffic == Traffic(sent=3)


def test_an_idle_synchronous_call_runs_in_the_callers_thread() -> None:
    executor = Executor()
    where = executor.submit(lambda: (threading.current_thread().name, None), wait=True).wait()
    assert where == threading.current_thread().name
    queued = executor.submit(lambda: (threading.current_thread().name, None)).wait()
    assert queued == "gradcomp-collectives"


def test_an_issuing_only_operation_runs_in_place_only_when_nothing_is_ahead_of_it() -> None:
    executor = Executor()
    here = threading.current_thread().name
    assert executor.submit(lambda: (threading.current_thread().name, None), issues_only=True).wait() == here
    release = threading.Event()
    order: list[str] = []

    def blocker() -> tuple[None, None]:
        release.wait(10)
        order.append("blocker")
        return None, None

    executor.submit(blocker)
    issuing = lambda: (order.append("issuing") or threading.current_thread().name, None)  # noqa: E731
    behind = executor.submit(issuing, issues_only=True)
    release.set()
    assert behind.wait(10) == "gradcomp-collectives"  # queued behind the blocker, in order
    assert order == ["blocker", "issuing"]


def test_errors_reach_the_waiter() -> None:
    executor = Executor()

    def fail() -> tuple[None, None]:
        raise RuntimeError("peer closed")

    handle = executor.submit(fail)
    with pytest.raises(RuntimeError, match="peer closed"):
        handle.wait()
    with pytest.raises(RuntimeError, match="peer closed"):
        executor.submit(fail, wait=True)
    assert executor.submit(lambda: (1, None), wait=True).wait() == 1  # still usable afterwards


def test_nested_submission_from_an_operation_runs_in_place() -> None:
    executor = Executor()

    def outer() -> tuple[int, None]:
        return executor.submit(lambda: (41, None), wait=True).wait() + 1, None

    assert executor.submit(outer).wait(timeout=10) == 42


def test_nested_submission_from_an_inline_operation_runs_in_place() -> None:
    """A synchronous operation run in its caller's thread (the executor idle) that calls a collective
    itself (the sharded engine's spec check) runs that there too, instead of queueing it behind itself."""
    executor = Executor()
    ran_in: list[threading.Thread] = []

    def outer() -> tuple[int, None]:
        ran_in.append(threading.current_thread())
        return executor.submit(lambda: (41, None), wait=True).wait() + 1, None

    result: list[int] = []
    caller = threading.Thread(target=lambda: result.append(executor.submit(outer, wait=True).wait()), daemon=True)
    caller.start()
    caller.join(timeout=10)
    assert result == [42], "the nested submission deadlocked"
    assert ran_in == [caller]  # inline, in its caller's thread


EXITING = """
import atexit, threading, time
from gradcomp.collectives import executor

atexit.register(lambda: print("alive at exit:", any(t.name == "gradcomp-collectives" for t in threading.enumerate())))
handle = executor.executor().submit(lambda: (time.sleep(0.2), None))  # still queued when the script ends
print("before exit:", handle.is_completed())
"""


def test_the_worker_finishes_its_queue_and_ends_before_the_interpreter_does() -> None:
    """A daemon worker alive at interpreter exit aborts processes with gloo groups there ("terminate
    called without an active exception": measured, a gradcomp hook under torchrun, 3 of 8 without
    this); the executor ends it at exit, after what is queued (atexit runs handlers last in first out:
    the script's runs after the executor's)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", EXITING], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["before", "exit:", "False", "alive", "at", "exit:", "False"], done.stdout


def test_a_closed_executor_ends_its_worker() -> None:
    executor = Executor()
    handle = executor.submit(lambda: (1, None))
    executor.close()
    assert handle.wait() == 1 and not executor._thread.is_alive()
    executor.close()  # twice: nothing left to end
