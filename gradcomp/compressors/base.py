"""The compressor interface: what travels, what stays local, and how payloads aggregate.

A compressor turns one gradient tensor into a *payload* (a tuple of tensors, the only thing that
crosses the wire) and a *context* (anything, kept on this rank). Every compressor declares, in its
:class:`~gradcomp.compressors.capabilities.Capabilities` record, how payloads of several ranks
combine:

``Aggregation.SUM``
    Payloads are linear: the element-wise sum of all ranks' payloads is itself a valid payload,
    and decompressing it gives the sum of the (compressed) gradients. The engine all-reduces them.
    Casts, shared-seed random-k and PowerSGD's factors are of this kind.
``Aggregation.GATHER``
    Everything else. The engine all-gathers the payloads and calls :meth:`Compressor.decompress_sum`,
    which decompresses and sums them in one vectorized pass per rank, in rank order (so that every
    rank gets bitwise the same result).

The protocol, for one tensor on every rank (``simulate.py`` runs it for p ranks in one process)::

    payload, ctx = c.compress(grad, key)
    for r in range(1, c.capabilities.rounds): # multi-round compressors only (PowerSGD: P, then Q)
        payload = aggregate(payload)          # all-reduce (SUM) on every rank, same order
        payload, ctx = c.next_round(payload, ctx)
    final = aggregate(payload)                # all-reduce (SUM) or all-gather (GATHER)
    result = c.decompress(final, ctx)         # SUM: the sum of the gradients
    result = c.decompress_sum(finals, ctx)    # GATHER: the same, from the list of payloads

The engine never averages inside a compressor: it divides before summing where precision demands
it (rule "divide before sum", ``docs/architecture.md``) and averages exactly once.

Input policy (the same for every compressor, tested in ``tests/test_input_policy.py``):

* Floating-point tensors only; integer or boolean tensors raise :class:`TypeError`.
* Empty tensors are valid: they compress to payload tensors with no elements (plus the fixed-size
  parts a compressor always sends) and decompress to an empty tensor of the same shape and dtype.
* Non-contiguous tensors are compressed from a contiguous copy (one extra pass); the result has the
  input's shape and is contiguous.
* NaN and Inf are never dropped silently: if the input holds a non-finite value, the decompressed
  result holds at least one non-finite value (within the affected chunk for chunked quantizers,
  anywhere for sparsifiers), so that :class:`torch.amp.GradScaler` sees the overflow and skips the
  step. Casts to fp16/bf16 turn finite values beyond the target range into Inf, as a cast does.

Threads: a compressor reuses scratch buffers between calls, one set per calling thread (see
:class:`~gradcomp.workspace.Workspace`). One thread may compress a key while another
decompresses a different key (the engine does, to overlap buckets); never use one key from two
threads at once.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from gradcomp.compressors.capabilities import Aggregation as Aggregation  # re-exported: the interface's name
from gradcomp.compressors.capabilities import Capabilities, ratio_option
from gradcomp.compressors.segments import Segments
from gradcomp.options import format_value
from gradcomp.workspace import Workspace

Payload = tuple[Tensor, ...]
"""The tensors that travel. Nothing else crosses the wire."""

Key = Hashable
"""A stable identity of the tensor being compressed (e.g. the names of a bucket's parameters).

State that outlives one call (PowerSGD's warm start, error-feedback residuals) is keyed by it. Use
plain values (str, int, tuples of them) so that state dicts load with ``weights_only=True``."""


@dataclasses.dataclass(frozen=True)
class CompressorConfig:
    """Base of every compressor's config: a frozen dataclass validated in ``__post_init__``.

    Fields are the options of the compressor's spec (``"topk:ratio=0.01"``); their type hints drive
    the parsing of spec strings (see :mod:`gradcomp.compressors.registry`).
    """


@dataclasses.dataclass(frozen=True)
class ChunkedConfig(CompressorConfig):
    """Configs of compressors that send a scale per chunk of consecutive elements."""

    chunk: int = 1024
    """Elements per scale: smaller chunks follow the gradient's magnitudes more closely and send
    more scales."""

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")


def spec_text(name: str, config: CompressorConfig, extra: Sequence[str] = ()) -> str:
    """``name:key=value,...``: the spec string of a compressor and its config."""
    options = [f"{f.name}={format_value(getattr(config, f.name))}" for f in dataclasses.fields(config)]
    options += extra
    return f"{name}:{','.join(options)}" if options else name


class Compressor(ABC):
    """Base class: subclasses set ``name`` and ``Config``, declare their :class:`Capabilities`
    (:meth:`declare`) and implement the codec.

    Args:
        config: the compressor's options.
        seed: seed of the generators this compressor owns. Use the same seed on every rank.
        rank: this process's rank. Randomness that must agree between ranks (random-k indices,
            PowerSGD's initial factors) uses ``seed`` alone; randomness that should be independent
            between ranks (stochastic rounding) mixes in ``rank``.
    """

    name: str
    """The registry name (a class attribute; wrappers set it per instance)."""
    Config: ClassVar[type[CompressorConfig]]

    @classmethod
    @abstractmethod
    def declare(cls, config: CompressorConfig) -> Capabilities:
        """This compressor's record with ``config``: its aggregation, and whatever else it can promise
        (:class:`~gradcomp.compressors.capabilities.Capabilities`, whose defaults are safe for any
        compressor). Read through :attr:`capabilities`, or a spec's ``capabilities``; called once
        per instance and per spec that asks, so keep it a pure function of the config."""
        raise TypeError(
            f"{cls.__name__} declares no capabilities: define the classmethod declare(config) returning a "
            "Capabilities record, at least its aggregation (Capabilities(Aggregation.GATHER))"
        )

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """What this compressor declares, for its config (error feedback: its inner compressor's,
        with what it changes). The engine and the cost model read it; computed once."""
        return self.declare(self.config)

    def __init__(self, config: CompressorConfig | None = None, *, seed: int = 0, rank: int = 0) -> None:
        config = self.Config() if config is None else config
        if not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__} takes a {self.Config.__name__}, got {type(config).__name__}")
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.config = config
        self.seed = seed
        self.rank = rank
        self.workspace = Workspace()

    def __repr__(self) -> str:
        """The spec that builds this compressor."""
        return spec_text(self.name, self.config)

    @property
    def codec(self) -> Compressor:
        """The compressor that encodes this one's payloads: itself, or for a wrapper (error
        feedback) the compressor it wraps. Its ``decompress`` and ``decompress_sum`` read any
        rank's payload from a :class:`Meta` context, without this compressor's state."""
        return self

    @property
    def has_feedback(self) -> bool:
        """True when this compressor keeps an error-feedback residual (``ef=true``)."""
        return False

    # -- the codec ---------------------------------------------------------------------------------

    @abstractmethod
    def compress(
        self, tensor: Tensor, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Any]:
        """Compress ``tensor``; return the (first round's) payload and the local context.

        Args:
            tensor: a floating-point gradient of any shape.
            key: stable identity of this tensor, for compressors that keep state between steps.
            shapes: when ``tensor`` is the flat concatenation of several tensors (a DDP bucket),
                their shapes in order. Compressors that exploit structure (PowerSGD) use it; the
                others ignore it.
        """

    def compress_divided(
        self,
        tensor: Tensor,
        divisor: float,
        key: Key = None,
        shapes: Sequence[torch.Size] | None = None,
        *,
        ratio: float | None = None,
    ) -> tuple[Payload, Any]:
        """``compress(tensor / divisor)``: the first step of an average over ``divisor`` ranks (the
        engine's; rule "divide before sum"). ``tensor`` is scratch afterwards: the engine writes the
        result over it. The default divides in place, then compresses; a compressor that can fold
        the division into its own first pass overrides this (error feedback), with bitwise
        the same payload and state, for one memory pass fewer. ``ratio``: a warm-up's keep-ratio,
        handed to ``compress`` as ``ratio=`` (ratio-based compressors only, ``Capabilities.ratio``);
        None, the default, hands nothing."""
        return self.compress(tensor.div_(divisor), key, shapes, **ratio_option(ratio))

    # -- a part of a bucket at once --------------------------------------------------------------------

    def compress_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[tuple[Payload, Any]]:
        """Every tensor of a part of ``buffer`` (``segments``) compressed divided by ``divisor``: what
        :meth:`compress_divided` gives each, in order (the engine's one call per part). The default
        compresses them one by one; a compressor that compresses a part in a number of kernels that
        does not grow with its tensors overrides this and the three methods below, each tensor's
        result kept (its chunks, scales, k, state) or its difference bounded and documented."""
        views, options = segments.views(buffer), ratio_option(ratio)
        return [self.compress_divided(t, divisor, k, **options) for t, k in zip(views, segments.keys, strict=True)]

    def measure_part(
        self, buffer: Tensor, segments: Segments, divisor: float, *, ratio: float | None = None
    ) -> list[Measured]:
        """:meth:`measure_divided` of every tensor of a part (:meth:`compress_part`'s counterpart)."""
        views, options = segments.views(buffer), ratio_option(ratio)
        return [self.measure_divided(t, divisor, k, **options) for t, k in zip(views, segments.keys, strict=True)]

    def decompress_part(self, payloads: Sequence[Payload], contexts: Sequence[Any], buffer: Tensor,
                        segments: Segments) -> None:  # fmt: skip
        """Every tensor of a part decompressed into its place in ``buffer`` (:meth:`decompress`)."""
        for payload, ctx, view in zip(payloads, contexts, segments.views(buffer), strict=True):
            self.decompress(payload, ctx, out=view)

    def decompress_sum_part(self, gathered: Sequence[Sequence[Payload]], contexts: Sequence[Any], buffer: Tensor,
                            segments: Segments) -> None:  # fmt: skip
        """Every tensor of a part summed from every rank's payloads (``gathered[i]``: tensor i's, in
        rank order) into its place in ``buffer`` (:meth:`decompress_sum`)."""
        for everyone, ctx, view in zip(gathered, contexts, segments.views(buffer), strict=True):
            self.decompress_sum(everyone, ctx, out=view)

    def dense_share(self, tensor: Tensor, divisor: float, key: Key = None) -> None:
        """What this rank adds to an uncompressed sum (a warm-up step: ``HookSpec.warmup``), in
        place: ``tensor / divisor``. Error feedback adds what it keeps (momentum, residual)."""
        tensor.div_(divisor)

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any, out: Tensor | None = None) -> Tensor:
        """Reconstruct a tensor of the input's shape and dtype from a (final) payload.

        For ``SUM`` compressors ``payload`` may be the sum of every rank's payload. Writes into
        ``out`` (same shape and dtype as the input) when given; otherwise the result may alias the
        payload.
        """

    def next_round(self, payload: Payload, ctx: Any) -> tuple[Payload, Any]:
        """Turn the aggregated payload of one round into this rank's payload of the next round.

        Only multi-round compressors (``capabilities.rounds > 1``) implement it.
        """
        raise TypeError(f"{self.name} is a single-round compressor; next_round is never called")

    def decompress_sum(self, payloads: Sequence[Payload], ctx: Any, out: Tensor | None = None) -> Tensor:
        """Decompress every rank's payload and sum them, in rank order, into one tensor.

        ``ctx`` is this rank's context (only its shape and dtype information is used). Low-precision
        results are accumulated in float32 and rounded once. Subclasses override this when they can
        sum without densifying each payload (sparse payloads use ``index_add_``).
        """
        if not payloads:
            raise ValueError("decompress_sum needs at least one payload")
        result = self.decompress(payloads[0], ctx, out=out)
        if len(payloads) == 1:
            return result
        if out is None and _shares_memory(result, payloads[0]):
            result = result.clone()  # the sum must not be written into rank 0's payload
        if result.dtype in (torch.float16, torch.bfloat16):
            acc = result.float()
            for payload in payloads[1:]:
                acc.add_(self.decompress(payload, ctx))
            return result.copy_(acc)
        scratch = self.workspace.take("decompress_sum", result.numel(), result.dtype, result.device)
        for payload in payloads[1:]:
            result.add_(self.decompress(payload, ctx, out=scratch.view_as(result)))
        return result

    def contribution(self, payload: Payload, ctx: Any, out: Tensor | None = None) -> Tensor:
        """What this rank's own final payload contributes to the aggregate, as a dense tensor.

        Error feedback keeps ``compensated - contribution`` as its residual. For almost every
        compressor this is :meth:`decompress` of the local payload; PowerSGD overrides it so that
        reconstructing locally leaves its warm-start memory untouched.
        """
        return self.decompress(payload, ctx, out=out)

    def state_keys(self) -> list[Key]:
        """The keys this compressor keeps per-tensor state for that :meth:`take_residual` hands over
        or forgets (error feedback's); a caller collects every part of a tensor's state from them
        (:func:`gradcomp.compressors.keys.of_parameter`). None by default."""
        return []

    def take_residual(self, key: Key) -> Tensor | None:
        """Hand over what this compressor has not sent yet of tensor ``key``'s gradients, and forget
        the tensor's feedback state: for a caller that averages ``key`` another way from now on (the
        ``auto`` hook switching a tensor's method), which adds it to the tensor's next gradient, so
        nothing is lost. In the units of the tensors this compressor was given (the engine's: the
        gradient over the world size). None: nothing is owed (a compressor without error feedback;
        error feedback's variants: :meth:`gradcomp.compressors.feedback.ErrorFeedback.take_residual`)."""
        return None

    def rescale(self, ratio: Tensor) -> None:
        """Multiply the state this compressor keeps in the units of its gradients by ``ratio`` (a
        0-d tensor): the gradients' scale changed (a ``GradScaler``'s loss scale, which the hook
        follows). A compressor that keeps no such state (the default) has nothing to do; error
        feedback multiplies its residuals, velocities and estimates, exactly (the scale's ratios are
        powers of two)."""
        return None

    def sent_indices(self, payload: Payload, ctx: Any) -> Tensor | None:
        """The flat indices (int64) of the elements ``payload`` carries, for compressors that select
        some (sparsifiers, random-k); None for the others, which carry every element in part.
        Momentum factor masking clears the velocity there."""
        return None

    def subtract_contribution(self, payload: Payload, ctx: Any, tensor: Tensor) -> bool:
        """``tensor -= contribution`` in place, in one fused pass, if this compressor can (and its
        payload does not alias ``tensor``); return whether it did. Error feedback then keeps
        ``tensor`` as the residual, instead of materializing the contribution and subtracting it
        (two passes fewer). The default cannot: it returns False and leaves ``tensor`` alone."""
        return False

    # -- payloads sized by their values --------------------------------------------------------------

    def measure(self, tensor: Tensor, key: Key = None) -> Measured:
        """What :meth:`compress_measured` needs to size ``tensor``'s payload, computed on the device
        (nothing read on the host): its count, and what the compression will take."""
        raise TypeError(f"{self.name}'s payload has a size the tensor alone decides: nothing to measure")

    def measure_divided(
        self, tensor: Tensor, divisor: float, key: Key = None, *, ratio: float | None = None
    ) -> Measured:
        """:meth:`measure` of ``tensor / divisor`` (divided in place, as :meth:`compress_divided`
        does, and given ``ratio`` as it does)."""
        return self.measure(tensor.div_(divisor), key, **ratio_option(ratio))

    def compress_measured(
        self, measured: Measured, count: int, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Any]:
        """:meth:`compress` of what :meth:`measure` counted (``measured``, handed back by the caller),
        its count now read on the host (``count``): the same payload, sized without a read. Its
        tensors are 1-D, of :meth:`payload_length` elements."""
        raise TypeError(f"{self.name}'s payload has a size the tensor alone decides: nothing to measure")

    def compress_measured_part(
        self, measured: Sequence[Measured], counts: Sequence[int], segments: Segments
    ) -> list[tuple[Payload, Any]]:
        """:meth:`compress_measured` of everything :meth:`measure_part` measured of a part, each at
        its count now read on the host (the engine's one call per part). The default takes one
        record per tensor; a compressor that measures a part in fewer records overrides both."""
        counted = zip(measured, counts, segments.keys, strict=True)
        return [self.compress_measured(record, count, key) for record, count, key in counted]

    def payload_length(self, count: int, measured: Measured) -> int:
        """The length of each payload tensor of a tensor measured ``count`` on any rank, from this
        rank's ``measured`` of the same tensor (the same key: its shape, and so its cap, agree)."""
        return count

    # -- accounting and state ----------------------------------------------------------------------

    @staticmethod
    def wire_bytes(payload: Payload) -> int:
        """Bytes this payload puts on the wire: exactly the payload tensors' storage."""
        return sum(t.numel() * t.element_size() for t in payload)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only, loadable with ``torch.load(..., weights_only=True)``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"{self.name} keeps no state, got keys {sorted(state)}")


@dataclasses.dataclass(frozen=True)
class Measured:
    """What :meth:`Compressor.measure` found for one tensor, for :meth:`Compressor.compress_measured`
    and :meth:`Compressor.payload_length`: the caller keeps it between them (the engine, from the
    backward's thread to the executor's), so nothing waits inside the compressor for another thread."""

    count: Tensor
    """The payload's size as the device counted it: a 0-d int64 tensor, read on the host later."""
    tensor: Tensor
    """What :meth:`Compressor.compress_measured` compresses: the tensor measured (error feedback's:
    the compensated gradient, in a buffer kept per key, valid until the key is compressed again)."""
    k: int = 0
    """The most elements the payload carries, for a compressor that caps its count (sampled top-k's
    k); 0 for the others."""
    threshold: Tensor | None = None
    """The cut the count was taken at, for a compressor that estimated one (sampled top-k's, 0-d);
    None for the others."""
    rows: int | None = None
    """Payload tensors of ``rows`` rows of :meth:`Compressor.payload_length` elements each (a size
    group's: :mod:`gradcomp.compressors.sizes`); None: 1-D."""

    def shape(self, length: int) -> tuple[int, ...]:
        """The shape of each payload tensor of ``length`` (:meth:`Compressor.payload_length`)."""
        return (length,) if self.rows is None else (self.rows, length)


@dataclasses.dataclass(frozen=True)
class Meta:
    """The context most compressors need: what the input looked like."""

    shape: torch.Size
    dtype: torch.dtype
    numel: int

    @classmethod
    def of(cls, tensor: Tensor) -> Meta:
        return cls(tensor.shape, tensor.dtype, tensor.numel())

    def empty(self, device: torch.device) -> Tensor:
        """A new flat tensor for the decompressed result."""
        return torch.empty(self.numel, dtype=self.dtype, device=device)


def flat_out(out: Tensor | None, meta: Meta, device: torch.device) -> Tensor:
    """The flat tensor to decompress into: ``out`` (checked) or a new one."""
    if out is None:
        return meta.empty(device)
    if out.numel() != meta.numel or out.dtype != meta.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {meta.dtype} tensor of {meta.numel} elements, "
            f"got {out.dtype} with {out.numel()} elements (contiguous={out.is_contiguous()})"
        )
    return out.view(-1)


def _shares_memory(tensor: Tensor, payload: Payload) -> bool:
    storage = tensor.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == storage for t in payload)


def check_gradient(tensor: Tensor) -> Tensor:
    """Apply the input policy: refuse non-floating tensors, return a contiguous flat view."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"gradient compressors take floating-point tensors, got dtype {tensor.dtype}")
    return tensor.contiguous().view(-1)
