"""The documented input policy (gradcomp/compressors/base.py), for every compressor."""

from __future__ import annotations

import pytest
import torch

from gradcomp.compressors import make_compressor, roundtrip
from tests.helpers import SPECS

pytestmark = pytest.mark.usefixtures("both_paths")  # the CPU's paths and an accelerator's


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_non_floating_tensors_are_refused(spec: str, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="floating-point tensors"):
        make_compressor(spec).compress(torch.ones(10, dtype=dtype))


@pytest.mark.parametrize("spec", SPECS)
def test_non_tensors_are_refused(spec: str) -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        make_compressor(spec).compress([1.0, 2.0])  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
def test_empty_tensors_round_trip_to_empty(spec: str, shape: tuple[int, ...]) -> None:
    compressor = make_compressor(spec)
    x = torch.empty(shape)
    y = roundtrip(compressor, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    payload, _ = compressor.compress(x)
    assert compressor.wire_bytes(payload) == 0


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_tensors_compress_like_their_contiguous_copy(spec: str) -> None:
    x = torch.randn(30, 40).t()
    assert not x.is_contiguous()
    y = roundtrip(make_compressor(spec, seed=1), x)
    assert y.shape == x.shape
    assert torch.equal(y, roundtrip(make_compressor(spec, seed=1), x.contiguous()))


@pytest.mark.parametrize("spec", SPECS)
def test_zeros_stay_zeros(spec: str) -> None:
    x = torch.zeros(50, 40)
    assert torch.equal(roundtrip(make_compressor(spec), x), x)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 777, 1999])
def test_non_finite_inputs_are_never_dropped(spec: str, bad: float, where: int) -> None:
    """A NaN/Inf in the gradient gives a non-finite result (so GradScaler skips the step)."""
    x = torch.randn(2000)
    x[where] = bad
    y = roundtrip(make_compressor(spec), x.view(40, 50))
    assert not torch.isfinite(y).all()


@pytest.mark.parametrize("spec", SPECS)
def test_large_finite_inputs_stay_finite_unless_the_format_overflows(spec: str) -> None:
    x = torch.randn(2000) * 1e30
    y = roundtrip(make_compressor(spec), x.view(40, 50))
    if spec == "fp16":  # fp16 overflows beyond 65504, as a cast does (documented)
        assert torch.isinf(y).all()
    else:
        assert torch.isfinite(y).all()


CHUNKED = ["quantize:bits=4,rounding=nearest", "quantize:bits=2", "qsgd:bits=4,chunk=256", "terngrad", "sign",
           "fp8:format=e4m3"]  # fmt: skip


@pytest.mark.parametrize("spec", CHUNKED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_non_finite_value_stays_within_its_chunk(spec: str, dtype: torch.dtype) -> None:
    """The other chunks decode as they do without it, to one rounding of the dtype (a tensor with
    a non-finite chunk may take a wider path for its scales: sign's float64 means). Before: a NaN's
    code, past the levels of nearest rounding, spilled into other chunks' packed bits, and a
    half-precision tensor's other chunks decoded 30x their error away."""
    x = torch.randn(2000, generator=torch.Generator().manual_seed(0)).to(dtype)
    bad = x.clone()
    bad[5] = float("nan")
    clean, poisoned = (roundtrip(make_compressor(spec, seed=1), t) for t in (x, bad))
    chunk = make_compressor(spec).capabilities.piece_multiple
    assert not torch.isfinite(poisoned[:chunk]).all()
    torch.testing.assert_close(poisoned[chunk:], clean[chunk:], rtol=2 * torch.finfo(dtype).eps, atol=0)
