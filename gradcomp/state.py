"""What every state that averages a model over its ranks offers a training loop: :class:`TrainingHookState`.

gradcomp's hooks (``gradcomp.hooks.HookState``, DDP's and FSDP2's), the ``auto`` hook's
(``AutoState``), torch's own hooks recorded (``TorchHookState``, ``TorchFSDPState``) and the
synchronizer of local SGD and DiLoCo (:class:`gradcomp.sync.Synchronizer`) keep per-step statistics,
write traces, save and restore their state, and keep the error that failed them. Code that takes
any of them (training runs, benchmarks) names this protocol. Each of the five inherits it, which
gives it :meth:`~TrainingHookState.steps` and lets mypy check it against the protocol where it is
declared. It lives in the core because the synchronizer, which must not import
``gradcomp.hooks``, is one of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from gradcomp.engine.stats import StepStats


class TrainingHookState(Protocol):
    """A hook's (or synchronizer's) state, as a training loop uses it."""

    error: BaseException | None
    """The first exception that failed the averaging (later ones are its consequences), as gradcomp
    raised it (DDP's ``backward`` gets a RuntimeError with its text): a
    :class:`gradcomp.errors.PeerError` names the peer. None while nothing failed."""

    def steps_since(self, first: int) -> Sequence[StepStats]:
        """:meth:`steps` from step ``first`` on, reading only the newest (cheap at every step)."""
        ...

    def steps(self) -> Sequence[StepStats]:
        """Per step (numbered by the hook's step clock, :attr:`StepStats.step`), what averaging cost:
        one :class:`~gradcomp.engine.stats.StepStats` each, the latest ones (each state keeps a
        bounded history). Read it after a step's backward (DDP has waited for every bucket by then)."""
        return self.steps_since(0)

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """A Chrome / Perfetto JSON trace of what was recorded (open it at ui.perfetto.dev): per
        bucket, when it was handed over, its wait, and its compress / communicate / decompress phases."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly, with the spec and world size that made it:
        tensors and plain values, loadable with ``torch.load(..., weights_only=True)``."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, from a state of the same spec and world size:
        anything else is refused, naming both."""
        ...
