"""gradcomp's own errors, for what goes wrong between ranks (bad input is a ValueError or TypeError,
whose message says all a user needs, in one line: gradcomp's launchers report such an error that every
rank raised once, as that line, where these keep their tracebacks: :class:`gradcomp.launch.RankError`).

Inside a DDP hook they also reach DDP's ``backward`` (as a RuntimeError carrying their text: torch's
futures cross C++ there), and the hook's state keeps the original (``HookState.error``).
"""

from __future__ import annotations


class GradcompError(RuntimeError):
    """Base of gradcomp's errors between ranks."""


class PeerError(GradcompError):
    """A transfer with a peer failed or timed out: the peer is frozen, dead, or not taking part in
    the same collective (ranks that run different code). The message names both ranks."""


class SpecMismatchError(GradcompError):
    """Ranks were given different hook specs (every rank's spec is in the message)."""


def backend_failure(what: str, rank: int, world: int, error: BaseException) -> PeerError:
    """A collective of the backend's own failed: it does not say which peer, so say what ran where."""
    return PeerError(
        f"rank {rank} of {world}: {what} failed: a rank frozen, dead, or running a different collective "
        f"(ranks must issue the same ones in the same order)? {error}"
    )
