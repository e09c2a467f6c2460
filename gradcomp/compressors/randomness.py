"""Seeded, checkpointable random generators owned by a compressor (never the global RNG)."""

from __future__ import annotations

from typing import Any

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive ranks over the seed space


def rank_seed(seed: int, rank: int) -> int:
    """A seed for per-rank randomness, distinct for each (seed, rank) and stable across runs."""
    return (seed * 1_000_003 + (rank + 1) * _MIX) % (2**63)


class Generators:
    """One :class:`torch.Generator` per device, created lazily from one seed.

    Each device's stream depends only on the seed and on how many numbers were drawn on that
    device, so ranks that draw the same amounts in the same order draw the same numbers.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def on(self, device: torch.device) -> torch.Generator:
        """The generator for ``device``."""
        name = str(torch.device(device))
        generator = self._generators.get(name)
        if generator is None:
            generator = torch.Generator(device=name)
            generator.manual_seed(self.seed)
            self._generators[name] = generator
        return generator

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "states": {d: g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"generator state was saved with seed {state['seed']}, this one has {self.seed}")
        self._generators.clear()
        for device, rng_state in state["states"].items():
            self.on(torch.device(device)).set_state(rng_state)
