"""The compressor interface: what travels, what stays local, and how payloads aggregate.

A compressor turns one gradient tensor into a *payload* (a tuple of tensors, the only thing that
crosses the wire) and a *context* (anything, kept on this rank). Every compressor declares how
payloads of several ranks combine:

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
    for r in range(1, c.rounds):              # multi-round compressors only (PowerSGD: P, then Q)
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
import enum
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from gradcomp import host
from gradcomp.options import format_value
from gradcomp.workspace import Workspace

Payload = tuple[Tensor, ...]
"""The tensors that travel. Nothing else crosses the wire."""

Key = Hashable
"""A stable identity of the tensor being compressed (e.g. the names of a bucket's parameters).

State that outlives one call (PowerSGD's warm start, error-feedback residuals) is keyed by it. Use
plain values (str, int, tuples of them) so that state dicts load with ``weights_only=True``."""


class Aggregation(str, enum.Enum):
    """How payloads of several ranks combine (see the module docstring)."""

    SUM = "sum"
    GATHER = "gather"


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


def piece_multiple(config: CompressorConfig) -> int:
    """Elements a piece of a tensor holds a multiple of, for a :attr:`Compressor.local` compressor
    with ``config`` to compress it as it compresses the whole: its chunk, or 1."""
    return config.chunk if isinstance(config, ChunkedConfig) else 1


def spec_text(name: str, config: CompressorConfig, extra: Sequence[str] = ()) -> str:
    """``name:key=value,...``: the spec string of a compressor and its config."""
    options = [f"{f.name}={format_value(getattr(config, f.name))}" for f in dataclasses.fields(config)]
    options += extra
    return f"{name}:{','.join(options)}" if options else name


class Compressor(ABC):
    """Base class: subclasses set ``name``, ``aggregation``, ``Config`` and implement the codec.

    Args:
        config: the compressor's options.
        seed: seed of the generators this compressor owns. Use the same seed on every rank.
        rank: this process's rank. Randomness that must agree between ranks (random-k indices,
            PowerSGD's initial factors) uses ``seed`` alone; randomness that should be independent
            between ranks (stochastic rounding) mixes in ``rank``.
    """

    name: str
    """The registry name (a class attribute; wrappers set it per instance)."""
    aggregation: Aggregation
    Config: ClassVar[type[CompressorConfig]]
    rounds: int = 1
    """Communication rounds per tensor; more than one means :meth:`next_round` is called between."""
    elementwise: ClassVar[bool] = False
    """True when compressing a concatenation gives the concatenation of the payloads, with no
    state (the casts): the engine then compresses a bucket as one tensor, into one payload."""
    local: ClassVar[bool] = False
    """True when compression is local to each element (the casts) or to each chunk of the config's
    ``chunk`` consecutive elements (the quantizers, sign, fp8): a tensor compressed in pieces cut at
    multiples of :func:`piece_multiple` is then the tensor compressed whole (bitwise for the
    deterministic ones), which ``HookSpec.pieces`` needs."""
    needs_shapes: ClassVar[bool] = False
    """True when compression relies on the tensors' shapes (PowerSGD's low rank of each matrix): a
    flat shard of sharded data parallelism has none, and sharded training refuses such compressors."""
    ratio_based: ClassVar[bool] = False
    """True for sparsifiers that keep a fraction ``ratio`` of the elements (topk, randomk): the
    fraction in force starts at the config's, and a warm-up schedule lowers it step by step
    (``HookSpec.warmup``) through :meth:`set_ratio`."""
    ratio: float = 1.0
    """The fraction of the elements a payload keeps, for ratio-based sparsifiers: the one in force."""
    dense_from: ClassVar[float] = 1.0
    """For ratio-based sparsifiers, the keep-ratio from which their payload carries at least the
    uncompressed gradient's bytes (topk: 0.5, values and 4-byte indices): warm-up steps scheduled at
    or above it go uncompressed instead, which is exact and no dearer."""
    @property
    def same_shapes(self) -> bool:
        """True when every rank's payload for a tensor has the same shapes (fixed-size codes, exact
        top-k): the engine then all-gathers ``gather`` payloads without exchanging their sizes, so
        with nothing to read on the host. False where the payload's size depends on the values."""
        return False

    payload_shows_non_finite: ClassVar[bool] = False
    """True when a non-finite input, or a contribution (:meth:`contribution`) that would overflow,
    always puts a non-finite value into the payload's floating tensors: error feedback then checks
    the payload (a few elements) for a bad step, instead of a pass over a whole tensor."""

    @classmethod
    def feedback_problem(cls, config: CompressorConfig) -> str | None:
        """Why error feedback cannot wrap this compressor with ``config`` (None: it can). Error
        feedback needs a contraction, ``|C(x) - x| < |x|``; a compressor that scales what it keeps up
        is none, and its residual grows without bound."""
        return None

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
    def unbiased(self) -> bool:
        """True when E[decompress(compress(x))] == x (over the compressor's randomness)."""
        return False

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
        self, tensor: Tensor, divisor: float, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Any]:
        """``compress(tensor / divisor)``: the first step of an average over ``divisor`` ranks (the
        engine's; rule "divide before sum"). ``tensor`` is scratch afterwards: the engine writes the
        result over it. The default divides in place, then compresses; a compressor that can fold
        the division into its own first pass overrides this (error feedback), with bitwise
        the same payload and state, for one memory pass fewer."""
        return self.compress(tensor.div_(divisor), key, shapes)

    def set_ratio(self, ratio: float) -> None:
        """Keep ``ratio`` of the elements from the next compression on: ratio-based sparsifiers
        (:attr:`ratio_based`) only, whose warm-up (``HookSpec.warmup``) sets it at every step."""
        if not self.ratio_based:
            raise TypeError(f"{self.name} keeps no ratio of the elements: only topk and randomk take one")
        self.ratio = ratio

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

        Only multi-round compressors (``rounds > 1``) implement it.
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

    @property
    def measures(self) -> bool:
        """True when the payload's size depends on the values and :meth:`measure` counts it on the
        device beforehand: on an accelerator the engine then gathers every rank's counts of a
        bucket, reads them in one host read, and compresses with :meth:`compress_measured`, instead
        of a read per tensor for its own size and more for every rank's (rule "host reads")."""
        return False

    def measure(self, tensor: Tensor, key: Key = None) -> Tensor:
        """What :meth:`compress_measured` needs to size ``tensor``'s payload: a count, as a 0-d int64
        tensor computed on the device (nothing read on the host)."""
        raise TypeError(f"{self.name}'s payload has a size the tensor alone decides: nothing to measure")

    def measure_divided(self, tensor: Tensor, divisor: float, key: Key = None) -> Tensor:
        """:meth:`measure` of ``tensor / divisor`` (divided in place, as :meth:`compress_divided`
        does): ``tensor`` then holds what :meth:`compress_measured` compresses."""
        return self.measure(tensor.div_(divisor), key)

    def compress_measured(
        self, tensor: Tensor, count: int, key: Key = None, shapes: Sequence[torch.Size] | None = None
    ) -> tuple[Payload, Any]:
        """:meth:`compress` of a tensor that :meth:`measure` counted ``count`` for (now read on the
        host): the same payload, sized without a read. Its tensors are 1-D, of
        :meth:`payload_length` elements."""
        raise TypeError(f"{self.name}'s payload has a size the tensor alone decides: nothing to measure")

    def payload_length(self, count: int, key: Key = None) -> int:
        """The length of each payload tensor of a tensor measured ``count``, on any rank (the same
        ``key``: the same tensor's shape there)."""
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


