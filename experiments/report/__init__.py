"""``gradcomp report RUNS_DIR``: one self-contained HTML page that compares a sweep's methods by time to
accuracy, against PyTorch's own hooks.

- :mod:`~gradcomp.experiments.report.records`: the runs of a directory (a sweep's, or one run), with
  their curves, and the runs a sweep planned but has not finished;
- :mod:`~gradcomp.experiments.report.analysis`: groups (task, network, world size), the target, time to
  target, speedups, means and spreads over seeds (scipy for intervals and tests);
- :mod:`~gradcomp.experiments.report.spread`: each method across the groups (the cells of a grid): its
  change against each group's baseline, seed-paired, its mean, worst group and worst seed, and its
  fewer bytes at least and at most;
- :mod:`~gradcomp.experiments.report.verdicts`: the verdict in words (a gain leads it only out of the
  seeds' noise) and the notes a table needs (a compute above the step, ties of a coarse evaluation);
- :mod:`~gradcomp.experiments.report.plots`: the charts, as inline SVG (matplotlib);
- :mod:`~gradcomp.experiments.report.page`: the HTML page (no script, no external URL);
- :mod:`~gradcomp.experiments.report.command`: the command line.

How to read the page: ``docs/report.md``.
"""
