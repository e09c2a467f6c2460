"""Every compressor keeps its documented bound at every magnitude its input dtype holds.

Each input is one pattern of both signs (largest |x| exactly 1, including +1 and -1, so a chunk's
range can reach twice the dtype's largest value) scaled to a magnitude M, for M from the dtype's
smallest normal to its largest finite value. The result must be finite (except the casts'
documented overflow) and within the bound that ``docs/compressors.md`` states, computed here in
float64 from the input. Tolerances add only the rounding of the result to its own dtype and a few
float32 roundings of the largest value in a chunk; a map that overflowed, underflowed or lost its
precision misses by whole steps, as the examples of the issue that prompted this file did.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from gradcomp.compressors import make_compressor, roundtrip
from gradcomp.compressors.chunks import num_chunks
from gradcomp.compressors.simulate import sum_payloads
from gradcomp.compressors.sparse import kept
from tests.helpers import SPECS

pytestmark = pytest.mark.usefixtures("both_paths")  # the CPU's paths and an accelerator's

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = {"e4m3": (2.0**-4, 2.0**-10, 448.0), "e5m2": (2.0**-3, 2.0**-17, 57344.0)}
"""format: (relative error, half the smallest subnormal, largest value)."""


def magnitudes(dtype: torch.dtype, count: int = 24) -> list[float]:
    """From the smallest normal to the largest finite value of ``dtype``, geometrically."""
    info = torch.finfo(dtype)
    low, high = math.log2(info.tiny), math.log2(info.max)
    inner = [2.0 ** (low + (high - low) * i / (count - 1)) for i in range(1, count - 1)]
    return [info.tiny, *inner, info.max]


def pattern(n: int = 2000) -> Tensor:
    """float64 values in [-1, 1] with both extremes present."""
    values = torch.randn(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    values /= values.abs().max()
    values[0], values[1] = 1.0, -1.0
    return values


def scaled(magnitude: float, dtype: torch.dtype) -> Tensor:
    return (pattern() * magnitude).to(dtype).view(40, 50)


def rounding(dtype: torch.dtype, x: Tensor) -> Tensor:
    """What rounding a float64 value near |x| to ``dtype`` can cost: half an ulp, subnormals included."""
    info = torch.finfo(dtype)
    return x.abs() * info.eps / 2 + info.smallest_normal * info.eps / 2


def per_chunk(values: Tensor, chunk: int, reduce: str) -> Tensor:
    """A float64 per-element tensor holding its chunk's reduction (amax, amin, norm, mean)."""
    n = values.numel()
    padded = torch.nn.functional.pad(values, (0, num_chunks(n, chunk) * chunk - n), value=math.nan)
    rows = padded.view(-1, chunk)
    kept = ~rows.isnan()
    if reduce == "amax":
        result = torch.where(kept, rows, -math.inf).amax(dim=1)
    elif reduce == "amin":
        result = torch.where(kept, rows, math.inf).amin(dim=1)
    elif reduce == "norm":
        result = torch.where(kept, rows, 0.0).norm(dim=1)
    else:
        result = torch.where(kept, rows.abs(), 0.0).sum(dim=1) / kept.sum(dim=1)
    return result.repeat_interleave(chunk)[:n]


def error_bound(spec: str, x: Tensor, dtype: torch.dtype) -> Tensor:
    """The documented per-element bound on |result - x| for the elementwise and chunked formats."""
    compressor = make_compressor(spec)
    name, config = compressor.name, compressor.config
    chunk = getattr(config, "chunk", None)
    if name in ("fp16", "bf16"):
        wire = torch.finfo(torch.float16 if name == "fp16" else torch.bfloat16)
        return x.abs() * wire.eps / 2 + wire.smallest_normal * wire.eps / 2
    if name == "fp8":
        relative, subnormal, largest = FP8[config.format]
        return relative * x.abs() + subnormal * per_chunk(x.abs(), chunk, "amax") / largest
    if name == "quantize":
        step = (per_chunk(x, chunk, "amax") - per_chunk(x, chunk, "amin")) / (2**config.bits - 1)
        return step * (0.5 if config.rounding == "nearest" else 1.0)
    if name == "qsgd":  # one level: norm / s, the norm capped at float32's largest (as it travels)
        norm = per_chunk(x, chunk, "norm").clamp(max=torch.finfo(torch.float32).max)
        return norm / (2 ** (config.bits - 1) - 1)
    if name == "terngrad":
        return per_chunk(x.abs(), chunk, "amax")
    raise AssertionError(f"no bound for {spec}")


