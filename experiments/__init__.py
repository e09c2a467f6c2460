"""Experiments: real training runs that compare gradient compression by convergence, and sweeps of them.

- ``experiments.train``: one run, under ``torchrun`` or on ranks it starts itself (optionally behind an
  emulated network); TensorBoard scalars and HParams, ``run.json``, a checkpoint it resumes from exactly.
- ``experiments.sweep`` (``gradcomp sweep CONFIG.toml``): grids of runs from a TOML config
  (``experiments.plan``), resumable; ``experiments/configs/`` holds the quick and the full study.
- ``experiments.tasks``: digits, generated signals, a character LM on Python's own source, synthetic
  data for step times, and your own data; ``experiments.models``: the models they train.

Depends on ``hooks`` and ``gradcomp``, never the reverse. Guide: ``docs/experiments.md``.
"""
