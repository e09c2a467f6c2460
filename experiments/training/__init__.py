"""One training run: DDP with a gradcomp hook, measured, logged and resumable.

- :mod:`~gradcomp.experiments.training.config`: :class:`TrainConfig`, every setting of a run;
- :mod:`~gradcomp.experiments.training.run`: the command line, starting ranks (or joining torchrun's),
  and one rank's run;
- :mod:`~gradcomp.experiments.training.loop`: timed steps, logging, evaluation;
- :mod:`~gradcomp.experiments.training.metrics`: wire bytes from the hook, TensorBoard;
- :mod:`~gradcomp.experiments.training.checkpoint` and :mod:`~gradcomp.experiments.training.runinfo`:
  the checkpoint a run resumes from exactly, and ``run.json``;
- :mod:`~gradcomp.experiments.training.optim`: optimizers and schedules by name.
"""
