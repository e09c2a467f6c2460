"""Emulated networks on one machine: one Linux network namespace per rank, shaped with ``tc``.

Whether compression pays off depends on the link. This module makes the link a parameter::

    with EmulatedNetwork(4, "1gbit") as net:           # 4 namespaces, each with a shaped 1 Gbit port
        ...                                    # ranks enter net.namespace(r), meet at net.address(0)

or, for whole runs, ``gradcomp.launch.spawn(p, target, network="1gbit")``.

The topology is a star: every rank's namespace has one interface, ``eth0``, a veth whose peer is a port
of a bridge in a hub namespace, like hosts on one switch. Each port is shaped in both directions with
``tbf`` at the profile's rate (the rank's uplink on its ``eth0``, its downlink on the hub's port), so a
rank can neither send nor receive faster than its NIC, incast included. Delay and jitter go in a
``netem`` qdisc on the rank's ``eth0`` (one-way latency between two ranks = ``delay``): the kernel must
have ``sch_netem``, and :func:`EmulatedNetwork` says clearly when it does not (bandwidth-only profiles still work).

Costs and limits: building a network takes eight ``ip``/``tc`` calls per rank (a fraction of a second
for a few ranks); it needs root (CAP_NET_ADMIN). Addresses are 10.213.0.0/16 inside the namespaces this module created:
no other address is ever used. Namespaces are named ``gradcomp-<pid>-<token>-...`` and removed on exit,
on exceptions and on SIGTERM/SIGHUP; after a SIGKILL, ``gradcomp netem cleanup`` removes the leftovers.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterable
from types import FrameType, TracebackType

from gradcomp.options import split_list

logger = logging.getLogger(__name__)

PREFIX = "gradcomp-"
"""Every namespace this module creates starts with this; ``cleanup`` removes only these."""

INTERFACE = "eth0"
"""The rank's interface inside its namespace (set GLOO_SOCKET_IFNAME to it)."""

SUBNET = "10.213"
MAX_RANKS = 254 * 250

_CLONE_NEWNET = 0x40000000
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def address_of(rank: int) -> str:
    """Rank ``rank``'s address inside an emulated network (its namespace's ``eth0``)."""
    host = rank + 1  # .0 and .255 are never hosts
    return f"{SUBNET}.{host // 254}.{host % 254 + 1}"


