"""Sizes on the command line, one syntax for every command: elements or bytes, never a guess.

=========================  ==============================================  ========================
written                    means                                           e.g.
=========================  ==============================================  ========================
``N``, ``NK``, ``NM``,     N elements (times 10^3, 10^6, 10^9)             ``1M``, ``25M``, ``4096``
``NG``
``NKiB``, ``NMiB``,        N bytes (times 2^10, 2^20, 2^30)                ``4KiB``, ``16MiB``
``NGiB``, ``NB``
``NKB``, ``NMB``, ``NGB``  N bytes (times 10^3, 10^6, 10^9)                ``100MB``
=========================  ==============================================  ========================

A command that needs bytes takes elements as float32 (4 bytes each), and one that needs elements
takes bytes that hold a whole number of float32 values. ``4Mi``, ``4mib`` and other half-units are
refused with this list: a size must say which it is.
"""

from __future__ import annotations

import re
from typing import NamedTuple

FLOAT32 = 4
"""Bytes per element where a command converts between elements and bytes."""

_ELEMENTS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}
_BYTES = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
ACCEPTED = "N, NK, NM, NG (elements) or NB, NKB, NMB, NGB, NKiB, NMiB, NGiB (bytes)"


class Size(NamedTuple):
    """A size as written: ``value`` of ``unit``."""

    value: int
    unit: str  # "elements" or "bytes"

    def as_elements(self, itemsize: int = FLOAT32) -> int:
        if self.unit == "elements":
            return self.value
        if self.value % itemsize:
            raise ValueError(f"{self.value} bytes are not a whole number of {itemsize}-byte elements")
        return self.value // itemsize

    def as_bytes(self, itemsize: int = FLOAT32) -> int:
        return self.value if self.unit == "bytes" else self.value * itemsize


def parse_size(text: str) -> Size:
    """``"25M"`` -> 25,000,000 elements; ``"16MiB"`` -> 16,777,216 bytes (see the module's table)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None:
        raise ValueError(f"size {text.strip()!r} is not one of: {ACCEPTED}")
    suffix = match.group(2)
    if suffix.upper() in _ELEMENTS:  # K, M, G in either case
        scale, unit = _ELEMENTS[suffix.upper()], "elements"
    elif suffix in _BYTES:  # KiB, MB, ... exactly as written
        scale, unit = _BYTES[suffix], "bytes"
    else:
        raise ValueError(f"size {text.strip()!r} is not one of: {ACCEPTED}")
    value = float(match.group(1)) * scale
    if value != int(value):
        raise ValueError(f"size {text.strip()!r} is not a whole number of {unit}")
    return Size(int(value), unit)


def parse_sizes(text: str) -> list[Size]:
    """A comma-separated list of sizes."""
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError(f"no sizes in {text!r}; give a comma-separated list of {ACCEPTED}")
    return sizes


def format_elements(numel: int) -> str:
    """``25000000`` -> ``25M`` (as :func:`parse_size` reads it back)."""
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if numel >= scale and numel % scale == 0:
            return f"{numel // scale}{suffix}"
    return str(numel)


def format_bytes(size: int) -> str:
    """``4194304`` -> ``4 MiB``."""
    for suffix, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {suffix}"
    return f"{size} B"


_RATE_BITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_BYTES = {"kb/s": 10**3, "mb/s": 10**6, "gb/s": 10**9, "tb/s": 10**12}
_DURATIONS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str) -> float:
    """``"25gbit"`` -> 3.125e9 and ``"600GB/s"`` -> 6e11: bytes per second, from bits (``kbit``,
    ``mbit``, ``gbit``, ``tbit``, as ``tc`` writes them) or bytes (``KB/s``, ``MB/s``, ``GB/s``, ``TB/s``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z/]+)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit not in _RATE_BITS and unit not in _RATE_BYTES) or float(match.group(1)) <= 0:
        raise ValueError(f"bandwidth {text.strip()!r}: expected a positive rate such as 25gbit, 100mbit or 600GB/s")
    value = float(match.group(1))
    return value * _RATE_BITS[unit] / 8 if unit in _RATE_BITS else value * _RATE_BYTES[unit]


def parse_duration(text: str) -> float:
    """``"5us"`` -> 5e-6 seconds (``s``, ``ms``, ``us``, ``ns``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text)
    if match is None or match.group(2) not in _DURATIONS:
        raise ValueError(f"duration {text.strip()!r}: expected e.g. 5us, 2ms or 0.1s")
    return float(match.group(1)) * _DURATIONS[match.group(2)]
