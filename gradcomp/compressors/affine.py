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
share the offset, which correlates them by at most 1/256. The bits come from a counter (seed, key,
draw, position: :mod:`gradcomp.compressors.counter`), so a part's chunks draw theirs in one pass.

Rounding uses the float32 "magic number": adding 2**23 + 256 to y in [-256, 2**23) leaves round(y)
(to nearest, ties to even) plus 256 in the mantissa, so the uint8 code is the low byte of each float,
copied out with one strided read. That replaces a float -> uint8 conversion (several times dearer
than the add: ``docs/benchmarks.md``, "Why the kernels look as they do"). Cost per element: the map
(two passes), the rounding add, the byte copy, and for stochastic rounding 1 random byte, its
conversion and an add; temporaries live in the compressor's workspace.

The arithmetic is float32 (float64 for float64 inputs). Where a chunk's map does not fit float32
(a step below 2**-64, whose reciprocal overflows or loses precision, or levels that span more than
2**126, where x - base or (q - zero) * step could overflow), the chunk is computed in units scaled
by a power of two (:func:`prescale`: 2**64 or 2**-8, else exactly 1): scaling by a power of two is
exact, so any finite input keeps the documented bound and decodes to finite values (the widest
chunks decode 2**-20 of their values closer to zero, far below their step, so that rounding
cannot carry the top level past float32's largest value). On the CPU, where a read is free, a call
whose chunks all fit skips the prescale's passes (:func:`gradcomp.host.unless`). The choice is
made per chunk on the device, with nothing read on the host (rule "host reads",
``docs/architecture.md``); on an accelerator it costs one multiplication pass each way.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.compressors import chunks, counter, fusion
from gradcomp.workspace import Workspace


def _magic(dtype: torch.dtype) -> float:
    """2**mantissa_bits: where the spacing of ``dtype`` is exactly 1 (2**23 for float32)."""
    return 1.0 / torch.finfo(dtype).eps


def _low_bytes(y: Tensor) -> Tensor:
    """The least significant byte of each element of ``y``, as a strided uint8 view."""
    size = y.element_size()
    return y.view(torch.uint8)[0 if sys.byteorder == "little" else size - 1 :: size]


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


def working_dtype(flat: Tensor) -> torch.dtype:
    """float32 for every narrower input, float64 for float64 inputs."""
    return torch.float64 if flat.dtype == torch.float64 else torch.float32


def prescale(affine: Affine) -> Tensor:
    """Per chunk, the power of two the map is computed in units of (float64): 2**64 where the step
    is below 2**-64, 2**-8 where the levels span more than 2**126, else 1. Either way x * prescale,
    the step and its reciprocal in those units, and every partial result sit well inside float32's
    normal range (chunks with such small steps hold only values below 2**-29 in magnitude)."""
    return _prescale(affine.step.double(), _widest(affine))


def _widest(affine: Affine) -> int:
    """The most steps a value lies from the zero level."""
    return max(affine.zero, affine.levels - affine.zero)


def _prescale(step: Tensor, widest: int) -> Tensor:
    magnitude = step.abs()
    tiny = (magnitude > 0) & (magnitude < 2.0**-64)
    return torch.where(tiny, 2.0**64, torch.where(magnitude * widest > 2.0**126, 2.0**-8, 1.0))


def inverse_or_zero(scales: Tensor) -> Tensor:
    """1 / scale where the scale is positive, else 0: a constant (or NaN/Inf) chunk maps to code 0,
    and its scale carries the value (or the non-finite) back on decoding."""
    positive = scales > 0
    return torch.where(positive, 1.0 / torch.where(positive, scales, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class Noise:
    """Stochastic rounding's randomness for the chunks of a tensor or a part's rows (:func:`noise`):
    one continuous offset per chunk and 8 random bits per element (the module's notes)."""

    offsets: Tensor
    """Per chunk, uniform in [0, 1) (float64)."""
    bytes: Tensor
    """(chunks, chunk): per element, uniform in 0..255 (uint8; a short last chunk's tail unused)."""


def noise(firsts: Tensor, chunk: int, workspace: Workspace) -> Noise:
    """The noise of chunks whose counters start at ``firsts`` (int64, one per chunk:
    :mod:`gradcomp.compressors.counter`). A chunk reads ``words(chunk) + 1`` consecutive counters:
    its bytes, 8 per word, then its offset; so every chunk's noise comes from one hash pass however
    many tensors the chunks belong to, each chunk's the same whichever rows hold it."""
    rows, width = firsts.numel(), words(chunk)
    hashed = workspace.take("noise.words", rows * (width + 1), torch.int64, firsts.device).view(rows, width + 1)
    scratch = workspace.take("noise.scratch", rows * (width + 1), torch.int64, firsts.device).view(rows, width + 1)
    counter.fill(firsts, hashed, scratch)
    offsets = counter.uniform(hashed[:, width], workspace.take("noise.offsets", rows, torch.float64, firsts.device))
    return Noise(offsets, hashed[:, :width].view(torch.uint8)[:, :chunk])


def words(chunk: int) -> int:
    """64-bit words of random bytes per chunk of ``chunk`` elements (one byte each)."""
    return -(-chunk // 8)


def encode(flat: Tensor, affine: Affine, chunk: int, firsts: Tensor | None, workspace: Workspace) -> Tensor:
    """Codes in ``0..levels``, stochastic where ``firsts`` gives each chunk's first counter (:func:`noise`).

    The full chunks run fused where :mod:`~gradcomp.compressors.fusion` compiles (bitwise what the
    operators below give, but for a non-finite chunk's codes: any in ``0..levels``; its scales decode
    it non-finite either way). Returns a contiguous uint8 workspace buffer: valid until the next call.
    """
    n = flat.numel()
    codes = workspace.take("affine.codes", n, torch.uint8, flat.device)
    body = n // chunk * chunk
    if body and _encode_whole_chunks(flat[:body], affine, chunk, firsts, workspace, codes[:body]):
        if n > body:  # a short last chunk: the eager operators, on it alone
            last = slice(body // chunk, body // chunk + 1)
            rest = None if firsts is None else noise(firsts[last], chunk, workspace)
            _encode_eager(flat[body:], _chunks(affine, last), chunk, rest, workspace, codes[body:])
        return codes
    randomness = None if firsts is None else noise(firsts, chunk, workspace)
    return _encode_eager(flat, affine, chunk, randomness, workspace, codes)


def _encode_whole_chunks(flat: Tensor, affine: Affine, chunk: int, firsts: Tensor | None, workspace: Workspace,
                         codes: Tensor) -> bool:  # fmt: skip
    """:func:`encode` of whole chunks by the fused kernels (the noise's hash, then the codes), or
    False, with nothing written, where they do not run."""
    if not _ENCODE.may_run(flat.device):
        return False
    count, width = flat.numel() // chunk, words(chunk) + 1
    hashed = None
    if firsts is not None:  # a loop of its own: inlined into the codes', the bytes' shifts cost more
        hashed = workspace.take("noise.words", count * width, torch.int64, flat.device).view(count, width)
        if not _HASH.run(firsts[:count], counter.steps(width, flat.device), hashed):
            return False
    base = None if affine.base is None else affine.base[:count].double()
    return _ENCODE.run(flat.view(count, chunk), codes.view(count, chunk), affine.step[:count].double(), base, hashed,
                       levels=affine.levels, zero=affine.zero, widest=_widest(affine))  # fmt: skip


def _chunks(affine: Affine, rows: slice) -> Affine:
    """The map of the chunks ``rows`` alone."""
    base = None if affine.base is None else affine.base[rows]
    return dataclasses.replace(affine, base=base, step=affine.step[rows])


def _encode_eager(flat: Tensor, affine: Affine, chunk: int, randomness: Noise | None, workspace: Workspace,
                  codes: Tensor) -> Tensor:  # fmt: skip
    """:func:`encode` in operators of their own, into ``codes``."""
    n = flat.numel()
    dtype = working_dtype(flat)
    y = workspace.take("affine.y", n, dtype, flat.device)
    pre = prescale(affine)
    step = affine.step.double() * pre
    positive = step > 0
    inverse = inverse_or_zero(step).to(dtype)
    base = None if affine.base is None else affine.base.double() * pre
    if randomness is not None:
        # Stochastic rounding is floor(y + u), u uniform in [0, 1), computed as round(y + u - 0.5).
        # u = (r + v) / 256: r, 8 random bits per element, and v, uniform in [0, 1) per chunk.
        # Their sum is exactly uniform, so each code is exactly unbiased, at a quarter of the random
        # bits that 32-bit noise would cost; (v / 256 - 0.5) steps are folded into the chunk's base.
        shift = (randomness.offsets / 256 - 0.5) * torch.where(positive, step, 0.0)
        base = -shift if base is None else base - shift
    scaled = host.unless((pre == 1).all())  # on the CPU, read to skip the prescale where none is needed
    pre, base = pre.to(dtype), None if base is None else base.to(dtype)
    for (view, rows), (y_view, _) in zip(chunks.parts(flat, chunk), chunks.parts(y, chunk), strict=True):
        source = torch.mul(view, pre[rows, None], out=y_view) if scaled else view
        if base is None:
            torch.mul(source, inverse[rows, None], out=y_view)
        else:
            torch.sub(source, base[rows, None], out=y_view)
            y_view.mul_(inverse[rows, None])
    if randomness is not None:
        drawn = randomness.bytes.shape[0]  # chunks
        bits = workspace.take("affine.noise", drawn * chunk, y.dtype, flat.device)
        bits.view(drawn, chunk).copy_(randomness.bytes)  # the one strided read of the bytes
        y.add_(bits[:n], alpha=1 / 256)
        if affine.levels >= 255:
            # y's rounding error can lift y + u - 0.5 to levels + 0.5, i.e. code 256, whose low byte is 0
            y.clamp_(max=affine.levels - affine.zero)
    # + 256: y can be as low as -0.5, and below the magic number the spacing is 0.5, not 1.
    # A multiple of 256 keeps the low byte equal to the code.
    y.add_(_magic(y.dtype) + 256 + affine.zero)
    codes.copy_(_low_bytes(y))  # one strided read; everything after works on contiguous bytes
    if affine.levels < 255:
        # Below 255 an overshoot to levels + 1 (stochastic rounding) still fits in the byte; y >=
        # -0.5 never rounds below 0 (the tie goes to the even 256), so only the top needs clamping.
        # A finite y rounded to the nearest is in [0, levels (1 + 2**-22)], but a NaN's low byte is
        # anything: a code past the levels would spill into its neighbours' bits when packed, and
        # a NaN chunk would corrupt another chunk's codes (its own decodes to NaN by its scale).
        codes.clamp_max_(affine.levels)
    return codes


def decode(codes: Tensor, affine: Affine, chunk: int, out: Tensor, workspace: Workspace) -> Tensor:
    """Write ``base + (codes - zero) * step`` per chunk into the flat floating tensor ``out``.

    Computed in the working dtype (:func:`working_dtype`), per chunk in the units of
    :func:`prescale`, and rounded into ``out``; the full chunks fused where
    :mod:`~gradcomp.compressors.fusion` compiles (bitwise the same).
    """
    n = out.numel()
    body = n // chunk * chunk
    if body and _decode_whole_chunks(codes[:body], affine, chunk, out[:body]):
        if n > body:  # a short last chunk: the eager operators, on it alone
            last = slice(body // chunk, body // chunk + 1)
            _decode_eager(codes[body:], _chunks(affine, last), chunk, out[body:], workspace)
        return out
    return _decode_eager(codes, affine, chunk, out, workspace)


def _decode_whole_chunks(codes: Tensor, affine: Affine, chunk: int, out: Tensor) -> bool:
    """:func:`decode` of whole chunks by the fused kernel, or False, with nothing written, where it
    does not run."""
    if not _DECODE.may_run(out.device):
        return False
    count = out.numel() // chunk
    base = None if affine.base is None else affine.base[:count].double()
    return _DECODE.run(codes.view(count, chunk), out.view(count, chunk), affine.step[:count].double(), base,
                       zero=affine.zero, widest=_widest(affine))  # fmt: skip


def _decode_eager(codes: Tensor, affine: Affine, chunk: int, out: Tensor, workspace: Workspace) -> Tensor:
    """:func:`decode` in operators of their own."""
    dtype = working_dtype(out)
    exact = out if out.dtype == dtype else None
    values = exact if exact is not None else workspace.take("affine.decoded", out.numel(), dtype, out.device)
    values.copy_(codes)
    if affine.zero:
        values.sub_(affine.zero)
    pre = prescale(affine)
    shrink = pre * torch.where(pre < 1, 1 - 2.0**-20, 1.0)  # the widest chunks: see the module's notes
    step = (affine.step.double() * shrink).to(dtype)
    base = None if affine.base is None else (affine.base.double() * shrink).to(dtype)
    unscale = (1 / pre).to(dtype) if host.unless((pre == 1).all()) else None
    for view, rows in chunks.parts(values, chunk):
        view.mul_(step[rows, None])
        if base is not None:
            view.add_(base[rows, None])
        if unscale is not None:
            view.mul_(unscale[rows, None])
    if exact is None:
        out.copy_(values)
    return out


def _hash_fused(firsts: Tensor, steps: Tensor, hashed: Tensor) -> None:
    """Each chunk's random words (:func:`noise`: its bytes' words, then its offset's), into ``hashed``
    (chunks, words + 1); ``steps``: :func:`gradcomp.compressors.counter.steps` of that width."""
    hashed.copy_(counter.mix(firsts[:, None] + steps[None, :]))


def _encode_fused(rows: Tensor, codes: Tensor, step: Tensor, base: Tensor | None, hashed: Tensor | None, *,
                  levels: int, zero: int, widest: int) -> None:  # fmt: skip
    """:func:`_encode_eager`'s arithmetic, element by element, for whole chunks: ``rows`` (chunks,
    chunk), into ``codes`` of that shape; ``step`` and ``base`` float64 per chunk; ``hashed`` each
    chunk's random words (:func:`_hash_fused`) for stochastic rounding."""
    dtype = working_dtype(rows)
    pre = _prescale(step, widest)
    step = step * pre
    positive = step > 0
    inverse = torch.where(positive, 1.0 / torch.where(positive, step, 1.0), 0.0).to(dtype)
    shifted = None if base is None else base * pre
    if hashed is not None:
        offsets = counter.uniform_of(hashed[:, -1])
        shift = (offsets / 256 - 0.5) * torch.where(positive, step, 0.0)
        shifted = -shift if shifted is None else shifted - shift
    y = rows.to(dtype) * pre.to(dtype)[:, None]
    y = y * inverse[:, None] if shifted is None else (y - shifted.to(dtype)[:, None]) * inverse[:, None]
    if hashed is not None:
        noise = hashed[:, :-1].view(torch.uint8)[:, : rows.shape[1]]  # the eager path's bytes
        y = y + noise.to(dtype) * (1 / 256)
    # Clamping y at the top level before rounding, and the code after, gives the eager path's codes
    # (rounding is monotone) whatever the levels, without its branch on them.
    y = y.clamp(max=levels - zero) + (_magic(dtype) + 256 + zero)
    low = y.view(torch.int64 if dtype == torch.float64 else torch.int32) & 255
    codes.copy_(low.to(torch.uint8).clamp(max=levels))


def _decode_fused(codes: Tensor, out: Tensor, step: Tensor, base: Tensor | None, *, zero: int, widest: int) -> None:
    """:func:`_decode_eager`'s arithmetic for whole chunks: ``codes`` (chunks, chunk) into ``out``."""
    dtype = working_dtype(out)
    pre = _prescale(step, widest)
    shrink = pre * torch.where(pre < 1, 1 - 2.0**-20, 1.0)
    values = codes.to(dtype)
    if zero:
        values = values - zero
    values = values * (step * shrink).to(dtype)[:, None]
    if base is not None:
        values = values + (base * shrink).to(dtype)[:, None]
    out.copy_(values * (1 / pre).to(dtype)[:, None])  # times 1 where no prescale: exact


_HASH = fusion.Kernel(_hash_fused, "noise hash")
_ENCODE = fusion.Kernel(_encode_fused, "affine encode")
_DECODE = fusion.Kernel(_decode_fused, "affine decode")
