"""Experiments (``gradcomp.experiments``): real training runs that compare gradient compression by
convergence, sweeps of them, and the DDP step-time benchmark.

- ``training/``: one run, under ``torchrun`` or on ranks it starts itself (optionally behind an
  emulated network); TensorBoard scalars and HParams, ``run.json``, a checkpoint it resumes from
  exactly. ``train.py`` is its command (``torchrun experiments/train.py ...``).
- ``sweep/`` (``gradcomp sweep CONFIG``): grids of runs from a TOML config, resumable; ``configs/``
  holds the quick and the full study.
- ``report/`` (``gradcomp report RUNS_DIR``): one HTML page comparing a sweep's methods by time to
  accuracy, against PyTorch's own hooks (``torch:allreduce`` and the like, which runs and sweeps take).
- ``bench/`` (``gradcomp bench ddp``): DDP step time of gradcomp's hooks beside PyTorch's own.
- ``faults.py`` (``python -m gradcomp.experiments.faults``): replica groups on torchft, one killed
  mid-run and restarted, beside a fault-free twin (the ``torchft`` extra).
- ``tasks/``: digits, generated signals, a character LM on Python's own source, synthetic data for
  step times, and your own data; ``models.py``: the models they train.

Needs ``pip install 'gradcomp[experiments]'`` (scikit-learn for the digits, tqdm for sweeps,
matplotlib for reports).
Depends on ``gradcomp.hooks`` and the core, never the reverse. Guide: ``docs/experiments.md``.
"""