class NetemError(RuntimeError):
    """An emulated network cannot be built here (not root, no iproute2, a qdisc the kernel lacks)."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """A link: rate in bits per second (None: not shaped), one-way delay and jitter in seconds."""

    name: str
    rate_bits: int | None = None
    delay: float = 0.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_bits is not None and self.rate_bits < 8000:
            raise ValueError(f"network rate must be at least 8kbit, got {self.rate_bits} bit/s in {self.name!r}")
        if self.delay < 0 or self.jitter < 0:
            raise ValueError(f"delay and jitter must be >= 0 in {self.name!r}")
        if self.jitter > self.delay:
            raise ValueError(f"jitter ({self.jitter}s) cannot exceed delay ({self.delay}s) in {self.name!r}")

    @property
    def emulated(self) -> bool:
        """False for loopback: ranks run as plain processes on 127.0.0.1."""
        return self.rate_bits is not None or self.delay > 0

    @property
    def rate_bytes(self) -> float | None:
        return None if self.rate_bits is None else self.rate_bits / 8

    @classmethod
    def parse(cls, text: str) -> Profile:
        """``loopback``; a rate (``100mbit``, ``1gbit``, ``10gbit``); a rate and a delay
        (``1gbit-2ms``); or free form ``rate=1gbit,delay=2ms,jitter=0.5ms``."""
        spec = text.strip().lower()
        if spec in ("loopback", "lo", "none"):
            return cls("loopback")
        if "=" in spec:
            fields: dict[str, str] = {}
            for part in spec.split(","):
                key, sep, value = part.partition("=")
                if not sep or key.strip() not in ("rate", "delay", "jitter"):
                    raise ValueError(f"bad network profile {text!r}: expected rate=..., delay=..., jitter=...")
                fields[key.strip()] = value.strip()
            return cls(
                text.strip(),
                _rate(fields["rate"], text) if "rate" in fields else None,
                _time(fields.get("delay", "0ms"), text),
                _time(fields.get("jitter", "0ms"), text),
            )
        rate, _, delay = spec.partition("-")
        return cls(text.strip(), _rate(rate, text), _time(delay, text) if delay else 0.0)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes of ranks: ``per_node`` ranks on each node's own switch through ``intra`` links, and the
    nodes joined through one ``inter`` uplink per node, which the node's ranks share as they share
    a node's NIC (shaped both ways: a node sends and receives across nodes at ``inter`` in all).

    Written ``nodes=2x2,intra=10gbit,inter=100mbit`` (N nodes x L ranks; ``intra`` and ``inter`` each
    a rate or ``rate-delay``, e.g. ``inter=1gbit-2ms``; ``intra`` defaults to unshaped). A NIC per
    rank (a rail-optimized cluster, a NIC per GPU) at rate R is, for the collectives here, where every
    rank of a node sends across nodes at once, an ``inter`` of L x R."""

    name: str
    nodes: int
    per_node: int
    intra: Profile
    inter: Profile

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError(f"a cluster needs at least 1 node of 1 rank, got {self.nodes}x{self.per_node}")
        if self.world_size > MAX_RANKS:
            raise ValueError(f"a cluster holds at most {MAX_RANKS} ranks, got {self.world_size}")

    emulated = True
    """A cluster is always emulated (its nodes are namespaces)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def check_ranks(self, ranks: int) -> None:
        """A ValueError unless ``ranks`` is how many ranks the cluster's nodes hold."""
        if ranks != self.world_size:
            raise ValueError(
                f"the cluster {self.name!r} holds {self.world_size} ranks ({self.nodes} nodes x {self.per_node}), "
                f"not {ranks}: give as many ranks as its nodes hold"
            )

    def node(self, rank: int) -> int:
        """The node rank ``rank`` runs on: ranks fill nodes in order, as torchrun numbers them."""
        return rank // self.per_node

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """``nodes=NxL,intra=RATE[-DELAY],inter=RATE[-DELAY]``."""
        fields: dict[str, str] = {}
        for part in text.strip().lower().split(","):
            key, sep, value = (item.strip() for item in part.partition("="))
            if not sep or key not in CLUSTER_FIELDS or key in fields:
                raise ValueError(
                    f"bad cluster {text!r}: expected nodes=NxL,intra=RATE,inter=RATE (each once; e.g. "
                    "nodes=2x2,intra=10gbit,inter=100mbit)"
                )
            fields[key] = value
        if "nodes" not in fields or "inter" not in fields:
            raise ValueError(f"bad cluster {text!r}: nodes=NxL and inter=RATE are required")
        match = re.fullmatch(r"(\d+)x(\d+)", fields["nodes"])
        if not match:
            raise ValueError(f"bad cluster {text!r}: nodes=NxL counts nodes and ranks per node, e.g. nodes=2x4")
        links = {}
        for key in ("intra", "inter"):
            link = Profile.parse(fields.get(key, "loopback"))
            if "=" in fields.get(key, "") or (key == "inter" and not link.emulated):
                raise ValueError(f"bad cluster {text!r}: {key} is a rate or rate-delay, e.g. 1gbit or 1gbit-2ms")
            links[key] = link
        return cls(text.strip(), int(match[1]), int(match[2]), links["intra"], links["inter"])


CLUSTER_FIELDS = ("nodes", "intra", "inter")

Network = Profile | Cluster
"""What ``--net`` names: one switch for every rank (:class:`Profile`), or nodes (:class:`Cluster`)."""


def parse(text: str) -> Network:
    """A network profile (:meth:`Profile.parse`) or, starting with ``nodes=``, a :class:`Cluster`."""
    if text.strip().lower().startswith("nodes="):
        return Cluster.parse(text)
    return Profile.parse(text)


