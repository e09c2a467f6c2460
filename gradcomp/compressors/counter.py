"""Counter-based random bits: a pure function of (seed, key, draw, position), for stochastic rounding.

Stochastic rounding needs fresh noise for every element of every tensor at every step. Drawn from a
stateful generator per tensor (a ``torch.Generator`` each), a part of 150 tensors costs operators per
tensor and a checkpoint holds an opaque state per tensor. Drawn from a counter, the noise of position
p of key k at its d-th draw is ``hash(start(seed, k) + GOLDEN * (d * 2**40 + p))``: a whole part's
noise comes from the same dozen element-wise operators however many tensors it holds (a counter per
row, then the hash), a tensor's noise does not depend on the part or bucket that holds it, the bits
are the same on the CPU and on a GPU (integer arithmetic only, exact conversions), and a checkpoint
holds one count per key (:class:`Counters`).

The hash is SplitMix64's output function (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014; Java's ``SplittableRandom``), whose generator is this hash over a counter
stepped by the golden-ratio constant: each (key, draw) reads its own run of 2**40 positions of such a
stream, and a key's start is itself hashed from the seed and the key. It is not cryptographic; it is
what stochastic rounding needs, noise uniform and independent of the values it rounds.

Computed in int64 (torch has no uint64 shifts on the CPU): products wrap modulo 2**64 as unsigned
ones do, and a logical right shift is the arithmetic one masked.

Cost: ``ceil(n / 8)`` 64-bit words for n positions (8 random bytes each), about 12 passes over them
eagerly (one, fused, under ``torch.compile``).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.keys import plain
from gradcomp.compressors.randomness import key_seed

GOLDEN = 0x9E3779B97F4A7C15
"""SplitMix64's increment (2**64 / the golden ratio, odd): consecutive counters land far apart."""
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
DRAW_STRIDE = 2**40
"""Counter positions per (key, draw): a tensor's chunks read consecutive runs of them."""


def signed(value: int) -> int:
    """``value`` modulo 2**64 as an int64 (two's complement)."""
    return (value + 2**63) % 2**64 - 2**63


def mix_int(value: int) -> int:
    """SplitMix64's output function of one 64-bit value, in Python integers (the reference)."""
    z = value % 2**64
    z = ((z ^ (z >> 30)) * _M1) % 2**64
    z = ((z ^ (z >> 27)) * _M2) % 2**64
    return signed(z ^ (z >> 31))


def mix_(x: Tensor, scratch: Tensor) -> Tensor:
    """SplitMix64's output function of every element of the int64 ``x``, in place (``scratch``: an
    int64 tensor of ``x``'s shape, overwritten): bitwise :func:`mix_int` of each."""
    for shift, factor in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=scratch)
        scratch.bitwise_and_((1 << (64 - shift)) - 1)  # the shift is arithmetic: clear the sign's copies
        x.bitwise_xor_(scratch)
        if factor is not None:
            x.mul_(signed(factor))
    return x


def stream_start(seed: int, key: Hashable) -> int:
    """Where ``key``'s counter starts (an int64): hashed from the seed and the key, so that the keys'
    streams share nothing but the hash; the same for a ``StateKey`` as for its plain form."""
    return mix_int(key_seed(seed, key))


def counter(start: int, draw: int, position: int = 0) -> int:
    """The counter of ``position`` at a key's ``draw`` (its stream starting at ``start``), an int64."""
    return signed(start + GOLDEN * (draw * DRAW_STRIDE + position))


def draw_offset(draws: Tensor) -> Tensor:
    """What ``draws`` (int64, per row) add to a counter at draw 0, in place: GOLDEN * DRAW_STRIDE each."""
    return draws.mul_(signed(GOLDEN * DRAW_STRIDE))


def fill(firsts: Tensor, out: Tensor, scratch: Tensor) -> Tensor:
    """``out`` (rows, width), int64: row r's words are the hashes of ``firsts[r] + GOLDEN * j``, j <
    width, the counters that follow the row's first (``scratch``: int64 of ``out``'s shape)."""
    torch.add(firsts[:, None], _steps(out.shape[1], out.device), out=out)
    return mix_(out, scratch)


def steps(width: int, device: torch.device) -> Tensor:
    """``GOLDEN * j`` for j < ``width`` (int64, wrapped): what counter j of a run adds to its first."""
    return _steps(width, torch.device(device))


@functools.lru_cache(maxsize=64)
def _steps(width: int, device: torch.device) -> Tensor:
    return torch.arange(width, dtype=torch.int64, device=device).mul_(signed(GOLDEN))


def mix(x: Tensor) -> Tensor:
    """:func:`mix_` as a new tensor, in element-wise operators only: what a fused kernel inlines."""
    for shift, factor in ((30, _M1), (27, _M2), (31, None)):
        x = x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))
        if factor is not None:
            x = x * signed(factor)
    return x


def uniform(words: Tensor, out: Tensor) -> Tensor:
    """Floats uniform in [0, 1) into ``out`` (float64, ``words``' shape), exact: each word's top 53
    bits. Overwrites ``words``."""
    words.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)
    # converted first: an int64 tensor times a Python float computes in float32, which rounds
    # most words (and the largest up to 1.0)
    return out.copy_(words).mul_(2.0**-53)


def uniform_of(words: Tensor) -> Tensor:
    """:func:`uniform` as a new tensor (a fused kernel's form), ``words`` left as they are."""
    return ((words >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0**-53


class Counters:
    """Per key, how many times its noise has been drawn: with the seed, all that a key's stream is.

    A key's d-th draw reads the same bits whatever else is compressed, in which part of which bucket,
    in which order (DDP's buckets change between its first and later iterations); a checkpoint holds
    the counts (plain keys: they load with ``weights_only=True``), and a resumed run draws on."""

    def __init__(self, seed: int, drawn: str = "stochastic rounding's noise") -> None:
        self.seed = seed
        self.drawn = drawn
        """What the counters draw, for the messages."""
        self._counts: dict[Hashable, int] = {}
        self._starts: dict[Hashable, int] = {}

    def start(self, key: Hashable) -> int:
        """:func:`stream_start` of ``key`` under this seed (memoized)."""
        start = self._starts.get(key)
        if start is None:
            start = self._starts[key] = stream_start(self.seed, key)
        return start

    def draw(self, key: Hashable) -> int:
        """The number of ``key``'s next draw, counted as drawn."""
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        return count

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "counts": [{"key": plain(k), "count": c} for k, c in self._counts.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "counts" not in state:
            raise ValueError(
                f"this state of {self.drawn} holds torch.Generator states (a checkpoint of gradcomp before "
                f"{self.drawn} came from counters): it cannot continue the same streams; resume from a newer "
                "checkpoint, or load the model and optimizer alone"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"noise counters were saved with seed {state['seed']}, this one has {self.seed}")
        self._counts = {entry["key"]: int(entry["count"]) for entry in state["counts"]}