def payload_finite(payload: Payload) -> Tensor:
    """Whether every floating tensor of ``payload`` is finite (integer parts, such as indices, are),
    as a 0-d bool tensor on the payload's device: :func:`finite` of each, combined there."""
    floating = [finite(t) for t in payload if t.is_floating_point()]
    if not floating:
        return torch.ones((), dtype=torch.bool, device=payload[0].device if payload else None)
    for other in floating[1:]:
        floating[0] = floating[0] & other
    return floating[0]


def keep_if(ok: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """A state after a step: ``new`` where the step was finite (``ok``, a 0-d bool tensor), else
    ``old``. On an accelerator written into ``old`` with ``torch.where`` (no host read) and
    ``old`` returned; on the CPU, where a read is free, whichever buffer holds it is returned, by
    one read and no pass (rule "host reads", ``docs/architecture.md``). The caller keeps the
    returned buffer as the state, and the other as scratch."""
    if host.reads_are_free(old.device):
        return new if host.flag(ok) else old
    torch.where(ok, new, old, out=old)
    return old


def commit(ok: Tensor, new: Tensor, state: Tensor) -> None:
    """``state`` becomes ``new`` where the step was finite (``ok``): :func:`keep_if` for a state
    that must stay in its buffer (one copy or masked pass)."""
    if host.reads_are_free(state.device):
        if host.flag(ok):
            state.copy_(new)
    else:
        torch.where(ok, new, state, out=state)


def finite(tensor: Tensor) -> Tensor:
    """Whether every element is finite, as a 0-d bool tensor on the tensor's device: nothing is read
    on the host, so a caller commits with ``torch.where(ok, new, old)`` instead of branching (rule
    "host reads", ``docs/architecture.md``). One reduction pass: the min and max are both finite
    exactly when every element is (a NaN propagates into both, an Inf into one), and unlike a sum
    they cannot overflow."""
    if not tensor.numel():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


def check_gradient(tensor: Tensor) -> Tensor:
    """Apply the input policy: refuse non-floating tensors, return a contiguous flat view."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"gradient compressors take floating-point tensors, got dtype {tensor.dtype}")
    return tensor.contiguous().view(-1)