def _continues_profile(profile: str, piece: str) -> bool:
    """Whether ``piece`` continues ``profile``: a ``delay=`` or ``jitter=`` that a free-form profile
    lacks yet, or an ``intra=`` or ``inter=`` of a cluster's."""
    key = piece.partition("=")[0].strip().lower() if "=" in piece else None
    if profile.strip().lower().startswith("nodes="):
        return key in CLUSTER_FIELDS and f"{key}=" not in profile.lower()
    return key in ("delay", "jitter") and "=" in profile and f"{key}=" not in profile.lower()


def parse_profiles(text: str) -> list[str]:
    """``"loopback,1gbit"`` -> both, each checked: a bad profile fails before anything runs.

    Commas separate profiles, except inside a free-form one: ``rate=1gbit,delay=2ms,jitter=1ms,loopback``
    is two profiles (a ``delay=`` or ``jitter=`` continues the free-form profile before it), and
    inside a cluster (an ``intra=`` or ``inter=`` continues a ``nodes=``). A semicolon always
    separates: ``delay=1ms;delay=2ms``.
    """
    profiles = split_list(text, _continues_profile)
    if not profiles:
        raise ValueError("--net needs at least one network profile")
    for profile in profiles:
        parse(profile)
    return profiles


PROFILES = ("loopback", "100mbit", "1gbit", "10gbit", "100mbit-2ms", "1gbit-2ms", "10gbit-100us")
"""Named examples; any rate (``25gbit``) and any ``rate-delay`` pair parse too."""


def _rate(text: str, profile: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)", text.strip())
    if not match:
        raise ValueError(f"bad rate {text!r} in network profile {profile!r}: expected e.g. 100mbit, 1gbit, 10gbit")
    return round(float(match[1]) * _UNITS[match[2]])


def _time(text: str, profile: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|ms|us)", text.strip())
    if not match:
        raise ValueError(f"bad time {text!r} in network profile {profile!r}: expected e.g. 2ms, 100us")
    return float(match[1]) * _TIMES[match[2]]


def unavailable() -> str | None:
    """Why emulated networks cannot be built here, or None if they can (root and iproute2)."""
    if os.geteuid() != 0:
        return "emulated networks need root (CAP_NET_ADMIN to create network namespaces and shape them with tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated networks need iproute2; not found: {', '.join(missing)}"
    return None


def check(profile: str, ranks: int | Iterable[int] = ()) -> Network:
    """The parsed profile, or a ValueError if it does not parse, names an emulated network this
    machine cannot build (that needs root and iproute2; a delay needs the kernel's netem qdisc), or
    is a cluster of another size than ``ranks``. An emulated profile is built once, for two ranks (a
    cluster: two nodes of one), and torn down (a fraction of a second) to find out: commands call
    this before starting any rank."""
    try:
        parsed = parse(profile)
    except ValueError as error:
        raise ValueError(f"network {profile!r}: {error}") from None
    for count in [ranks] if isinstance(ranks, int) else ranks:
        if isinstance(parsed, Cluster):
            parsed.check_ranks(count)
    if not parsed.emulated:
        return parsed
    reason = unavailable()
    if reason:
        raise ValueError(f"network {profile!r}: {reason}")
    small: Network = parsed
    if isinstance(parsed, Cluster):  # every kind of link it has, at the smallest size
        small = dataclasses.replace(parsed, nodes=min(parsed.nodes, 2), per_node=1)
    try:
        with EmulatedNetwork(small.world_size if isinstance(small, Cluster) else 2, small):
            pass
    except NetemError as error:
        raise ValueError(f"network {profile!r}: {error}") from None
    return parsed