BOUNDED = [s for s in SPECS if s.split(":")[0] in ("fp16", "bf16", "fp8", "quantize", "qsgd", "terngrad")]
SELECTING = [s for s in SPECS if s.split(":")[0] in ("none", "topk", "randomk", "threshold")]


def overflows_cast(spec: str, x: Tensor) -> Tensor:
    """Elements the casts documentedly turn into Inf: those past the wire format's range."""
    name = spec.split(":")[0]
    if name not in ("fp16", "bf16"):
        return torch.zeros_like(x, dtype=torch.bool)
    wire = torch.finfo(torch.float16 if name == "fp16" else torch.bfloat16)
    # round to nearest reaches Inf from half an ulp past the largest value
    return x.abs() >= wire.max * (1 + wire.eps / 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_finite_inputs_give_finite_results_at_every_magnitude(spec: str, dtype: torch.dtype) -> None:
    for magnitude in magnitudes(dtype):
        x = scaled(magnitude, dtype)
        y = roundtrip(make_compressor(spec, seed=2), x)
        expected_inf = overflows_cast(spec, x.double())
        assert torch.isfinite(y[~expected_inf]).all(), f"{spec} {dtype} at {magnitude:.3g}"
        assert torch.isinf(y[expected_inf]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", BOUNDED)
def test_documented_error_bound_holds_at_every_magnitude(spec: str, dtype: torch.dtype) -> None:
    for magnitude in magnitudes(dtype):
        x = scaled(magnitude, dtype).view(-1).double()
        y = roundtrip(make_compressor(spec, seed=2), x.to(dtype)).double()
        chunk = getattr(make_compressor(spec).config, "chunk", x.numel())
        slack = rounding(dtype, y) + 8 * torch.finfo(torch.float32).eps * per_chunk(x.abs(), chunk, "amax")
        inside = ~overflows_cast(spec, x)
        excess = ((y - x).abs() - error_bound(spec, x, dtype) - slack)[inside]
        assert (excess <= 0).all(), f"{spec} {dtype} at {magnitude:.3g}: off by {excess.max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SELECTING)
def test_selected_elements_travel_exactly_at_every_magnitude(spec: str, dtype: torch.dtype) -> None:
    """Sparsifiers send elements as they are: every result is the input or zero (random-k with
    ``scale=true``: the input times its block's size, saturated at the dtype's largest value)."""
    compressor = make_compressor(spec)
    largest = torch.finfo(dtype).max
    for magnitude in magnitudes(dtype):
        x = scaled(magnitude, dtype).view(-1)
        y = roundtrip(make_compressor(spec, seed=2), x).view(-1)
        sent = y != 0
        if compressor.name == "randomk" and compressor.config.scale:
            n, k = x.numel(), kept(compressor.config.ratio, x.numel())
            estimates = [(x[sent].double() * size).clamp(-largest, largest).to(dtype) for size in (n // k, -(-n // k))]
            assert torch.stack([y[sent] == e for e in estimates]).any(dim=0).all(), f"{spec} {dtype} at {magnitude:.3g}"
        else:
            assert torch.equal(y[sent], x[sent]), f"{spec} {dtype} at {magnitude:.3g}"
        if compressor.name == "topk" and compressor.config.method == "exact":
            assert x[~sent].abs().max() <= x[sent].abs().min()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sign_sends_the_chunk_mean_magnitude_at_every_magnitude(dtype: torch.dtype) -> None:
    spec = "sign:chunk=64"
    for magnitude in magnitudes(dtype):
        x = scaled(magnitude, dtype).view(-1)
        y = roundtrip(make_compressor(spec), x).double()
        wide = x.double()
        expected = per_chunk(wide, 64, "mean") * torch.where(wide < 0, -1.0, 1.0)
        tolerance = 1e-5 * expected.abs() + rounding(dtype, expected)
        assert ((y - expected).abs() <= tolerance).all(), f"{dtype} at {magnitude:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_powersgd_scales_with_its_input_until_float32_saturates(dtype: torch.dtype) -> None:
    """PowerSGD is homogeneous: for a power of two M, its result for M x is M times its result for
    x (the same seed, so the same initial factors), as long as the factors fit float32; past that
    they saturate, and the result stays finite and within the dtype's range."""
    spec = "powersgd:rank=2"
    info = torch.finfo(dtype)
    for magnitude in magnitudes(dtype):
        power = 2.0 ** math.floor(math.log2(magnitude))
        x = scaled(power, dtype)
        y = roundtrip(make_compressor(spec, seed=2), x).double()
        assert torch.isfinite(y).all() and (y.abs() <= info.max).all()
        # x / M is exact in float32 at every magnitude of these dtypes
        expected = roundtrip(make_compressor(spec, seed=2), x.float() / power).double() * power
        if expected.abs().max() < info.max / 2:
            tolerance = 1e-5 * expected.abs().max() + rounding(dtype, expected)
            excess = (y - expected).abs() - tolerance
            assert (excess <= 0).all(), f"{dtype} at {power:.3g}: off by {excess.max():.3g}"


def test_warm_start_does_not_square_the_magnitude() -> None:
    """The remembered factor carries the last gradient's magnitude; used unscaled, M Q overflowed
    float32 from |x| ~ 1e19 on (the second step at 1e30 was NaN)."""
    compressor = make_compressor("powersgd:rank=2")
    x = scaled(2.0**100, torch.float32)
    roundtrip(compressor, x)
    assert torch.isfinite(roundtrip(compressor, x)).all()


@pytest.mark.parametrize(
    ("spec", "x", "bound"),
    [  # the three examples: (finite -> Inf), (200% error), (all zeros)
        ("fp8:format=e5m2", torch.full((4,), 1e-35), 2.0**-3 * 1e-35),
        ("fp8", torch.tensor([1e-37, -3e-37, 2e-37, 3e-37]), 2.0**-4 * 3e-37),
        ("quantize:bits=8,rounding=nearest", torch.linspace(0, 3e-37, 8), 3e-37 / 255 / 2),
    ],
)
def test_reported_examples(spec: str, x: Tensor, bound: float) -> None:
    y = roundtrip(make_compressor(spec), x)
    assert ((y.double() - x.double()).abs() <= bound * (1 + 1e-6)).all()


def test_powersgd_sum_of_saturated_factors_stays_finite() -> None:
    """Three ranks average gradients of float32's largest magnitude, as the engine does (each
    compresses its gradient / 3): every column's norm is past float32's range, so each rank's Q
    saturates, at a third of the largest value, and their sum and the result stay finite."""
    world = 3
    compressors = [make_compressor("powersgd:rank=2", rank=r) for r in range(world)]
    largest = torch.finfo(torch.float32).max
    gradients = [torch.full((40, 50), largest) * (1 - r / 10) for r in range(world)]
    states = [c.compress_divided(g.clone(), world, "k") for c, g in zip(compressors, gradients, strict=True)]
    first = sum_payloads([payload for payload, _ in states])
    states = [
        c.next_round(tuple(t.clone() for t in first), ctx) for c, (_, ctx) in zip(compressors, states, strict=True)
    ]
    assert all(bool((payload[0].abs() == largest / world).any()) for payload, _ in states)  # saturated
    second = sum_payloads([payload for payload, _ in states])
    assert all(bool(torch.isfinite(t).all()) for t in (*first, *second))
    results = [
        c.decompress(tuple(t.clone() for t in second), ctx) for c, (_, ctx) in zip(compressors, states, strict=True)
    ]
    assert all(bool(torch.isfinite(r).all()) for r in results)
    assert all(torch.equal(r, results[0]) for r in results)
