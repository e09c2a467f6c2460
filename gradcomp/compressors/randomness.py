"""Seeded, checkpointable random generators owned by a compressor (never the global RNG)."""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from typing import Any

import torch

from gradcomp.compressors.keys import plain

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive ranks over the seed space


def rank_seed(seed: int, rank: int) -> int:
    """A seed for per-rank randomness, distinct for each (seed, rank) and stable across runs."""
    return (seed * 1_000_003 + (rank + 1) * _MIX) % (2**63)


def key_seed(seed: int, key: Hashable) -> int:
    """A seed for one key's stream: stable across processes and runs (unlike ``hash`` of strings),
    and the same for a :class:`~gradcomp.compressors.keys.StateKey` as for its plain form."""
    return (seed + zlib.crc32(repr(plain(key)).encode()) * _MIX) % (2**63)


class Generators:
    """One :class:`torch.Generator` per (key, device), each created lazily from the seed and the key.

    A key's stream depends only on the seed, the key and how many numbers were drawn for that key,
    so the same tensor gets the same random numbers whatever else is compressed and in which order
    (DDP's buckets change between its first and later iterations; a resumed run starts over).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[tuple[Hashable, str], torch.Generator] = {}

    def on(self, device: torch.device, key: Hashable = None) -> torch.Generator:
        """The generator of ``key`` on ``device``."""
        slot = (key, str(torch.device(device)))
        generator = self._generators.get(slot)
        if generator is None:
            generator = torch.Generator(device=slot[1])
            generator.manual_seed(key_seed(self.seed, key))
            self._generators[slot] = generator
        return generator

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "streams": [
                {"key": plain(k), "device": d, "state": g.get_state()} for (k, d), g in self._generators.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"generator state was saved with seed {state['seed']}, this one has {self.seed}")
        self._generators.clear()
        for stream in state["streams"]:
            self.on(torch.device(stream["device"]), stream["key"]).set_state(stream["state"])
