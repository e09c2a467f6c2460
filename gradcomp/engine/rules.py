"""Which options combine, and where: the one table of refusals, each with its reason.

A hook spec's options are checked one by one where they are declared (:class:`~gradcomp.engine.spec.HookSpec`:
types and ranges). Whether they combine, with each other and with the surface the spec runs on, is
this table's (:data:`RULES`): every combination it does not refuse is one the planner plans
(:mod:`gradcomp.engine.plan`) and the routes execute. Specs are checked against it where they are
made (``HookSpec``: the rules of every surface) and where they are used (the hooks, the sharded and
hybrid engines, ``auto``, the synchronizers, CompressedAdamW: :func:`check`); the cost model and
``gradcomp plan`` ask it which variants of a spec exist (:func:`derive`) instead of catching errors.

``gradcomp explain --rules`` prints the table.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from gradcomp.compressors import Aggregation, Spec

if TYPE_CHECKING:
    from gradcomp.engine.spec import HookSpec


class Surface(str, enum.Enum):
    """Where a hook spec runs."""

    ANY = "every surface"
    DDP = "DDP's hooks"
    AUTO = "an auto candidate"
    FSDP2 = "FSDP2's reduce-scatter"
    HSDP = "HSDP's all-reduce across nodes"
    SYNC = "a synchronizer's outer average"
    CARRIER = "CompressedAdamW's carriers"


class Options(Protocol):
    """The options the rules read (a :class:`~gradcomp.engine.spec.HookSpec`'s fields)."""

    @property
    def compressor(self) -> Spec | None: ...
    @property
    def algo(self) -> str: ...
    @property
    def aggregation(self) -> str: ...
    @property
    def warmup(self) -> int: ...
    @property
    def min_numel(self) -> int: ...
    @property
    def vectors(self) -> str: ...
    @property
    def local_size(self) -> int: ...
    @property
    def pieces(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Rule:
    """A combination refused on some surfaces, and why."""

    applies: str
    """The combination, as the printed table names it."""
    surfaces: tuple[Surface, ...]
    refuses: Callable[[Options], bool]
    reason: str
    """Why, in the words a user reads (``{name}``: the compressor; ``{surface}``: where; ``{algo}``,
    ``{aggregation}``: the options given)."""


def _noop(o: Options) -> bool:
    return o.compressor is None


def _policy(o: Options) -> bool:
    return o.min_numel > 0 or o.vectors == "dense"


def _ef21(o: Options) -> bool:
    return o.compressor is not None and o.compressor.feedback.variant == "ef21"


def _sums(o: Options) -> bool:
    return o.compressor is not None and o.compressor.capabilities.aggregation is Aggregation.SUM


def _trait(o: Options, name: str) -> bool:
    """The compressor's declared capability ``name`` (``Spec.capabilities``; False for noop)."""
    return o.compressor is not None and bool(getattr(o.compressor.capabilities, name))


ANY, DDP, AUTO, FSDP2, HSDP, SYNC, CARRIER = Surface

RULES: tuple[Rule, ...] = (
    Rule("noop with local_size", (ANY,), lambda o: _noop(o) and o.local_size > 1,
         "noop sends nothing: local_size has no nodes to reduce across"),
    Rule("noop with min_numel or vectors", (ANY,), lambda o: _noop(o) and _policy(o),
         "noop sends nothing: min_numel and vectors choose what travels uncompressed"),
    Rule("noop with pieces", (ANY,), lambda o: _noop(o) and o.pieces > 1,
         "noop sends nothing: pieces has nothing to cut"),
    Rule("pieces with a compressor not local to elements or chunks", (ANY,),
         lambda o: o.pieces > 1 and not _noop(o) and not _trait(o, "local"),
         "pieces: {name} compresses each tensor as a whole, so its pieces would compress otherwise; pieces takes "
         "compressors local to elements or chunks: the casts, quantize, qsgd, terngrad, sign, fp8 (error feedback's "
         "clip takes a tensor's norm: not with it)"),
    Rule("two_phase with a sum compressor", (ANY,), lambda o: o.aggregation == "two_phase" and _sums(o),
         "two_phase is for gather compressors; {name} sums its payloads (all-reduce)"),
    Rule("ef21 with two_phase", (ANY,), lambda o: _ef21(o) and o.aggregation == "two_phase",
         "ef=ef21 adds every aggregate to its estimate; two_phase aggregates twice: use gather"),
    Rule("ef21 with warmup", (ANY,), lambda o: _ef21(o) and o.warmup > 0,
         "ef=ef21 keeps estimates that uncompressed warm-up steps would bypass: no warmup"),
    Rule("noop", (AUTO,), _noop, "noop sends nothing: it cannot be an auto candidate"),
    Rule("noop", (SYNC,), _noop, "noop sends nothing, so the replicas would never synchronize: give a hook spec"),
    Rule("noop", (CARRIER,), _noop, "the carrier averages over the ranks: noop would let them drift apart"),
    Rule("momentum correction", (CARRIER,), lambda o: o.compressor is not None and o.compressor.feedback.momentum > 0,
         "the carrier already sends Adam's momentum: momentum correction would apply a second one"),
    Rule("a compressor that needs each tensor's shape", (FSDP2, HSDP), lambda o: _trait(o, "needs_shapes"),
         "{name} needs each tensor's shape (it compresses matrices), and {surface} takes a flat shard of several "
         "tensors: use a quantizer, sign, a cast or a sparsifier"),
    Rule("pieces", (FSDP2,), lambda o: o.pieces > 1,
         "pieces cuts DDP's buckets into parts sent one after another; FSDP2 reduce-scatters a module's shard in "
         "one call: leave it out"),
    Rule("pieces, min_numel or vectors", (HSDP,), lambda o: o.pieces > 1 or _policy(o),
         "pieces, min_numel and vectors pick tensors out of DDP's buckets; an HSDP shard is flat (one tensor per "
         "module): leave them out"),
    Rule("local_size", (HSDP,), lambda o: o.local_size > 1,
         "HSDP's nodes are the model's mesh (fully_shard over mesh['shard']): leave local_size out"),
    Rule("an algo other than native or ring", (FSDP2,), lambda o: o.algo not in ("native", "ring"),
         "sharded training reduce-scatters with algo native or ring, got {algo}"),
    Rule("aggregation", (FSDP2,), lambda o: o.aggregation != "auto",
         "aggregation chooses between DDP's all-gather and two-phase; a sharded reduce-scatter has one way to "
         "aggregate: leave it out (got {aggregation})"),
    Rule("warmup", (FSDP2,), lambda o: o.warmup > 0,
         "warmup sends DDP's first steps uncompressed; FSDP2 reduces module by module, with no step clock of "
         "the engine's: leave it out"),
    Rule("ef21", (FSDP2,), _ef21,
         "ef=ef21 keeps a global estimate of every tensor on every rank; a reduce-scatter leaves each rank its own "
         "shard only: use ef=true"),
)  # fmt: skip
"""Every refused combination. A combination absent from it is planned."""


def refusal(options: Options, surface: Surface = ANY) -> str | None:
    """Why ``options`` cannot run on ``surface`` (the rules of every surface included), or None."""
    for rule in RULES:
        if (ANY in rule.surfaces or surface in rule.surfaces) and rule.refuses(options):
            name = options.compressor.name if options.compressor else "noop"
            name = "allreduce" if name == "none" else name
            return rule.reason.format(name=name, surface=surface.value, algo=repr(options.algo),
                                      aggregation=repr(options.aggregation))  # fmt: skip
    return None


def check(options: Options, surface: Surface = ANY) -> None:
    """Raise ValueError with the reason if ``options`` cannot run on ``surface``."""
    reason = refusal(options, surface)
    if reason is not None:
        raise ValueError(reason)


def derive(spec: HookSpec, surface: Surface = ANY, **changes: Any) -> HookSpec | None:
    """``spec`` with ``changes`` if that runs on ``surface``, else None (nothing is raised): the
    planner's question of whether a variant exists (another aggregation, local_size)."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    changed = _View(**{**fields, **changes})
    if refusal(changed, surface) is not None:
        return None
    return dataclasses.replace(spec, **changes)


@dataclasses.dataclass(frozen=True)
class _View:
    """A spec's options, not yet checked (what :func:`derive` asks the table about)."""

    compressor: Spec | None
    algo: str
    aggregation: str
    seed: int
    warmup: int
    min_numel: int
    vectors: str
    local_size: int
    pieces: int


def table() -> list[tuple[str, str, str]]:
    """(combination, surfaces, reason) for every rule: what ``gradcomp explain --rules`` prints."""
    rows = []
    for rule in RULES:
        where = "every surface" if ANY in rule.surfaces else ", ".join(s.value for s in Surface if s in rule.surfaces)
        rows.append((rule.applies, where, rule.reason))
    return rows
