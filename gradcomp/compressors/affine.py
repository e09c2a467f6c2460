"""The shared core of the quantizers: per-chunk affine codes, rounded nearest or stochastically.

Each chunk c maps to integer codes ``q = round((x - base[c]) / step[c]) + zero`` in ``0..levels``
and back to ``base[c] + (q - zero) * step[c]``. The quantizers differ only in how they choose them
(``quantize``: base = min, step = (max - min) / levels, zero = 0; ``qsgd``: no base, step = norm / s,
zero = s, so that the zero level decodes to exactly 0; ``terngrad``: the same with step = max) and in
what they send for them.

Stochastic rounding rounds up with probability equal to the fractional part, so E[q] equals the
real code and the quantizer is unbiased. The uniform noise is 8 random bits per element plus one
continuous offset per chunk: exactly uniform for every element, and only 1 byte of random data per
element (random bits cost more than all the arithmetic here). Rounding decisions within a chunk
share the offset, which correlates them by at most 1/256.

Rounding uses the float32 "magic number": adding 2**23 + 256 to y in [-256, 2**23) leaves round(y)
(to nearest, ties to even) plus 256 in the mantissa, so the uint8 code is the low byte of each float,
copied out with one strided read. That replaces a float -> uint8 conversion (several times dearer
than the add: ``docs/benchmarks.md``, "Why the kernels look as they do"). Cost per element: the map
(two passes), the rounding add, the byte copy, and for stochastic rounding 1 random byte, its
conversion and an add; temporaries live in the compressor's workspace.

The arithmetic is float32 (float64 for float64 inputs) unless a chunk's map does not fit float32:
a step below float32's smallest normal (1.2e-38: its reciprocal overflows, or loses precision) or
levels that span more than half of float32's range (x - base, or (q - zero) * step, would overflow).
Then the whole call computes in float64, which holds every such map exactly: any finite input
keeps the documented bound and decodes to finite values. Deciding costs one look at the per-chunk
steps on the host (a few microseconds; on a GPU, a synchronization).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors import chunks
from gradcomp.workspace import Workspace


def _magic(dtype: torch.dtype) -> float:
    """2**mantissa_bits: where the spacing of ``dtype`` is exactly 1 (2**23 for float32)."""
    return 1.0 / torch.finfo(dtype).eps


def _low_bytes(y: Tensor) -> Tensor:
    """The least significant byte of each element of ``y``, as a strided uint8 view."""
    size = y.element_size()
    return y.view(torch.uint8)[0 if sys.byteorder == "little" else size - 1 :: size]


FLOAT32 = torch.finfo(torch.float32)


@dataclasses.dataclass(frozen=True)
class Affine:
    """x = base + (q - zero) * step, per chunk; no base means 0.

    ``step`` may be wider than float32 (quantizers derive it in float64 from the float32 scales
    that travel), so that a step no float32 can hold still decodes exactly.
    """

    base: Tensor | None
    step: Tensor
    levels: int
    zero: int = 0

    def fits_float32(self) -> bool:
        """Whether float32 arithmetic holds this map for every finite chunk (see the module's notes).

        Non-finite steps (from NaN/Inf inputs) count as fitting: they travel to the decoder as they are.
        """
        if not self.step.numel():
            return True
        magnitude = self.step.abs()
        limit = FLOAT32.max / 2 / max(self.zero, self.levels - self.zero)
        low, high = host.values(torch.stack(torch.aminmax(magnitude)).float())
        if FLOAT32.tiny <= low and high <= limit:
            return True  # the common case, in one small reduction (the full test costs 3x more)
        misfit = ((magnitude < FLOAT32.tiny) & (magnitude > 0)) | ((magnitude > limit) & (magnitude < math.inf))
        return not host.flag(misfit.any())


def working_dtype(flat: Tensor, affine: Affine) -> torch.dtype:
    """float32 for every narrower input, float64 for float64 inputs and maps that float32 cannot hold."""
    if flat.dtype == torch.float64 or not affine.fits_float32():
        return torch.float64
    return torch.float32


def inverse_or_zero(scales: Tensor) -> Tensor:
    """1 / scale where the scale is positive, else 0: a constant (or NaN/Inf) chunk maps to code 0,
    and its scale carries the value (or the non-finite) back on decoding."""
    positive = scales > 0
    return torch.where(positive, 1.0 / torch.where(positive, scales, 1.0), 0.0)


def encode(flat: Tensor, affine: Affine, chunk: int, generator: torch.Generator | None, workspace: Workspace) -> Tensor:
    """Codes in ``0..levels``, stochastic when ``generator`` is given.

    Returns a contiguous uint8 workspace buffer: valid until the next call.
    """
    n = flat.numel()
    dtype = working_dtype(flat, affine)
    y = workspace.take("affine.y", n, dtype, flat.device)
    step = affine.step.to(dtype)
    positive = step > 0
    inverse = inverse_or_zero(step)
    base = None if affine.base is None else affine.base.to(dtype)
    if generator is not None:
        # Stochastic rounding is floor(y + u), u uniform in [0, 1), computed as round(y + u - 0.5).
        # u = (r + v) / 256: r, 8 random bits per element, and v, uniform in [0, 1) per chunk.
        # Their sum is exactly uniform, so each code is exactly unbiased, at a quarter of the random
        # bits that 32-bit noise would cost; (v / 256 - 0.5) steps are folded into the chunk's base.
        v = torch.rand(step.numel(), generator=generator, device=flat.device, dtype=torch.float64)
        shift = (v / 256 - 0.5) * torch.where(positive, step, 0.0).double()
        base = (-shift if base is None else base.double() - shift).to(dtype)
    for (view, rows), (y_view, _) in zip(chunks.parts(flat, chunk), chunks.parts(y, chunk), strict=True):
        if base is None:
            torch.mul(view, inverse[rows, None], out=y_view)
        else:
            torch.sub(view, base[rows, None], out=y_view)
            y_view.mul_(inverse[rows, None])
    if generator is not None:
        words = workspace.take("affine.random", -(-n // 8), torch.int64, flat.device)
        words.random_(-(2**63), None, generator=generator)  # all 64 bits; the default leaves the top one 0
        noise = workspace.take("affine.noise", n, y.dtype, flat.device)
        noise.copy_(words.view(torch.uint8)[:n])
        y.add_(noise, alpha=1 / 256)
        if affine.levels >= 255:
            # y's rounding error can lift y + u - 0.5 to levels + 0.5, i.e. code 256, whose low byte is 0
            y.clamp_(max=affine.levels - affine.zero)
    # + 256: y can be as low as -0.5, and below the magic number the spacing is 0.5, not 1.
    # A multiple of 256 keeps the low byte equal to the code.
    y.add_(_magic(y.dtype) + 256 + affine.zero)
    codes = workspace.take("affine.codes", n, torch.uint8, flat.device)
    codes.copy_(_low_bytes(y))  # one strided read; everything after works on contiguous bytes
    if generator is not None and affine.levels < 255:
        # Below 255 an overshoot to levels + 1 still fits in the byte; y >= -0.5 never rounds
        # below 0 (the tie goes to the even 256), so only the top needs clamping. Nearest rounding
        # needs neither: y is in [0, levels (1 + 2**-22)].
        codes.clamp_max_(affine.levels)
    return codes


def decode(codes: Tensor, affine: Affine, chunk: int, out: Tensor, workspace: Workspace) -> Tensor:
    """Write ``base + (codes - zero) * step`` per chunk into the flat floating tensor ``out``.

    Computed in the working dtype (:func:`working_dtype`) and rounded once into ``out``.
    """
    dtype = working_dtype(out, affine)
    exact = out if out.dtype == dtype else None
    values = exact if exact is not None else workspace.take("affine.decoded", out.numel(), dtype, out.device)
    values.copy_(codes)
    if affine.zero:
        values.sub_(affine.zero)
    step = affine.step.to(dtype)
    base = None if affine.base is None else affine.base.to(dtype)
    for view, rows in chunks.parts(values, chunk):
        view.mul_(step[rows, None])
        if base is not None:
            view.add_(base[rows, None])
    if exact is None:
        out.copy_(values)
    return out
