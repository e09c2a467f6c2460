"""Long soaks (``make test-slow``): the statistical and long-run properties at higher power."""

from __future__ import annotations

import pytest
import torch

from gradcomp.compressors import make_compressor, roundtrip
from gradcomp.compressors.simulate import compress_all

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("spec", "step"), [("quantize:bits=2,chunk=16384", 2 / 3), ("terngrad:chunk=16384", 1.0)])
def test_rounding_bias_is_below_a_thousandth_of_a_step(spec: str, step: float) -> None:
    """Values at 40 fractions of a step, 300 copies each, compressed 30k times: every fraction's mean
    error stays below 1/1024 of a step. Plain 8-bit noise (without the per-chunk offset) would be
    biased by up to 1/512 at the half-way fractions included here."""
    fractions = torch.cat([torch.linspace(0.01, 0.99, 20), (torch.arange(20) * 12 + 0.5) / 256])
    values = -1 + step * (1 + fractions)  # inside the second level interval; levels start at -1
    x = torch.cat([torch.tensor([-1.0, 1.0]), values.repeat_interleave(300)])  # min and max pinned
    compressor = make_compressor(spec, seed=5)
    trials = 30_000
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(trials):
        total += roundtrip(compressor, x).double()
    error = ((total / trials)[2:] - x[2:].double()).view(40, 300).mean(dim=1) / step
    standard_error = 0.5 / (trials * 300) ** 0.5  # a rounding indicator's std is at most 1/2
    assert 5 * standard_error < 1 / 1024  # the test has the power to see a 1/512 bias
    assert error.abs().max() < 1 / 1024


def test_error_feedback_residual_stays_bounded_over_a_long_run() -> None:
    """5000 steps of top-k 1% with error feedback: the residual settles, it does not drift."""
    ef = make_compressor("topk:ratio=0.01,ef=true")
    generator = torch.Generator().manual_seed(0)
    norms = []
    for _ in range(5000):
        g = torch.randn(2000, generator=generator)
        compress_all([ef], [g], key="w")
        norms.append(float(ef.residuals["w"].norm()))
    early, late = sum(norms[1000:2000]) / 1000, sum(norms[4000:]) / 1000
    assert late < 1.2 * early
