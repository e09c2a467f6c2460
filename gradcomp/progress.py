"""What a long command is doing, on a terminal: one status line on stderr, quiet elsewhere.

::

    bench ddp  3/12  loopback, run 1 of 1: torch:powersgd:rank=4 (alone)  elapsed 0:21  ETA 0:48

The benchmarks and ``gradcomp calibrate`` run for minutes with nothing to show until their tables.
:class:`Progress` says which unit of work runs (a variant, a network, a size), how many of how many
are done, the time so far and an estimate of the rest from the units done. It draws only where
stderr is a terminal: in a pipe, a log or CI it writes nothing, so stdout's tables and JSON stay
exactly as they were. Work inside spawned ranks is reported from the parent, per unit the parent
launches (the ranks themselves stay silent). Plain text, no dependency (the core has no tqdm).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO


def clock(seconds: float) -> str:
    """``0:07``, ``12:03``, ``1:02:03``: a duration as a terminal shows it."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """A status line for ``command`` over ``total`` units of work (units may weigh differently: a
    spawn measuring 8 variants together is 8 units). :meth:`step` wraps each unit; :meth:`write`
    puts a command's own output (its tables) above the line. ``stream`` defaults to stderr,
    ``enabled`` to whether it is a terminal and ``columns`` to its width: pass them to test. On a
    terminal a thread redraws the line every ``tick`` seconds, so that the elapsed time moves during
    a long unit."""

    def __init__(
        self,
        command: str,
        total: float,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        tick: float = 1.0,
        now: Callable[[], float] = time.monotonic,
        columns: int | None = None,
    ) -> None:
        self.command = command
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.enabled = _is_terminal(self.stream) if enabled is None else enabled
        self.now = now
        self.columns = columns
        """The line's width (default: the terminal's, read at every draw: a resized window follows)."""
        self.began = now()
        self.done = 0.0
        self.label = ""
        self.last_done_at = self.began  # when the last unit ended: the estimate is made then
        self._lock = threading.Lock()
        self._drawn = False
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.enabled and tick > 0:
            self._ticker = threading.Thread(target=self._tick, args=(tick,), name="gradcomp-progress", daemon=True)
            self._ticker.start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def step(self, label: str, units: float = 1.0) -> Iterator[None]:
        """One unit of work (``units`` of the total) called ``label``: shown while it runs, counted
        as done when it ends, even by an error (its row then reports it)."""
        with self._lock:
            self.label = label
            self._draw()
        try:
            yield
        finally:
            with self._lock:
                self.done += units
                self.last_done_at = self.now()
                self._draw()

    def line(self, width: int | None = None) -> str:
        """The status line as it would be drawn now; within ``width`` characters, the label cut
        short (the counts and times always show)."""
        now = self.now()
        eta = self.remaining(now)
        times = f"elapsed {clock(now - self.began)}" + ("" if eta is None else f"  ETA {clock(eta)}")
        counts = f"{self.command}  {self.done:g}/{self.total:g}"
        label = self.label
        room = None if width is None else width - len(counts) - len(times) - 4
        if room is not None and len(label) > room:
            label = label[: max(0, room - 3)] + "..." if room > 3 else ""
        return "  ".join(part for part in (counts, label, times) if part)

    def remaining(self, now: float | None = None) -> float | None:
        """Seconds left, from the mean time of the units done (None before the first ends): the
        estimate made when the last unit ended, less the time since (never below zero)."""
        if self.done <= 0:
            return None
        now = self.now() if now is None else now
        per_unit = (self.last_done_at - self.began) / self.done
        return max(0.0, per_unit * max(0.0, self.total - self.done) - (now - self.last_done_at))

    def write(self, text: str, stream: TextIO | None = None) -> None:
        """Write ``text`` to ``stream`` (stdout by default) with the status line out of its way."""
        with self._lock:
            self._clear()
            target = sys.stdout if stream is None else stream
            target.write(text)
            target.flush()
            self._draw()

    def close(self) -> None:
        """Stop redrawing and take the line away (the command's output stays as it was)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
            self._clear()

    def _tick(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        if not self.enabled or self._stop.is_set():
            return
        columns = self.columns or shutil.get_terminal_size((100, 24)).columns
        width = columns - 1  # never wrap: \r returns to one line
        self.stream.write("\r\x1b[K" + self.line(width)[:width])
        self.stream.flush()
        self._drawn = True

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False


def step(progress: Progress | None, label: str, units: float = 1.0) -> contextlib.AbstractContextManager[None]:
    """``progress.step(label, units)``, or nothing where there is no progress to report (a library call)."""
    return contextlib.nullcontext() if progress is None else progress.step(label, units)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: no terminal
        return False
