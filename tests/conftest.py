"""Shared fixtures: one spec per compressor family and variant, so every test covers all of them."""

from __future__ import annotations

import pytest
import torch

from gradcomp.compressors import REGISTRY

SPECS = [
    "none",
    "fp16",
    "bf16",
    "fp8:format=e4m3,chunk=64",
    "fp8:format=e5m2",
    "quantize:bits=1,chunk=100",
    "quantize:bits=3,rounding=nearest",
    "quantize:bits=4",
    "quantize:bits=8,chunk=7",
    "qsgd:bits=2",
    "qsgd:bits=5,chunk=33",
    "terngrad:chunk=50",
    "sign:chunk=64",
    "topk:ratio=0.05",
    "topk:ratio=0.01,method=sampled",
    "randomk:ratio=0.1",
    "randomk:ratio=0.3,scale=false",
    "threshold:tau=0.5",
    "powersgd:rank=2",
]


def test_specs_cover_every_registered_compressor() -> None:
    assert {spec.split(":")[0] for spec in SPECS} == set(REGISTRY)


@pytest.fixture(params=SPECS)
def spec(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Small tensors: threads only add noise, and CI has 2 cores.
    torch.set_num_threads(1)
