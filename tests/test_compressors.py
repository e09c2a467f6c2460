"""Properties every compressor must have, checked against references for all of them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcomp.compressors import Aggregation, make_compressor, roundtrip
from gradcomp.compressors.simulate import aggregate, compress_all
from tests.helpers import SPECS, expected_wire_bytes, relative_error

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=15, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_round_trip_keeps_shape_and_dtype(spec: str, shape: list[int], dtype: torch.dtype, seed: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    y = roundtrip(make_compressor(spec), x)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    assert torch.isfinite(y).all()


def test_none_is_exact() -> None:
    x = torch.randn(37, 11)
    assert torch.equal(roundtrip(make_compressor("none"), x), x)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(1,), (1000,), (4097,), (64, 48), (300, 3, 3)])
def test_wire_bytes_match_the_formula(spec: str, shape: tuple[int, ...]) -> None:
    compressor = make_compressor(spec)
    x = torch.randn(shape)
    payload, ctx = compressor.compress(x, key="k")
    payloads = [payload]
    for _ in range(1, compressor.capabilities.rounds):
        payload, ctx = compressor.next_round(payload, ctx)
        payloads.append(payload)
    wire = sum(compressor.wire_bytes(p) for p in payloads)
    assert wire == sum(t.numel() * t.element_size() for p in payloads for t in p)
    assert wire == expected_wire_bytes(compressor, x, payloads)


@pytest.mark.parametrize("spec", SPECS)
def test_same_seed_gives_the_same_result(spec: str) -> None:
    x = torch.randn(3000)
    a, b = make_compressor(spec, seed=7), make_compressor(spec, seed=7)
    for _ in range(3):  # generators advance identically
        assert torch.equal(roundtrip(a, x, key="k"), roundtrip(b, x, key="k"))


@pytest.mark.parametrize("spec", ["quantize:bits=2", "qsgd", "terngrad", "randomk:ratio=0.1"])
def test_stochastic_compressors_depend_on_the_seed(spec: str) -> None:
    x = torch.randn(3000)
    assert not torch.equal(roundtrip(make_compressor(spec, seed=1), x), roundtrip(make_compressor(spec, seed=2), x))


@pytest.mark.parametrize("spec", SPECS)
def test_decompress_into_out_matches(spec: str) -> None:
    compressor = make_compressor(spec)
    x = torch.randn(50, 40)
    contexts, finals = compress_all([compressor], [x])
    expected = compressor.decompress(tuple(t.clone() for t in finals[0]), contexts[0]).clone()
    out = torch.full_like(x, float("nan"))
    result = compressor.decompress(tuple(t.clone() for t in finals[0]), contexts[0], out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        compressor.decompress(finals[0], contexts[0], out=torch.empty(7))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("ranks", [2, 3])
def test_aggregate_is_the_sum_of_contributions_and_identical_on_every_rank(spec: str, ranks: int) -> None:
    tensors = [torch.randn(60, 50, generator=torch.Generator().manual_seed(r)) for r in range(ranks)]
    compressors = [make_compressor(spec, seed=3, rank=r) for r in range(ranks)]
    contexts, finals = compress_all(compressors, tensors)
    contributions = [c.contribution(p, ctx).clone() for c, p, ctx in zip(compressors, finals, contexts, strict=False)]
    results = aggregate(compressors, contexts, finals)
    expected = torch.stack(contributions).sum(0)
    tolerance = {"fp16": 2.0**-10, "bf16": 2.0**-7}.get(spec, 1e-5)  # sums round in the payload dtype
    assert relative_error(results[0], expected) < tolerance
    for result in results[1:]:
        assert torch.equal(result, results[0])  # rule "bitwise-identical ranks"


def test_casts_equal_torch_casts() -> None:
    x = torch.randn(1000) * 100
    assert torch.equal(roundtrip(make_compressor("fp16"), x), x.half().float())
    assert torch.equal(roundtrip(make_compressor("bf16"), x), x.bfloat16().float())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_error_is_within_one_step(bits: int, rounding: str) -> None:
    x = torch.randn(5000) * torch.linspace(0.01, 10, 5000)
    chunk = 128
    y = roundtrip(make_compressor(f"quantize:bits={bits},chunk={chunk},rounding={rounding}"), x)
    view = x.view(-1, chunk) if x.numel() % chunk == 0 else None
    lows = torch.stack([c.min() for c in x.split(chunk)])
    highs = torch.stack([c.max() for c in x.split(chunk)])
    step = ((highs - lows) / (2**bits - 1)).repeat_interleave(torch.tensor([len(c) for c in x.split(chunk)]))
    bound = step * (0.5 if rounding == "nearest" else 1.0) * (1 + 1e-4) + 1e-6
    assert view is None or view.shape[1] == chunk
    assert ((y - x).abs() <= bound).all()
    # codes land on the chunk's levels: min and max are reproduced up to float rounding
    for c, yc in zip(x.split(chunk), y.split(chunk), strict=True):
        assert yc.min() >= c.min() - 1e-5 and yc.max() <= c.max() + 1e-5


def test_symmetric_quantizers_send_multiples_of_the_scale() -> None:
    x = torch.randn(4096)
    for spec, scale_of, s in [
        ("qsgd:bits=3,chunk=256", lambda c: c.norm(), 3),
        ("terngrad:chunk=256", lambda c: c.abs().max(), 1),
    ]:
        y = roundtrip(make_compressor(spec), x)
        for c, yc in zip(x.split(256), y.split(256), strict=True):
            levels = yc / scale_of(c) * s
            assert torch.allclose(levels, levels.round(), atol=1e-4)
            assert (levels.round().abs() <= s).all()
            assert ((yc == 0) | (torch.sign(yc) == torch.sign(c))).all()  # never flips a sign


def test_sign_is_the_chunk_mean_times_the_sign() -> None:
    x = torch.randn(1000)
    y = roundtrip(make_compressor("sign:chunk=100"), x)
    for c, yc in zip(x.split(100), y.split(100), strict=True):
        expected = c.abs().mean() * torch.where(c < 0, -1.0, 1.0)
        assert torch.allclose(yc, expected, rtol=1e-6)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_relative_error_in_the_normal_range(fmt: str) -> None:
    x = torch.randn(8192) * torch.logspace(-2, 2, 8192)
    y = roundtrip(make_compressor(f"fp8:format={fmt},chunk=256"), x)
    mantissa_bits = 3 if fmt == "e4m3" else 2
    for c, yc in zip(x.split(256), y.split(256), strict=True):
        normal = c.abs() >= c.abs().max() * 2.0**-5  # well inside both formats' normal ranges
        assert ((yc - c).abs()[normal] <= c.abs()[normal] * 2.0 ** -(mantissa_bits + 1) * 1.001).all()
    # and it matches torch's own fp8 cast of the scaled values
    scale = x[:256].abs().max() / torch.finfo(torch.float8_e4m3fn).max
    if fmt == "e4m3":
        reference = (x[:256] / scale).to(torch.float8_e4m3fn).float() * scale
        assert torch.allclose(y[:256], reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [500, 200_000])
def test_exact_topk_selects_the_k_largest(n: int) -> None:
    x = torch.randn(n)
    k = max(1, round(0.01 * n))
    y = roundtrip(make_compressor("topk:ratio=0.01"), x)
    expected = torch.zeros_like(x)
    top = x.abs().topk(k).indices
    expected[top] = x[top]
    assert torch.equal(y, expected)


def test_sampled_topk_sends_the_largest_within_tolerance() -> None:
    compressor = make_compressor("topk:ratio=0.01,method=sampled,tolerance=0.2")
    for seed in range(5):
        x = torch.randn(300_000, generator=torch.Generator().manual_seed(seed))
        (values, indices), _ = compressor.compress(x)
        assert 0.8 * 3000 <= values.numel() <= 3000
        mask = torch.zeros(x.numel(), dtype=torch.bool)
        mask[indices.long()] = True
        assert x.abs()[mask].min() >= x.abs()[~mask].max()
        assert torch.equal(values, x[indices.long()])


def test_threshold_selects_exactly_the_large_elements() -> None:
    x = torch.randn(10_000)
    y = roundtrip(make_compressor("threshold:tau=1.5"), x)
    assert torch.equal(y, torch.where(x.abs() >= 1.5, x, torch.zeros_like(x)))


def test_randomk_picks_one_element_per_block_identically_on_all_ranks() -> None:
    x = torch.randn(1000) + 10  # no zeros
    a = make_compressor("randomk:ratio=0.1,scale=false", seed=5, rank=0)
    b = make_compressor("randomk:ratio=0.1,scale=false", seed=5, rank=1)
    ya, yb = roundtrip(a, x), roundtrip(b, x)
    assert torch.equal(ya != 0, yb != 0)
    assert ((ya != 0).view(100, 10).sum(1) == 1).all()
    assert torch.equal(ya[ya != 0], x[ya != 0])
    scaled = roundtrip(make_compressor("randomk:ratio=0.1", seed=5), x)
    assert torch.allclose(scaled[scaled != 0], 10 * x[scaled != 0])


def test_aggregation_kinds_are_declared() -> None:
    kinds = {spec.split(":")[0]: make_compressor(spec).capabilities.aggregation for spec in SPECS}
    assert {n for n, k in kinds.items() if k is Aggregation.SUM} == {"none", "fp16", "bf16", "randomk", "powersgd"}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decompress_sum_leaves_the_payloads_alone(spec: str, dtype: torch.dtype) -> None:
    compressor = make_compressor(spec)
    payloads = [compressor.compress(torch.randn(30, 20).to(dtype))[0] for _ in range(3)]
    before = [tuple(t.clone() for t in p) for p in payloads]
    if compressor.capabilities.rounds == 1:
        ctx = compressor.compress(torch.randn(30, 20).to(dtype))[1]
        compressor.decompress_sum(payloads, ctx)
    for p, b in zip(payloads, before, strict=True):
        assert all(torch.equal(t, u) for t, u in zip(p, b, strict=True))


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "randomk:ratio=0.01,scale=false", "topk:ratio=0.01,ef=true"])
def test_a_ratio_given_to_a_call_holds_for_that_call_alone(spec: str) -> None:
    """A warm-up's keep-ratio is an argument (``ratio=``), not a state: the next call without one
    keeps the config's, and error feedback hands it to the sparsifier it wraps."""
    x = torch.randn(40, 50, generator=torch.Generator().manual_seed(0))
    compressor = make_compressor(spec)
    assert compressor.capabilities.ratio == 0.01
    warm, _ = compressor.compress_divided(x.clone(), 2.0, "w", ratio=0.5)
    settled, _ = compressor.compress(x.clone(), "w")
    assert warm[0].numel() == 1000 and settled[0].numel() == 20
    plain = make_compressor("sign")  # keeps no ratio: called as always, and refuses one
    plain.compress_divided(x.clone(), 2.0, "w", ratio=None)
    with pytest.raises(TypeError):
        plain.compress(x.clone(), "w", ratio=0.5)  # type: ignore[call-arg]


@pytest.mark.parametrize("spec", ["topk:ratio=0.05,method=sampled", "threshold:tau=0.5"])
def test_what_measure_finds_travels_in_its_record(spec: str) -> None:
    """``measure`` leaves nothing behind in the compressor: its record alone sizes and compresses
    the payload, in any order, even in another instance (the engine's executor thread)."""
    x, y = (torch.randn(300, 400, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    measuring = make_compressor(spec)
    first, second = measuring.measure_divided(x.clone(), 2.0, "w"), measuring.measure_divided(y.clone(), 2.0, "v")
    for measured, tensor, key in ((second, y, "v"), (first, x, "w")):
        count = int(measured.count)
        payload, _ = make_compressor(spec).compress_measured(measured, count, key)
        expected, _ = make_compressor(spec).compress_divided(tensor.clone(), 2.0, key)
        assert all(torch.equal(a, b) for a, b in zip(payload, expected, strict=True))
        assert all(t.numel() == measuring.payload_length(count, measured) for t in payload)
