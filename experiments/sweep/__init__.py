"""Sweeps: grids of training runs from a TOML config (``gradcomp sweep CONFIG``).

- :mod:`~gradcomp.experiments.sweep.plan`: the config format, checked completely and expanded into runs;
- :mod:`~gradcomp.experiments.sweep.runner`: runs what is not finished, records failures, summarizes;
- :mod:`~gradcomp.experiments.sweep.command`: the command line.
"""
