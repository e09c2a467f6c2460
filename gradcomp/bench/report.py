"""What every benchmark reports besides its figures: the machine, a Markdown table, a JSON file."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[bool] | None = None) -> str:
    """A Markdown table, its columns padded so that it also reads as plain text. ``right[i]``:
    right-align column i (numbers); by default every column but the first."""
    right = list(right) if right is not None else [False, *[True] * (len(header) - 1)]
    if len(right) != len(header) or any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells, as the header")
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(3, *(len(row[i]) for row in cells)) for i in range(len(header))]

    def line(row: list[str]) -> str:
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = line(["-" * (w - 1) + ":" if r else "-" * w for w, r in zip(widths, right, strict=True)])
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


class Footnotes:
    """Short table cells, their reasons below the table: a status such as ``aborted: RuntimeError:
    Received data size doesn't match ...`` would widen its column past any screen, so its cell says
    ``aborted [1]`` and the table is followed by ``[1] torch:powersgd:rank=4: aborted: RuntimeError:
    ...``. The same text in several rows shares one note."""

    SHORT = 12
    """A cell this long or shorter, without a reason (``:``, ``;``, ``(``), stays as it is."""

    def __init__(self) -> None:
        self.notes: dict[str, list[str]] = {}
        """Each note's text, and the rows (subjects) that refer to it."""

    def cell(self, text: str, subject: str = "") -> str:
        """``text`` as a short cell: itself, or its first words and a note's number. ``subject``
        (the row's name) starts the note."""
        if len(text) <= self.SHORT and not any(mark in text for mark in ":;("):
            return text
        head = text
        for mark in (";", ":", " ("):
            head = head.split(mark, 1)[0]
        subjects = self.notes.setdefault(text, [])
        if subject and subject not in subjects:
            subjects.append(subject)
        return f"{head.strip()[: self.SHORT * 2]} [{list(self.notes).index(text) + 1}]"

    def __str__(self) -> str:
        """The notes, one line each (empty when no cell needed one)."""
        return "\n".join(
            f"[{i}] {', '.join(subjects) + ': ' if subjects else ''}{text}"
            for i, (text, subjects) in enumerate(self.notes.items(), 1)
        )

    def below(self, table: str) -> str:
        """``table`` followed by its notes, a blank line between them."""
        return f"{table}\n\n{self}" if self.notes else table


def write_report(path: str, host: dict[str, Any], **figures: Any) -> None:
    """``--json FILE`` of every benchmark: the machine, the command line, then ``figures``."""
    with open(path, "w") as file:
        json.dump({"machine": host, "command": " ".join(sys.argv), **figures}, file, indent=2)
