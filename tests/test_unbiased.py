"""Stochastic compressors are unbiased: the mean of many compressions converges to the input.

Each test averages T independent compressions of one fixed tensor and checks every element's mean
against the input with a z-score (standard error from the sample). A chunked compressor takes T copies
of the tensor end to end in one call: the copies' chunks are its chunks, each rounded with draws of its
own, so that is T compressions in the time of one call (random-k selects over the whole tensor it is
given, so it is called T times). Bounds are wide (|z| < 5.5 over
a few hundred elements: a false alarm about once in 10^5 runs), and a biased compressor measured
the same way fails them by far, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from gradcomp.compressors import make_compressor, roundtrip

TRIALS = 3000


def compressions(spec: str, x: torch.Tensor, trials: int, seed: int = 11) -> torch.Tensor:
    """``trials`` independent compressions of ``x``, one a row (of a chunked compressor, in one call)."""
    compressor = make_compressor(spec, seed=seed)
    chunk = getattr(compressor.config, "chunk", None)
    if chunk is not None and x.numel() % chunk == 0:
        return roundtrip(compressor, x.repeat(trials)).view(trials, -1)
    return torch.stack([roundtrip(compressor, x) for _ in range(trials)])


def z_scores(spec: str, x: torch.Tensor, trials: int = TRIALS) -> torch.Tensor:
    samples = compressions(spec, x, trials).double()
    mean, std = samples.mean(0), samples.std(0)
    error = (mean - x.double()).abs()
    standard_error = (std / trials**0.5).clamp_min(1e-12)
    # An element that never varied in T trials either is exact (a chunk's min or max) or rounds
    # away with probability p below ~12 / T (else P(no change) = (1 - p)**T < 1e-5), so its error
    # is below 12 / T of a step, and a step is below twice the largest |x|.
    assert (error[std == 0] <= 12 / trials * 2 * x.abs().max()).all()
    return (error / standard_error)[std > 0]


def fixed_input(n: int = 256) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 3, n)


@pytest.mark.parametrize(
    "spec",
    [
        "quantize:bits=1,chunk=64",
        "quantize:bits=2,chunk=64",
        "quantize:bits=4,chunk=64",
        "qsgd:bits=2,chunk=64",
        "qsgd:bits=4,chunk=64",
        "terngrad:chunk=64",
        "randomk:ratio=0.25",
    ],
)
def test_stochastic_compressors_are_unbiased(spec: str) -> None:
    x = fixed_input()
    z = z_scores(spec, x)
    assert z.numel() > 0.5 * x.numel()
    assert z.max() < 5.5
    # and no systematic drift: the mean signed error over all elements is small too
    compressor_mean = torch.stack([roundtrip(make_compressor(spec, seed=s), x) for s in range(200)]).mean(0)
    assert abs(float((compressor_mean - x).mean())) < 0.05 * float(x.abs().mean())


@pytest.mark.parametrize(
    "spec", ["quantize:bits=1,chunk=64", "quantize:bits=4,chunk=64", "qsgd:bits=4,chunk=64", "terngrad:chunk=64"]
)
@pytest.mark.parametrize("magnitude", [2.0**-130, 2.0**124], ids=["tiny", "huge"])
@pytest.mark.usefixtures("both_paths")
def test_unbiased_at_float32_extremes(spec: str, magnitude: float) -> None:
    """The same check where the codec leaves float32 (steps below its smallest normal; ranges past
    half its largest value): scaling by a power of two changes nothing else."""
    x = (fixed_input() * magnitude).float()
    assert x.abs().max() < torch.finfo(torch.float32).max
    z = z_scores(spec, x, trials=1500)
    assert z.numel() > 0.5 * x.numel()
    assert z.max() < 5.5


def test_the_check_detects_a_biased_compressor() -> None:
    # randomk without scaling is biased by a factor of the keep ratio: the same statistic explodes.
    z = z_scores("randomk:ratio=0.25,scale=false", fixed_input(), trials=500)
    assert z.max() > 20


def test_nearest_rounding_is_biased_where_stochastic_is_not() -> None:
    x = torch.full((64,), 0.3)
    x[0], x[1] = 0.0, 1.0  # the chunk's min and max: levels 0 and 1 with bits=1
    nearest = roundtrip(make_compressor("quantize:bits=1,chunk=64,rounding=nearest"), x)
    assert torch.allclose(nearest[2:], torch.zeros(62))  # 0.3 always rounds down
    mean = compressions("quantize:bits=1,chunk=64", x, 4000).mean(0)
    assert torch.allclose(mean[2:], torch.full((62,), 0.3), atol=0.04)
