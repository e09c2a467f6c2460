"""One ordered path for all of gradcomp's communication in a process (rule "one ordered path",
``docs/architecture.md``).

Every collective, synchronous or not, runs on a single worker thread in submission order. Since
every rank submits the same collectives in the same order, every rank runs them in the same order,
and no collective is ever issued from a backend's callback thread (what makes torch's own
``powerSGD_hook`` abort on gloo with several buckets). Asynchronous calls return a :class:`Handle`
at once; synchronous calls are a submit and a wait.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import torch

from gradcomp.collectives.link import Traffic

T = TypeVar("T")


class Handle(Generic[T]):
    """An operation in flight. ``wait()`` returns its result, or raises what it raised."""

    def __init__(self, future: Future[tuple[T, Traffic | None]]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation finished (or ``timeout`` seconds passed: TimeoutError)."""
        return self._future.result(timeout)[0]

    def is_completed(self) -> bool:
        return self._future.done()

    def then(self, callback: Callable[[Handle[T]], None]) -> None:
        """Call ``callback(handle)`` once the operation finished (at once if it has), on the thread
        that finishes it. Keep it short, and never communicate from it (rule "one ordered path")."""
        # a new handle on the future, not this one: the future keeps its callbacks, and a callback
        # holding this handle would make a cycle that only a garbage collection frees
        self._future.add_done_callback(lambda future: callback(Handle(future)))

    @property
    def traffic(self) -> Traffic | None:
        """Bytes this rank sent and received; None for the backend's native collectives, whose
        internal traffic is not observable. Available once the operation completed."""
        self.wait()
        return self._future.result()[1]


def join(handles: list[Handle[Any]], value: T) -> Handle[T]:
    """One handle for several operations: ``value`` once every one is done, or the first error
    (the ``auto`` hook averages a bucket in runs, one per method)."""
    done: Future[tuple[T, Traffic | None]] = Future()
    left = [len(handles)]
    lock = threading.Lock()

    def finished(handle: Handle[Any]) -> None:
        try:
            handle.wait()
        except BaseException as error:
            with lock:
                if not done.done():
                    done.set_exception(error)
            return
        with lock:
            left[0] -= 1
            if left[0] == 0 and not done.done():
                done.set_result((value, None))

    for handle in handles:
        handle.then(finished)
    return Handle(done)


class Executor:
    """A daemon worker thread running submitted operations one at a time, in submission order.

    A synchronous operation submitted while nothing is queued or running runs right away in the
    caller's thread (two thread hand-offs fewer per call, which is most of a small all-reduce's
    latency on a busy machine); it holds the same turn the worker takes, so order is unchanged.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], tuple[object, Traffic | None]], Future] | None] = (
            queue.SimpleQueue()
        )
        self._turn = threading.Lock()  # held by whoever runs an operation
        self._state = threading.Lock()  # guards _pending
        self._pending = 0  # submitted, not finished
        self._inside = threading.local()  # .running: this thread runs an operation (the worker, or inline)
        self._closed = False  # closed: every operation runs in its caller's thread
        self._thread = threading.Thread(target=self._run, name="gradcomp-collectives", daemon=True)
        self._thread.start()

    def submit(
        self, operation: Callable[[], tuple[T, Traffic | None]], wait: bool = False, issues_only: bool = False
    ) -> Handle[T]:
        """Queue ``operation``; with ``wait``, also wait for it. With ``wait`` or ``issues_only`` (an
        operation that only issues the backend's asynchronous work) it runs in the caller's thread
        when nothing is queued or running: same order, no thread hand-off."""
        future: Future[tuple[T, Traffic | None]] = Future()
        if threading.current_thread() is self._thread or getattr(self._inside, "running", False):
            # Called from inside an operation: run in place (queueing would wait on itself).
            _run_into(operation, future)
            return Handle(future)
        with self._state:
            inline = ((wait or issues_only) and self._pending == 0) or self._closed
            self._pending += 1
            if not inline:
                self._queue.put((operation, future))
        if inline:
            with self._turn:
                self._inside.running = True
                try:
                    _run_into(operation, future)
                finally:
                    self._inside.running = False
            self._finished()
        handle = Handle(future)
        if wait:
            handle.wait()
        return handle

    def _finished(self) -> None:
        with self._state:
            self._pending -= 1

    def close(self) -> None:
        """Let the worker finish what is queued, then end it (at interpreter exit: :func:`_close`).
        What is submitted afterwards runs in the caller's thread (another exit handler's flush)."""
        with self._state:
            self._closed = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        match_torch_threads()
        while True:
            item = self._queue.get()
            if item is None:
                return
            operation, future = item
            if future.set_running_or_notify_cancel():
                with self._turn:
                    _run_into(operation, future)
            self._finished()


def _run_into(operation: Callable[[], tuple[T, Traffic | None]], future: Future[tuple[T, Traffic | None]]) -> None:
    try:
        future.set_result(operation())
    except BaseException as error:  # the waiter re-raises it
        future.set_exception(error)


_executor: Executor | None = None
_lock = threading.Lock()


def executor() -> Executor:
    """The process's executor, started on first use."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = Executor()
            atexit.register(_close)
        return _executor


def _close() -> None:
    """At interpreter exit: end the worker while the interpreter is whole."""
    if _executor is not None:
        _executor.close()


_matched = threading.local()


def match_torch_threads() -> None:
    """Give the calling thread the intra-op thread count of the process (``torch.set_num_threads``),
    once per thread. torch applies that count to a thread lazily, when one of its own parallel loops
    first runs there; a BLAS call (a matmul) does not, so a thread torch did not start (this
    executor's, a backend's completion thread) would multiply with the library's default count,
    whose other blocking changes the last bits of the product. Ranks that decompress the same
    payload on different threads then diverge (measured: PowerSGD rank 4, before this): every
    thread that computes on gradients calls this first."""
    if not getattr(_matched, "done", False):
        torch.set_num_threads(torch.get_num_threads())
        _matched.done = True