class EmulatedNetwork:
    """``world_size`` namespaces on a shaped star; a context manager that always tears down.

    Use :meth:`namespace` and :meth:`address` to place rank ``r`` (or :func:`enter` in the rank's own
    process, before it starts any thread), and :data:`INTERFACE` for ``GLOO_SOCKET_IFNAME``.
    """

    def __init__(self, world_size: int, profile: str | Network) -> None:
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size must be in 1..{MAX_RANKS}, got {world_size}")
        self.world_size = world_size
        self.profile = parse(profile) if isinstance(profile, str) else profile
        if not self.profile.emulated:
            raise ValueError("loopback is not an emulated network: run the ranks on 127.0.0.1")
        if isinstance(self.profile, Cluster):
            self.profile.check_ranks(world_size)
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self._created: list[str] = []
        self._previous_handlers: dict[int, object] = {}

    def namespace(self, rank: int) -> str:
        return f"{self.tag}-{rank}"

    @property
    def hub(self) -> str:
        """The switch every rank's port hangs on; on a cluster, the one joining the nodes' uplinks."""
        return f"{self.tag}-hub"

    def node_switch(self, node: int) -> str:
        """A cluster's node: the namespace of its switch and its uplink."""
        return f"{self.tag}-node{node}"

    def address(self, rank: int) -> str:
        return address_of(rank)

    def __enter__(self) -> EmulatedNetwork:
        reason = unavailable()
        if reason:
            raise NetemError(reason)
        self._catch_signals()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        logger.info("emulated network %s: %d ranks on %s", self.tag, self.world_size, self.profile.name)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace this network created (their veths and qdiscs go with them)."""
        for name in reversed(self._created):
            _run("ip", "netns", "delete", name, check=False)
        self._created.clear()
        self._restore_signals()

    def _build(self) -> None:
        self._add_switch(self.hub)
        cluster = self.profile if isinstance(self.profile, Cluster) else None
        flat = self.profile if isinstance(self.profile, Profile) else None
        if cluster is not None:  # each node a switch of its own, its uplink a port of the hub's
            for node in range(cluster.nodes):
                switch, port = self.node_switch(node), f"n{node}"
                self._add_switch(switch)
                self._link(switch, UPLINK, self.hub, port)
                _run("ip", "-n", switch, "link", "set", UPLINK, "master", "br0")
                self._shape(switch, UPLINK, cluster.inter, uplink=True)
                self._shape(self.hub, port, cluster.inter, uplink=False)
        for rank in range(self.world_size):
            name, port = self.namespace(rank), f"p{rank}"
            switch = self.hub if cluster is None else self.node_switch(cluster.node(rank))
            link = cluster.intra if cluster is not None else flat
            assert link is not None
            self._add_namespace(name)
            self._link(name, INTERFACE, switch, port)
            _run("ip", "-n", name, "addr", "add", f"{self.address(rank)}/16", "dev", INTERFACE)
            _run("ip", "-n", name, "link", "set", "lo", "up")
            self._shape(name, INTERFACE, link, uplink=True)
            self._shape(switch, port, link, uplink=False)

    def _add_switch(self, name: str) -> None:
        """A namespace holding a bridge, ``br0``."""
        self._add_namespace(name)
        _run("ip", "-n", name, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", name, "link", "set", "br0", "up")

    def _link(self, namespace: str, device: str, switch: str, port: str) -> None:
        """A veth from ``device`` in ``namespace`` to ``port`` of ``switch``'s bridge, both up."""
        _run("ip", "link", "add", device, "netns", namespace, "type", "veth", "peer", port, "netns", switch)
        _run("ip", "-n", switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", namespace, "link", "set", device, "up")

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def _shape(self, namespace: str, device: str, profile: Profile, *, uplink: bool) -> None:
        """Shape ``device``'s egress to ``profile``: its rate, and on an ``uplink`` its delay."""
        parent = ["root"]
        if uplink and profile.delay > 0:
            delay = ["delay", f"{profile.delay * 1e6:.0f}us"]
            if profile.jitter > 0:
                delay += [f"{profile.jitter * 1e6:.0f}us", "distribution", "normal"]
            # A queue deep enough for a whole bandwidth-delay product: netem's default of 1000
            # packets would drop at 10 Gbit with a few ms of delay.
            limit = max(1000, int((profile.rate_bytes or 1.25e9) * profile.delay * 4 / 1500))
            try:
                _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
                     *delay, "limit", str(limit))  # fmt: skip
            except NetemError as error:
                if "unknown" in str(error).lower():
                    raise NetemError(
                        f"network profile {profile.name!r} has a delay, which needs the netem qdisc, and this kernel "
                        "has none (CONFIG_NET_SCH_NETEM); bandwidth-only profiles (e.g. 1gbit) work here"
                    ) from None
                raise
            parent = ["parent", "1:1"]
        if profile.rate_bytes is None:
            return
        # tbf: the bucket holds 1 ms of traffic (at least 4 full frames) so the link reaches its rate
        # without long bursts; the queue holds ~50 ms before dropping, enough for TCP to keep the pipe full.
        burst = max(int(profile.rate_bytes / 1000), 4 * 1514)
        _run("tc", "-n", namespace, "qdisc", "add", "dev", device, *parent, "handle", "10:", "tbf",
             "rate", f"{profile.rate_bits}bit", "burst", str(burst), "latency", "50ms")  # fmt: skip

    def _catch_signals(self) -> None:
        """Turn SIGTERM / SIGHUP into SystemExit while the network exists, so ``close`` runs."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[number] = signal.signal(number, _exit_on_signal)

    def _restore_signals(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)  # type: ignore[arg-type]  # what signal.signal returned
        self._previous_handlers.clear()


def _exit_on_signal(number: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + number)


NODE_SWITCH = "GRADCOMP_NODE_SWITCH"
"""The environment variable in which a rank on an emulated cluster finds its node's switch (the
namespace holding the node's uplink), for :func:`uplink_bytes`."""

