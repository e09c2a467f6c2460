"""``gradcomp report RUNS_DIR``: one self-contained HTML page that compares a sweep's methods by time to
accuracy, against PyTorch's own hooks.

- :mod:`~gradcomp.experiments.report.records`: the runs of a directory (a sweep's, or one run), with
  their curves, and the runs a sweep planned but has not finished;
- :mod:`~gradcomp.experiments.report.analysis`: groups (task, network, world size), the target, time to
  target, speedups, means and spreads over seeds (scipy for intervals and tests), the verdict;
- :mod:`~gradcomp.experiments.report.plots`: the charts, as inline SVG (matplotlib);
- :mod:`~gradcomp.experiments.report.page`: the HTML page (no script, no external URL);
- :mod:`~gradcomp.experiments.report.command`: the command line.

How to read the page: ``docs/report.md``.
"""
