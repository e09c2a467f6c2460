"""Checks that run before any rank starts: a bad hook spec or network profile is a clear error, early."""

from __future__ import annotations

from gradcomp import hooks, netem


def check_hook(spec: str) -> None:
    """Raise ValueError, with ``hooks.make``'s own message, if ``spec`` is not a valid hook spec."""
    try:
        hooks.check(spec)
    except ValueError as error:
        hint = " (hooks also take allreduce and noop)" if "unknown compressor" in str(error) else ""
        raise ValueError(f"hook {spec!r}: {error}{hint}") from None


def check_network(profile: str) -> None:
    """Raise ValueError if ``profile`` does not parse, or names an emulated network this machine
    cannot build: that needs root and iproute2, and a delay needs the kernel's netem qdisc. An emulated
    profile is built once, for two ranks, and torn down (a fraction of a second) to find out."""
    try:
        parsed = netem.Profile.parse(profile)
    except ValueError as error:
        raise ValueError(f"network {profile!r}: {error}") from None
    if not parsed.emulated:
        return
    reason = netem.unavailable()
    if reason:
        raise ValueError(f"network {profile!r}: {reason}")
    try:
        with netem.Network(2, parsed):
            pass
    except netem.NetemError as error:
        raise ValueError(f"network {profile!r}: {error}") from None
