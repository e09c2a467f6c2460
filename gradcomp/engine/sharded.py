"""The sharded engine: sharded data parallelism's reduce-scatter, compressed, on gradcomp's own group.

A sharded data-parallel trainer (FSDP2, ZeRO) reduce-scatters every module's gradients: a flat
input of p equal shards on every rank, and on rank j the average of shard j. :class:`ShardedEngine`
does that call through a compressor (:mod:`gradcomp.engine.reduce_scatter`: one all-to-all of
compressed shards, or a reduce-scatter of summable payloads; two hops with ``local_size``), on the
ordered executor (rule "one ordered path") and on gradcomp's own process group, and records each
call as the DDP engine records a bucket (:mod:`gradcomp.engine.stats`): there ``input_bytes`` is
what an uncompressed reduce-scatter sends from this rank (its p - 1 other shards), ``payload_bytes``
what the compressor made of it (in both hops with ``local_size``), so their ratio is the saving on
the wire. ``none`` is the backend's own reduce-scatter, with the trainer's own op: bitwise what the
trainer would have done.

:meth:`ShardedEngine.all_gather` quantizes the parameter all-gather where the spec asks
(``param_bits``, DeepSpeed ZeRO++'s qwZ).

:class:`ShardSpec` is the spec: a hook spec (``"quantize:bits=4,ef=true"``) and, optionally,
``local_size`` (``"quantize:bits=4,ef=true,local_size=8"``: two hops, 8 ranks per node) and
``param_bits``. The hooks for FSDP2 live in :mod:`gradcomp.hooks.fsdp2`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp.collectives import hierarchical
from gradcomp.collectives.executor import executor
from gradcomp.collectives.groups import as_timeout, private
from gradcomp.compressors import REGISTRY, Compressor, Key, Meta, Spec, make_compressor
from gradcomp.engine import reduce_scatter, rules, transport
from gradcomp.engine.columns import Columns, Span
from gradcomp.engine.pipeline import check_same_spec
from gradcomp.engine.spec import NOOP, SHARDED_NAMES, HookSpec, split_hook_spec
from gradcomp.engine.stats import BucketRecord, CallSteps
from gradcomp.errors import backend_failure
from gradcomp.options import convert

SHARD_ALGORITHMS = ("native", "ring")
"""How payloads travel: native (the backend's all-to-all and reduce-scatter: one collective each,
on the device with NCCL) or ring (gradcomp's own point-to-point exchanges, every byte counted)."""
UNCOMPRESSED = "none"
"""The uncompressed reduce-scatter's name in sharded specs (``allreduce`` is accepted as its alias)."""


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """A parsed spec for sharded training: what the gradients travel as (``hook``: compressor, algo,
    seed), in how many hops (``local_size``), and the parameters' bits in their all-gather
    (``param_bits``). ``str()`` is its canonical text, which parses back to an equal spec."""

    hook: HookSpec
    local_size: int = 0
    """Ranks per node for the two-hop reduce-scatter (intra-node, then inter-node: ``local_size``
    times fewer bytes across nodes, at the price of a second compression); 0: one hop."""
    param_bits: int = 0
    """Bits per parameter in the parameter all-gather (2..8: DeepSpeed ZeRO++'s qwZ, every forward
    and backward computes with the weights rounded to the nearest of 2^bits levels per chunk of
    1024, an 8-byte scale each; 8 is ZeRO++'s choice). 0: the trainer's own exact all-gather."""

    def __post_init__(self) -> None:
        if isinstance(self.local_size, bool) or not isinstance(self.local_size, int) or self.local_size < 0:
            raise ValueError(
                f"local_size must be a whole number of ranks per node (0: one hop), got {self.local_size!r}"
            )
        if isinstance(self.param_bits, bool) or self.param_bits not in (0, *range(2, 9)):
            raise ValueError(f"param_bits must be 0 (exact) or 2..8, got {self.param_bits!r}")
        if self.param_bits and self.hook.noop:
            raise ValueError("param_bits quantizes the parameter all-gather of a reduce-scatter spec; noop has none")
        rules.check(self.hook, rules.Surface.FSDP2)

    @classmethod
    def parse(cls, spec: ShardSpecLike, **defaults: Any) -> ShardSpec:
        """Parse a sharded spec: a hook spec (text, ``(name, options)`` or :class:`HookSpec`) whose
        options may also set ``local_size`` and ``param_bits``; ``defaults`` as :meth:`HookSpec.parse`'s. Raises
        ValueError naming what is wrong and the valid choices."""
        if isinstance(spec, ShardSpec):
            return spec
        if isinstance(spec, HookSpec):
            return cls(spec)
        name, options = split_hook_spec(spec)
        sharded = {}
        for key in SHARD_OPTIONS:
            value = options.pop(key, 0)
            try:
                sharded[key] = convert(key, value, int)
            except ValueError:
                raise ValueError(f"{key} must be a whole number, got {value!r}") from None
        names = [*SHARDED_NAMES, *valid_names()]  # an unknown name's message lists a sharded run's
        hook = HookSpec.parse_among((name, options), defaults, names, more_options=SHARD_OPTIONS)
        return cls(hook, **sharded)

    @property
    def compressor(self) -> Spec | None:
        return self.hook.compressor

    @property
    def noop(self) -> bool:
        return self.hook.noop

    def __str__(self) -> str:
        text = str(self.hook)
        if self.compressor is not None and self.compressor.name == UNCOMPRESSED:
            text = UNCOMPRESSED + text[len("allreduce") :]
        for key in SHARD_OPTIONS:
            if getattr(self, key):
                text += f"{',' if ':' in text else ':'}{key}={getattr(self, key)}"
        return text


SHARD_OPTIONS = ("local_size", "param_bits")
"""The options a sharded spec takes besides a hook spec's."""
ShardSpecLike = str | tuple[str, Mapping[str, Any]] | Spec | HookSpec | ShardSpec
"""Anything :meth:`ShardSpec.parse` takes."""


def valid_names() -> list[str]:
    """The spec names sharded training takes: the uncompressed reduce-scatter, noop and every
    compressor that works on a flat shard (and, registered by the layers above, FSDP2's own:
    :data:`~gradcomp.engine.spec.SHARDED_NAMES`)."""
    flat = [n for n, c in REGISTRY.items() if not c.declare(c.Config()).needs_shapes and n != UNCOMPRESSED]
    return [UNCOMPRESSED, NOOP, *sorted(flat)]


class ShardedEngine:
    """Reduce-scatters flat gradients over a process group through one compressor.

    Create engines on every rank in the same order (the first one of a process creates gradcomp's
    process group for ``group``, and with ``local_size`` its node and cross-node groups).

    Args:
        spec: a sharded spec (:class:`ShardSpec` or its text); not ``noop``, which needs no engine.
        group: the ranks that share the shards (FSDP's shard group; default: the world).
        timeout: what any of the engine's collectives may take before it fails (a frozen or failed
            peer); default: ``group``'s own.
        history: how many call records (:mod:`gradcomp.engine.stats`) to keep, the latest.
    """

    def __init__(
        self,
        spec: ShardSpecLike,
        *,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | float | None = None,
        history: int = 10_000,
    ) -> None:
        timeout = as_timeout(timeout)  # a number of seconds, or refused here
        self.spec = ShardSpec.parse(spec)  # before touching any process group: a bad spec fails first
        if self.spec.compressor is None:
            raise ValueError("noop sends nothing: it needs no engine")
        self.world = dist.get_world_size(group)
        if self.spec.local_size:
            hierarchical.check_local_size(self.world, self.spec.local_size)
        self.compressor: Compressor = make_compressor(
            self.spec.compressor, seed=self.spec.hook.seed, rank=dist.get_rank(group)
        )
        self.param_codec: Compressor | None = None
        """The parameter all-gather's codec (``param_bits``); None: exact."""
        if self.spec.param_bits:
            self.param_codec = make_compressor(("quantize", {"bits": self.spec.param_bits, "rounding": "nearest"}))
        self._capacities: dict[int, int] = {}  # the all-gather's frame bytes, per shard size
        self.group = private(group, timeout)
        self._rank = dist.get_rank(self.group)
        self._hops = hierarchical.subgroups(self.group, self.spec.local_size) if self.spec.local_size else None
        self._native = self.spec.hook.algo == "native"
        self._backends_own = self.spec.compressor.name == UNCOMPRESSED and self._native and self._hops is None
        self._checked = False
        self._columns: dict[tuple[Any, ...], Columns] = {}  # per module and size, the policy's split
        self.calls = CallSteps()
        self.records: collections.deque[BucketRecord] = collections.deque(maxlen=history)

    def reduce_scatter(
        self, output: Tensor, input: Tensor, divisor: float, key: Key, dense: Sequence[Span] = ()
    ) -> None:
        """``output`` = this rank's shard of the sum over the group of ``input / divisor``, compressed;
        returns when it is there.

        ``input`` is flat and contiguous, ``world`` shards of ``output.numel()`` elements, shard j for
        rank j; it is scratch afterwards. ``key`` identifies the tensor across steps (a module): its
        state is kept per key, shard and size (a module whose unused parameters leave the reduction
        gets state of its own). A key seen again starts a new step of :attr:`records`. ``dense``: the
        columns of every shard that travel uncompressed (the spec's per-tensor policy:
        :func:`gradcomp.engine.columns.dense_columns`), as the backend's reduce-scatter of them.
        """
        self._check(output, input, divisor)
        # what leaves this rank uncompressed, every shard but its own (payload bytes count the same)
        leaving = (self.world - 1) * output.numel() * output.element_size()
        record = BucketRecord(*self.calls.number(key), leaving, time.perf_counter())
        on_callers_stream = _callers_stream(input.device)

        def operation() -> tuple[None, None]:
            with on_callers_stream():
                record.started = time.perf_counter()
                self._check_same_spec(input.device)
                if dense and not self._backends_own:
                    self._reduce_split(output, input, divisor, key, record, dense)
                else:
                    self._reduce(output, input, divisor, (key, input.numel()), record)
                record.finished = time.perf_counter()
                self.records.append(record)
            return None, None

        executor().submit(operation, wait=True)

    def all_gather(self, output: Tensor, input: Tensor) -> None:
        """``output`` = every rank's ``input`` (its parameter shard), in rank order, each through the
        parameter codec (``param_bits``), this rank's own too: every rank then computes with the same
        weights. Returns when it is there. ``input`` may be a view of ``output`` (FSDP2's is)."""
        codec = self.param_codec
        if codec is None:
            raise ValueError(f"{self.spec} gathers parameters exactly: param_bits is not set")
        if input.numel() * self.world != output.numel() or input.dtype != output.dtype:
            raise ValueError(f"output must hold {self.world} blocks of the input's {input.numel()} {input.dtype}")
        on_callers_stream = _callers_stream(input.device)

        def operation() -> tuple[None, None]:
            with on_callers_stream():
                self._check_same_spec(input.device)
                payload, _ = codec.compress(input)  # before the output's own block is written over
                exchange = transport.GroupTransport(self.group, _unmetered, native=True)
                capacity = self._capacities.get(input.numel(), 0)
                everyone, self._capacities[input.numel()] = transport.all_gather_padded(
                    [payload], input.device, exchange, capacity
                )
                meta = Meta(input.shape, input.dtype, input.numel())
                for (received,), block in zip(everyone, output.view(self.world, -1), strict=True):
                    codec.decompress(received, meta, out=block)
            return None, None

        executor().submit(operation, wait=True)

    def state_dict(self) -> dict[str, Any]:
        """Nothing beyond the compressor's state (plain values): the same interface as the DDP engine's."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"the sharded engine keeps no state of its own, got keys {sorted(state)}")

    def _reduce(self, output: Tensor, input: Tensor, divisor: float, key: Key, record: BucketRecord) -> None:
        compressor, world = self.compressor, self.world
        if self._backends_own:  # the trainer's own reduce-scatter, its op included: bitwise its result
            record.payload_bytes = record.input_bytes
            with record.phase("communicate"):
                self._backend_reduce_scatter(output, input, divisor)
            record.add_traffic(None, native=record.input_bytes)  # a ring's: every other rank's shard once
            return
        if self._hops is None:
            exchange = transport.GroupTransport(self.group, record.add_traffic, native=self._native)
            record.payload_bytes = reduce_scatter.reduce_scatter(
                compressor, input.view(world, -1), divisor, key, exchange, output, record.phase
            )
            return
        intra, inter = (transport.GroupTransport(g, record.add_traffic, native=self._native) for g in self._hops)
        record.payload_bytes = reduce_scatter.reduce_scatter_two_hop(
            compressor, input, divisor, key, intra, inter, output, record.phase
        )

    def _reduce_split(
        self, output: Tensor, input: Tensor, divisor: float, key: Key, record: BucketRecord, dense: Sequence[Span]
    ) -> None:
        """The policy's columns through an uncompressed reduce-scatter, the others compressed (keyed
        by the module and their number, as a module's whole input is)."""
        row = output.numel()
        memo = (key, row, tuple(dense))
        columns = self._columns.get(memo)
        if columns is None:
            columns = self._columns[memo] = Columns.of(dense, row, output.device)
        with record.phase("compress"):
            plain, kept = columns.split(input.view(self.world, row))
            plain.div_(divisor)
        kept_out = output.new_empty(kept.shape[1])
        if kept.shape[1]:
            self._reduce(kept_out, kept.view(-1), divisor, (key, kept.numel()), record)
        exchange = transport.GroupTransport(self.group, record.add_traffic, native=self._native)
        with record.phase("communicate"):
            summed = exchange.reduce_scatter(plain.view(-1))
        uncompressed = (self.world - 1) * summed.numel() * summed.element_size()
        record.payload_bytes += uncompressed
        record.uncompressed_bytes = uncompressed
        with record.phase("decompress"):
            columns.join(output, summed.to(output.dtype), kept_out)

    def _backend_reduce_scatter(self, output: Tensor, input: Tensor, divisor: float) -> None:
        op = dist.ReduceOp.SUM
        if divisor == self.world:
            op = dist.ReduceOp.AVG
        elif divisor != 1:
            input.div_(divisor)  # gloo has no pre-multiplied sum
        try:
            transport.reduce_scatter_single(output, input, op=op, group=self.group)
        except RuntimeError as error:
            raise backend_failure("the backend's reduce-scatter", self._rank, self.world, error) from error

    def _check_same_spec(self, device: torch.device) -> None:
        """At the first collective (a reduce-scatter, or with ``param_bits`` an all-gather), once."""
        if not self._checked:
            check_same_spec(str(self.spec), self.group, device)
            self._checked = True

    def _check(self, output: Tensor, input: Tensor, divisor: float) -> None:
        if not input.is_floating_point():
            raise TypeError(f"gradients must be floating-point, got {input.dtype}")
        if input.dim() != 1 or not input.is_contiguous() or not output.is_contiguous():
            raise ValueError("the sharded engine reduce-scatters a flat, contiguous input into a contiguous output")
        if input.numel() != self.world * output.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"input must hold {self.world} shards of the output's {output.numel()} {output.dtype} elements, "
                f"got {input.numel()} {input.dtype} elements"
            )
        if not divisor > 0:
            raise ValueError(f"the divisor must be > 0, got {divisor}")


def _unmetered(traffic: object, native: float = 0.0) -> None:
    """The parameter all-gather is not part of the gradient's records (nor is the trainer's own)."""


def _callers_stream(device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A context that puts the executor's work on the caller's current stream (a trainer runs its
    reduce-scatter on a stream of its own: the work must be ordered on it); nothing on the CPU."""
    if device.type == "cpu":
        return contextlib.nullcontext
    module = torch.get_device_module(device)
    stream = module.current_stream(device)
    return lambda: module.stream(stream)
