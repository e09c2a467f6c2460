"""Fuzzing (hypothesis): specs of any text, tensors of any shape, dtype and layout, payloads through
packing. Valid input works; anything else is a clear gradcomp error (ValueError or TypeError with a
message), never another exception from deep inside."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradcomp.compressors import make_compressor, parse_spec
from gradcomp.engine import packing
from gradcomp.engine.spec import HookSpec
from gradcomp.experiments.tasks import parse_task
from tests.helpers import SPECS, with_feedback

NAMES = ["topk", "quantize", "allreduce", "noop", "fp16", "powersgd", "signal", "digits", "x"]
KEYS = ["ratio", "bits", "ef", "algo", "seed", "aggregation", "rounding", "chunk", "rank", "samples", "noise", ""]
VALUES = ["0.01", "4", "true", "ring", "two_phase", "nan", "-1", "1e400", "", "none", "x", "0"]

spec_texts = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda name, options: name + (":" + ",".join(f"{k}={v}" for k, v in options) if options else ""),
        st.sampled_from(NAMES),
        st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), max_size=4),
    ),
)


@settings(max_examples=400, deadline=None)
@given(text=spec_texts)
def test_any_text_is_a_spec_or_a_clear_error(text: str) -> None:
    for parse in (HookSpec.parse, parse_spec, parse_task):
        try:
            parsed = parse(text)
        except ValueError as error:
            assert str(error)  # says what is wrong
            continue
        if parse is HookSpec.parse:
            assert HookSpec.parse(str(parsed)) == parsed  # the canonical text parses back


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@st.composite
def gradients(draw: st.DrawFn) -> torch.Tensor:
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 7, 33]), min_size=0, max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    x = (torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    if x.dim() >= 2 and draw(st.booleans()):
        x = x.transpose(0, 1)  # non-contiguous
    return x


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=gradients(), spec=st.sampled_from([*SPECS, *(with_feedback(s) for s in SPECS)]))
def test_any_gradient_compresses_and_its_payload_packs_losslessly(x: torch.Tensor, spec: str) -> None:
    """Through every round, the payload survives packing bitwise, and decompresses to the input's
    shape and dtype (finite where the input is)."""
    c = make_compressor(spec)
    payload, ctx = c.compress(x, key="k")
    for _ in range(1, c.capabilities.rounds):
        payload, ctx = c.next_round(payload, ctx)
    tensors = list(payload)
    raw = packing.pack(tensors, torch.device("cpu"))
    assert raw.numel() == packing.packed_bytes([t.shape for t in tensors], tensors)
    back = packing.unpack(raw, packing.shapes(packing.header(tensors), tensors), tensors)
    assert all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(tensors, back, strict=True)
    )
    result = c.decompress(tuple(back), ctx)
    assert result.shape == x.shape and result.dtype == x.dtype
    assert math.prod(result.shape) == x.numel()
    assert bool(torch.isfinite(result).all())


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.bool]), spec=st.sampled_from(SPECS))
def test_non_floating_gradients_are_refused_clearly(dtype: torch.dtype, spec: str) -> None:
    try:
        make_compressor(spec).compress(torch.zeros(8, dtype=dtype))
    except TypeError as error:
        assert "floating-point" in str(error)
    else:
        raise AssertionError(f"{spec} accepted {dtype}")
