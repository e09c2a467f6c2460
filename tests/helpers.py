"""Test helpers: the wire-cost formulas each compressor documents, and the protocol step by step."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from gradcomp.compressors import Compressor, Payload, parse_spec

# One spec per compressor family and variant: every property test runs over all of them.
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


def with_feedback(spec: str) -> str:
    """``spec`` under error feedback (``ef=true``), or its nearest variant that error feedback takes:
    random-k unscaled, quantization at 2 bits rather than 1, and QSGD with fewer elements per
    norm than its levels squared (error feedback needs a contraction: ``Capabilities.feedback_problem``)."""
    if spec.startswith("randomk") and "scale=" not in spec:
        spec += ",scale=false" if ":" in spec else ":scale=false"
    spec = spec.replace("quantize:bits=1,", "quantize:bits=2,")
    if spec == "qsgd:bits=2":  # no chunk is small enough for one level
        spec = "qsgd:bits=8,chunk=64"
    assert parse_spec(f"{spec}{',' if ':' in spec else ':'}ef=true")
    return f"{spec}{',' if ':' in spec else ':'}ef=true"


def index_bytes(n: int) -> int:
    return 1 if n <= 2**8 else 2 if n <= 2**15 else 4 if n <= 2**31 else 8


def expected_wire_bytes(compressor: Compressor, x: Tensor, payloads: list[Payload]) -> int:
    """The documented wire cost of compressing ``x``, summed over rounds (``payloads``)."""
    c = compressor.codec
    config: Any = c.config
    n, size = x.numel(), x.element_size()
    chunks = math.ceil(n / config.chunk) if hasattr(config, "chunk") else 0
    name = c.name
    if name == "none":
        return n * size
    if name in ("fp16", "bf16"):
        return 2 * n
    if name == "fp8":
        return n + 4 * chunks
    if name == "quantize":
        return math.ceil(n * config.bits / 8) + 8 * chunks
    if name == "qsgd":
        return math.ceil(n * config.bits / 8) + 4 * chunks
    if name == "terngrad":
        return math.ceil(n * 2 / 8) + 4 * chunks
    if name == "sign":
        return math.ceil(n / 8) + 4 * chunks
    if name in ("topk", "threshold"):
        sent = payloads[0][0].numel()
        if name == "topk" and config.method == "exact":
            assert sent == min(n, max(1 if n else 0, math.ceil(round(config.ratio * n, 6))))
        return sent * (size + index_bytes(n))
    if name == "randomk":
        return min(n, max(1 if n else 0, math.ceil(round(config.ratio * n, 6)))) * size
    if name == "powersgd":
        if x.dim() >= 2:
            rows, cols = x.shape[0], n // x.shape[0] if x.shape[0] else 0
            r = min(config.rank, rows, cols)
            if r and r * (rows + cols) < n:
                return 4 * r * (rows + cols)
        return n * size
    raise AssertionError(f"no formula for {name}")


def relative_error(approx: Tensor, exact: Tensor) -> float:
    return float((approx.double() - exact.double()).norm() / exact.double().norm().clamp_min(1e-30))
