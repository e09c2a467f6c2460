"""Gradient compressors: one module per family, all reachable by name through the registry.

>>> from gradcomp.compressors import make_compressor
>>> c = make_compressor("topk:ratio=0.01,ef=true")

See ``docs/compressors.md`` for each compressor's math, wire cost and when to use it. Compressors
of other installed packages join the registry through the entry-point group ``gradcomp.compressors``
(:mod:`gradcomp.compressors.plugins`), loaded here, after gradcomp's own.
"""

from gradcomp.compressors import cast, fp8, powersgd, quantize, randomk, sign, threshold, topk
from gradcomp.compressors.base import Aggregation, Compressor, CompressorConfig, Key, Measured, Meta, Payload
from gradcomp.compressors.capabilities import Capabilities
from gradcomp.compressors.plugins import load_entry_points
from gradcomp.compressors.registry import REGISTRY, Spec, make_compressor, parse_spec, register
from gradcomp.compressors.segments import Segments
from gradcomp.compressors.simulate import roundtrip, simulate

load_entry_points()  # last: a plugin imports what it subclasses from here

__all__ = [
    "REGISTRY",
    "Aggregation",
    "Capabilities",
    "Compressor",
    "CompressorConfig",
    "Key",
    "Measured",
    "Meta",
    "Payload",
    "Segments",
    "Spec",
    "cast",
    "fp8",
    "make_compressor",
    "parse_spec",
    "powersgd",
    "quantize",
    "randomk",
    "register",
    "roundtrip",
    "sign",
    "simulate",
    "threshold",
    "topk",
]
