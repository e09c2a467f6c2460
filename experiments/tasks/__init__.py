"""Training tasks, by name: data (embedded, generated or your own), the models that fit them, metrics.

=============  ==========================================================  ===============================
task           data                                                        models (default first)
=============  ==========================================================  ===============================
``digits``     scikit-learn's bundled handwritten digits (real, 8x8)        mlp, smallcnn
``signal``     generated noisy chirps, 10 classes, up to 100k samples       signalcnn, mlp
``charlm``     Python's own stdlib source, or ``data=`` a text file         chartransformer
``synthetic``  random inputs, for steps per second                          mlp, resnet18, chartransformer
``classify``   ``data=`` a ``.pt``/``.npz`` file of your own (x, y)          mlp, signalcnn, ...
=============  ==========================================================  ===============================

A task is named by a spec, the same syntax as compressor specs: ``"signal:samples=50000,noise=1.5"``.
"""

from __future__ import annotations

from typing import Any

from gradcomp.experiments.tasks import classify, digits, signal, synthetic, text
from gradcomp.experiments.tasks.base import Task, TaskSpec
from gradcomp.options import split_spec

TASKS: dict[str, TaskSpec] = {
    spec.name: spec for spec in (digits.SPEC, signal.SPEC, text.SPEC, synthetic.SPEC, classify.SPEC)
}


def parse_task(spec: str) -> tuple[TaskSpec, Any]:
    """``"signal:samples=50000"`` -> (the task family, its validated options)."""
    name, options = split_spec(spec)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[name], TASKS[name].parse_options(options)


def build_task(spec: str, data: str | None = None) -> Task:
    """Build the task a spec names (on every rank: the result is the same everywhere)."""
    family, options = parse_task(spec)
    return family.build(options, data)


__all__ = ["TASKS", "Task", "TaskSpec", "build_task", "parse_task"]
