"""A run's curves against step, training time and wire bytes: ``curves.jsonl`` in the run directory.

One JSON object per line, in the order written (rank 0 writes):

- ``{"kind": "train", "step", "time_s", "wire_bytes", "loss"}`` at every logging step;
- ``{"kind": "eval", "step", "time_s", "wire_bytes", "<metric>": ...}`` at every evaluation.

``time_s`` is training time (steps only, carried over a resume) and ``wire_bytes`` the bytes this rank
has sent so far: the axes a comparison of methods needs, which TensorBoard's integer ``step`` cannot
carry without meaning something else. A resumed run first drops the points after its checkpoint's
step (the interrupted run's, which the resumed run writes again).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

FILE = "curves.jsonl"


class Curves:
    """Appends points to ``<out>/curves.jsonl``, after cutting it at ``resume_step`` when given."""

    def __init__(self, out: str, resume_step: int | None = None) -> None:
        self.path = os.path.join(out, FILE)
        if resume_step is not None and os.path.exists(self.path):
            kept = [point for point in read(out) if point["step"] <= resume_step]
            with open(self.path + ".tmp", "w") as file:  # then renamed: a crash leaves the old file whole
                file.writelines(json.dumps(point) + "\n" for point in kept)
            os.replace(self.path + ".tmp", self.path)

    def append(self, kind: str, values: Mapping[str, float], step: int, elapsed: float, wire_bytes: int) -> None:
        point: dict[str, Any] = {"kind": kind, "step": step, "time_s": elapsed, "wire_bytes": wire_bytes}
        point.update({k: v for k, v in values.items() if v is not None and math.isfinite(v)})
        with open(self.path, "a") as file:
            file.write(json.dumps(point) + "\n")


def read(out: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The points of the run in ``out`` (of one ``kind`` if given), in the order written; [] if none."""
    path = os.path.join(out, FILE)
    if not os.path.exists(path):
        return []
    with open(path) as file:
        points = [json.loads(line) for line in file if line.strip()]
    return [p for p in points if kind is None or p["kind"] == kind]
