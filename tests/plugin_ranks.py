"""A rank target for tests/test_plugins.py that names a compressor only by its spec (no import of the
package that declares it)."""

from __future__ import annotations

import torch

from gradcomp.engine import Engine


def averaged(rank: int, world: int, spec: str) -> float:
    """The sum of a bucket averaged through ``spec`` (each rank's own values)."""
    engine = Engine(spec)
    bucket = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    averaged = engine.reduce(bucket, [0], [bucket.shape], last=True).wait()
    engine.end_step()
    return float(averaged.sum())
