"""Training tasks, models, sweep configs and the ``torchrun``-compatible train script.

Planned in ``docs/architecture.md``; depends on ``hooks`` and ``gradcomp``, never the reverse.
"""
