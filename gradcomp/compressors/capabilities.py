"""What a compressor declares about itself, in one record: how its payloads combine, and what the
engine, the cost model and the conformance kit may rely on.

A compressor declares its record once, from its config (:meth:`Compressor.declare
<gradcomp.compressors.base.Compressor.declare>`); code that holds a compressor reads
``compressor.capabilities``, code that holds only a spec reads ``spec.capabilities``
(:class:`gradcomp.compressors.registry.Spec`), error feedback's changes included: code outside the
compressors asks for the record, never a compressor's class or attributes.

Only the aggregation has no default: every other field defaults to what is safe for any
compressor (one round, tensor by tensor, whole tensors, sizes exchanged, every bad step checked in
full), so a compressor from another package declares ``Capabilities(Aggregation.GATHER)`` and
works; each field it sets besides buys a faster path, which the conformance kit
(:mod:`gradcomp.testing`) checks it for.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any


class Aggregation(str, enum.Enum):
    """How payloads of several ranks combine (:mod:`gradcomp.compressors.base`)."""

    SUM = "sum"
    """Payloads are linear: the element-wise sum of every rank's is itself a payload, decompressing
    to the sum of the gradients. The engine all-reduces them."""
    GATHER = "gather"
    """Everything else: the engine all-gathers them and sums what they decompress to, in rank order."""


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """One compressor's declared behaviour (the module's docstring says who reads it)."""

    aggregation: Aggregation
    """How payloads of several ranks combine (rule "declared aggregation"): the engine's route
    (``HookSpec.route``: all-reduce, all-gather or two-phase), the cost model's, the simulation's."""
    rounds: int = 1
    """Communication rounds per tensor: more than one (PowerSGD's two) means ``next_round`` is called
    between, with the round's all-reduced payload. The engine and the simulation drive the rounds."""
    elementwise: bool = False
    """Compressing a concatenation gives the concatenation of the payloads, with no state (the
    casts): the engine then compresses a bucket whole, into one payload, and the cost model prices it
    so. Error feedback's keyed state ends it."""
    local: bool = False
    """Compression is local to each element (the casts) or to each chunk of :attr:`piece_multiple`
    consecutive elements (the quantizers, sign, fp8): a tensor compressed in pieces cut at multiples
    of it is the tensor compressed whole (bitwise for the deterministic ones), which ``HookSpec.pieces``
    needs. Error feedback keeps it, except with ``clip`` (a norm of the whole tensor)."""
    piece_multiple: int = 1
    """For :attr:`local` compressors, the elements a piece holds a multiple of: their chunk, or 1."""
    needs_shapes: bool = False
    """Compression relies on the tensors' shapes (PowerSGD's low rank of each matrix): a flat shard
    of sharded data parallelism (FSDP2, HSDP) has none, and sharded training refuses it."""
    same_shapes: bool = False
    """Every rank's payload for a tensor has the same shapes (fixed-size codes, exact top-k): the
    engine all-gathers ``gather`` payloads without exchanging their sizes, so with nothing to read on
    the host. False where the payload's size depends on the values."""
    measures: bool = False
    """The payload's size depends on the values and ``measure`` counts it on the device beforehand
    (threshold, sampled top-k): on an accelerator the engine gathers every rank's counts of a bucket,
    reads them once, and compresses each tensor with ``compress_measured`` at its known size (rule
    "host reads")."""
    ratio: float | None = None
    """For sparsifiers that keep a fraction of the elements (topk, randomk): that fraction, their
    config's. A warm-up (``HookSpec.warmup``) schedules lower ratios down to it, passed as ``ratio=``
    to their compressing calls (compress, compress_divided, measure, measure_divided). None: the
    compressor keeps no ratio, and takes no ``ratio=``."""
    dense_from: float = 1.0
    """For ratio-based sparsifiers, the keep-ratio from which their payload carries at least the
    uncompressed gradient's bytes (topk: 0.5, values and 4-byte indices): warm-up steps scheduled at
    or above it go uncompressed instead, which is exact and no dearer."""
    payload_shows_non_finite: bool = False
    """A non-finite input, or a contribution that would overflow, always puts a non-finite value into
    the payload's floating tensors: error feedback then checks the payload (a few elements) for a bad
    step, instead of a pass over a whole tensor."""
    unbiased: bool = False
    """E[decompress(compress(x))] == x over the compressor's randomness: the conformance kit then
    measures the mean instead of checking for a contraction. Error feedback is biased by design."""
    whole_part: bool = False
    """It compresses every tensor of a part of a bucket at once (``Compressor.compress_part``), in
    operators that do not grow with the tensors (but for stochastic rounding's two noise draws per
    tensor), each tensor's result kept (the chunked compressors, and the casts for error feedback's
    sake: :mod:`gradcomp.compressors.rows`):
    the cost model prices a part as one tensor of its elements. Error feedback keeps it in its
    classic form, momentum correction included (not with clipping or EF21)."""
    feedback_problem: str | None = None
    """Why error feedback cannot wrap this compressor (None: it can): it needs a contraction,
    ``|C(x) - x| < |x|``, and a compressor that scales what it keeps up is none, its residual growing
    without bound. Specs with ``ef=`` are refused with this reason when parsed."""

    def __post_init__(self) -> None:
        if not isinstance(self.aggregation, Aggregation):
            raise TypeError(f"aggregation must be an Aggregation (SUM or GATHER), got {self.aggregation!r}")
        for name in ("rounds", "piece_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1] or None, got {self.ratio}")
        if not (math.isfinite(self.dense_from) and 0.0 < self.dense_from <= 1.0):
            raise ValueError(f"dense_from must be in (0, 1], got {self.dense_from}")
        if self.same_shapes and self.measures:
            raise ValueError("same_shapes and measures contradict: a measured payload's size depends on the values")

    @property
    def ratio_based(self) -> bool:
        """Whether the compressor keeps a fraction of the elements (:attr:`ratio`), which a warm-up lowers."""
        return self.ratio is not None


def ratio_option(ratio: float | None) -> dict[str, Any]:
    """The keyword arguments that hand a warm-up's keep-ratio to a compressing call: ``ratio=`` when
    there is one, nothing otherwise, so that a compressor that keeps no ratio is called as always."""
    return {} if ratio is None else {"ratio": ratio}