UPLINK = "uplink"
"""A cluster node's interface to the switch between nodes, in the node's switch namespace."""


def uplink_bytes(switch: str) -> int:
    """Bytes the node of switch namespace ``switch`` has sent across nodes so far (its uplink's
    transmit counter, frames as they leave the node: payload and TCP/IP headers)."""
    return sent_bytes(UPLINK, switch)


def sent_bytes(device: str, namespace: str | None = None) -> int:
    """Bytes ``device`` has transmitted so far (its transmit counter: frames as they leave, payload
    and TCP/IP headers), in ``namespace`` (None: the calling process's own, a rank's inside its)."""
    where = ["-n", namespace] if namespace is not None else []
    listing = json.loads(_run("ip", *where, "-s", "-j", "link", "show", device))
    return int(listing[0]["stats64"]["tx"]["bytes"])


def enter(namespace: str) -> None:
    """Move this process into ``namespace``. Call it before starting any thread: a network namespace
    belongs to a thread, and only threads started afterwards inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{namespace}") as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NetemError(f"cannot enter network namespace {namespace}: {os.strerror(errno)}")


def leftovers() -> list[str]:
    """Namespaces created by gradcomp whose creating process no longer runs."""
    stale = []
    for name in namespaces():
        match = re.match(rf"{PREFIX}(\d+)-", name)
        if match and not _alive(int(match[1])):
            stale.append(name)
    return stale


def namespaces() -> list[str]:
    """Every namespace on this machine created by gradcomp (``ip netns list``)."""
    listing = _run("ip", "netns", "list", check=False)
    return sorted(line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX))


def cleanup(*, all_: bool = False) -> list[str]:
    """Delete the namespaces of gradcomp processes that died (every gradcomp namespace with ``all_``)."""
    reason = unavailable()
    if reason:
        raise NetemError(reason)
    doomed = namespaces() if all_ else leftovers()
    for name in doomed:
        _run("ip", "netns", "delete", name, check=False)
    return doomed


def _alive(pid: int) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 0)
        return True
    return False


def _run(*command: str, check: bool = True) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        message = done.stderr.strip() or f"exit code {done.returncode}"
        raise NetemError(f"`{' '.join(command)}` failed: {message}")
    return done.stdout


def describe(profile: Network) -> str:
    """One line for tables: ``loopback``, the rate and delay, or a cluster's nodes and links."""
    if isinstance(profile, Cluster):
        return (f"{profile.nodes} nodes x {profile.per_node} ranks, {describe(profile.intra)} inside a node, "
                f"{describe(profile.inter)} across")  # fmt: skip
    if not profile.emulated:
        return "loopback"
    parts = [] if profile.rate_bits is None else [_format_rate(profile.rate_bits)]
    if profile.delay:
        parts.append(f"{profile.delay * 1e3:g} ms")
    return ", ".join(parts)


def _format_rate(bits: int) -> str:
    for unit, size in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= size:
            return f"{bits / size:g} {unit}"
    return f"{bits} bit/s"
