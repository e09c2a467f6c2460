"""The shared core of the quantizers: per-chunk affine codes, rounded nearest or stochastically.

Each chunk c maps to integer codes ``q = round((x - offset[c]) / step[c])`` in ``0..levels`` and
back to ``offset[c] + q * step[c]``. The quantizers differ only in how they choose offset and step
(``quantize``: min and (max - min) / levels; ``qsgd``: -norm and norm / s; ``terngrad``: -max and
max) and in what they send for them.

Stochastic rounding rounds up with probability equal to the fractional part, so E[q] equals the
real code and the quantizer is unbiased. The noise has 16 random bits per element, which leaves a
bias below 2**-16 of a step, under float32's own resolution of codes near 255.

Cost per element: one pass to map, one to clamp and truncate to uint8, and for stochastic rounding
2 random bytes, a conversion and an add; the temporaries live in the compressor's workspace.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.compressors import chunks
from gradcomp.compressors.workspace import Workspace

NOISE_SCALE = 2.0**-16  # int16 noise r in [-2**15, 2**15) -> r * NOISE_SCALE in [-0.5, 0.5)


def encode(
    flat: Tensor,
    offset: Tensor,
    step: Tensor,
    levels: int,
    chunk: int,
    generator: torch.Generator | None,
    workspace: Workspace,
) -> Tensor:
    """Codes in ``0..levels`` (a uint8 workspace buffer), stochastic when ``generator`` is given."""
    n = flat.numel()
    y = workspace.take("affine.y", n, torch.float32, flat.device)
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    inverse = torch.where(step > 0, 1.0 / safe_step, torch.zeros_like(step))
    # Shift by half a step so that truncation toward zero rounds to nearest (or, with noise in
    # [-0.5, 0.5), rounds stochastically): floor(y + 0.5 + r) with y >= 0.
    half_shifted = offset - 0.5 * torch.where(step > 0, step, torch.zeros_like(step))
    for (view, rows), (y_view, _) in zip(chunks.parts(flat, chunk), chunks.parts(y, chunk), strict=True):
        torch.sub(view, half_shifted[rows, None], out=y_view)
        y_view.mul_(inverse[rows, None])
    if generator is not None:
        words = workspace.take("affine.random", -(-n // 4), torch.int64, flat.device)
        words.random_(-(2**63), None, generator=generator)  # all 64 bits; the default leaves the top one 0
        noise = workspace.take("affine.noise", n, torch.float32, flat.device)
        noise.copy_(words.view(torch.int16)[:n])
        y.add_(noise, alpha=NOISE_SCALE)
    y.clamp_(0.0, float(levels))
    codes = workspace.take("affine.codes", n, torch.uint8, flat.device)
    codes.copy_(y)  # float -> uint8 truncates toward zero; y >= 0, so this is floor
    return codes


def decode(
    codes: Tensor, offset: Tensor, step: Tensor, chunk: int, out: Tensor, workspace: Workspace
) -> Tensor:
    """Write ``offset + codes * step`` per chunk into the flat floating tensor ``out``.

    Low-precision outputs are computed in float32 and rounded once.
    """
    exact = out if out.dtype in (torch.float32, torch.float64) else None
    values = exact if exact is not None else workspace.take("affine.decoded", out.numel(), torch.float32, out.device)
    values.copy_(codes)
    for view, rows in chunks.parts(values, chunk):
        view.mul_(step[rows, None].to(values.dtype)).add_(offset[rows, None].to(values.dtype))
    if exact is None:
        out.copy_(values)
    return out
