"""One key type for every piece of a tensor's state: :class:`StateKey`.

A compressor keeps state per key (error feedback's residuals, PowerSGD's memory, random streams). The
key is the tensor's stable identity (a DDP hook's parameter index, an FSDP2 module's name), and the
engine keys the parts it cuts a tensor into apart, each of them a field here:

=========  ==========================================================================================
piece      pieces of its rows, compressed as tensors of their own (``HookSpec.pieces``)
node       the rows a local rank compresses across nodes (``HookSpec.local_size``)
hop        a hop of the sharded reduce-scatter: ``"intra"`` (inside the node) or ``"inter"``
shard      the shard compressed for rank j (two-phase's first phase, the reduce-scatter's destinations)
reduced    with ``shard`` = this rank: the reduced shard, compressed again (two-phase's second phase)
=========  ==========================================================================================

"Everything of parameter p" is one query (:func:`of_parameter`): the ``auto`` hook, moving a tensor
to another method, collects all of it, whichever route cut it.

A key is equal to, and hashes as, its plain form (:meth:`StateKey.plain`: the nested tuples the
engine wrote before this type existed, ``((k, "node", j), s)``): checkpoints hold plain forms (plain
values load with ``weights_only=True``) and load unchanged, a loaded plain key finds its state again,
and the random streams seeded from a key (:func:`gradcomp.compressors.randomness.key_seed`) are
bitwise those of its plain form.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

HOPS = ("intra", "inter")
"""The sharded reduce-scatter's hops (:mod:`gradcomp.engine.reduce_scatter`)."""


@dataclasses.dataclass(frozen=True, eq=False)
class StateKey:
    """The identity of one part of one tensor's state (the module's docstring). Derive a part's key
    from its tensor's with the ``of_*`` methods, never by building tuples: ``StateKey.of(k).of_node(j)``."""

    parameter: Hashable
    """The tensor's own key, as its hook gave it."""
    piece: int | None = None
    node: int | None = None
    hop: str | None = None
    shard: int | None = None
    reduced: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.parameter, StateKey):
            raise TypeError("a StateKey's parameter is a tensor's own key, not another StateKey: use StateKey.of")
        if self.hop is not None and self.hop not in HOPS:
            raise ValueError(f"unknown hop {self.hop!r}; valid: {', '.join(HOPS)}")
        if self.reduced and self.shard is None:
            raise ValueError("a reduced shard's key names the shard (this rank's)")

    @classmethod
    def of(cls, key: Hashable) -> StateKey:
        """``key`` as a :class:`StateKey`: itself if it is one, else a whole tensor's (never parsed:
        a hook's key means its tensor, whatever its shape)."""
        return key if isinstance(key, StateKey) else cls(key)

    def of_piece(self, index: int) -> StateKey:
        """Piece ``index`` of the tensor's rows (``HookSpec.pieces``)."""
        return dataclasses.replace(self._unset("piece"), piece=index)

    def of_node(self, local_rank: int) -> StateKey:
        """The rows local rank ``local_rank`` compresses across nodes (``HookSpec.local_size``)."""
        return dataclasses.replace(self._unset("node"), node=local_rank)

    def of_hop(self, hop: str) -> StateKey:
        """A hop of the sharded reduce-scatter: ``"intra"`` or ``"inter"``."""
        return dataclasses.replace(self._unset("hop"), hop=hop)

    def of_shard(self, rank: int) -> StateKey:
        """The shard compressed for rank ``rank`` (two-phase's first phase, the reduce-scatter's)."""
        return dataclasses.replace(self._unset("shard"), shard=rank)

    def of_reduced(self, rank: int) -> StateKey:
        """The reduced shard of ``rank`` (the rank that reduces it: this one), compressed again."""
        return dataclasses.replace(self._unset("shard"), shard=rank, reduced=True)

    def _unset(self, field: str) -> StateKey:
        """Itself, if it does not name its ``field`` yet: a tensor's part is cut once per kind."""
        if getattr(self, field) is not None:
            raise ValueError(f"{self} already names its {field}: a tensor's part is cut once per kind")
        return self

    def plain(self) -> Hashable:
        """The plain form: nested tuples, innermost the parameter, then piece, node, hop and shard."""
        return self._plain

    @functools.cached_property
    def _plain(self) -> Hashable:  # made once: every dict lookup of the key hashes it
        key = self.parameter
        if self.piece is not None:
            key = (key, "piece", self.piece)
        if self.node is not None:
            key = (key, "node", self.node)
        if self.hop is not None:
            key = (key, self.hop)
        if self.shard is not None:
            key = (key, "reduced", self.shard) if self.reduced else (key, self.shard)
        return key

    @classmethod
    def parse(cls, key: Hashable) -> StateKey:
        """A key of either form as a :class:`StateKey`; a plain form is read from the outside in
        (shard or reduced, hop, node, piece: each at most once). A hook's own key that is itself
        such a tuple would be read as a part: gradcomp's hooks key tensors by index or name."""
        if isinstance(key, StateKey):
            return key
        fields: dict[str, Any] = {}
        for field, read in _LAYERS:
            found = None if field == "shard" and "reduced" in fields else read(key)
            if found is not None:
                key, fields[field] = found
        if "reduced" in fields:
            fields["shard"], fields["reduced"] = fields["reduced"], True
        return cls(key, **fields)

    def __eq__(self, other: object) -> bool:
        return self._plain == (other._plain if isinstance(other, StateKey) else other)

    def __hash__(self) -> int:
        return hash(self._plain)

    def __repr__(self) -> str:
        return f"StateKey({self.parameter!r}{''.join(f', {name}={value!r}' for name, value in self._parts())})"

    def _parts(self) -> list[tuple[str, Any]]:
        """The fields that name a part, as (name, value), those set only."""
        values = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)[1:]]
        return [(name, value) for name, value in values if value is not None and value is not False]

    def __str__(self) -> str:
        parts = ", ".join(f"{name}={value}" for name, value in self._parts())
        return f"tensor {self.parameter!r}" + (f" ({parts})" if parts else "")


Layer = Callable[[Hashable], "tuple[Hashable, Any] | None"]
"""Reads one layer of a plain form: (the key inside it, the field's value), or None."""


def _tagged(tag: str) -> Layer:
    def read(key: Hashable) -> tuple[Hashable, int] | None:
        if isinstance(key, tuple) and len(key) == 3 and key[1] == tag and _index(key[2]):
            return key[0], key[2]
        return None

    return read


def _shard(key: Hashable) -> tuple[Hashable, int] | None:
    return (key[0], key[1]) if isinstance(key, tuple) and len(key) == 2 and _index(key[1]) else None


def _hop(key: Hashable) -> tuple[Hashable, str] | None:
    return (key[0], key[1]) if isinstance(key, tuple) and len(key) == 2 and key[1] in HOPS else None


def _index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_LAYERS: tuple[tuple[str, Layer], ...] = (
    ("reduced", _tagged("reduced")),
    ("shard", _shard),
    ("hop", _hop),
    ("node", _tagged("node")),
    ("piece", _tagged("piece")),
)
"""The plain form's layers, outermost first."""


def plain(key: Hashable) -> Hashable:
    """``key``'s plain form (what checkpoints hold and random streams are seeded from)."""
    return key.plain() if isinstance(key, StateKey) else key


def of_parameter(keys: Iterable[Hashable], parameter: Hashable) -> list[Hashable]:
    """The keys among ``keys`` (either form) of tensor ``parameter``'s state, all its parts."""
    return [key for key in keys if key == parameter or StateKey.parse(key).parameter == parameter]
