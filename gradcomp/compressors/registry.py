"""Names to compressors, and the spec strings that configure them.

A spec names a compressor and its options, the same way in Python, on the command line and in
sweep configs::

    "topk:ratio=0.01,method=sampled"
    ("topk", {"ratio": 0.01})
    "quantize:bits=2,ef=true"        # ef wraps the compressor in error feedback

Options are the fields of the compressor's config dataclass; string values are converted by the
field's type. Unknown names and options raise an error that lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

from gradcomp.compressors.base import Compressor, CompressorConfig, spec_text
from gradcomp.compressors.feedback import ErrorFeedback

REGISTRY: dict[str, type[Compressor]] = {}
"""Every registered compressor, by name."""

WRAPPER_OPTIONS = ("ef",)
"""Options every spec accepts besides the compressor's own: ``ef`` turns on error feedback."""

C = TypeVar("C", bound=type[Compressor])
Options = TypeVar("Options")


def register(cls: C) -> C:
    """Class decorator: make a compressor available by its ``name``."""
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} is already registered by {REGISTRY[cls.name].__name__}")
    REGISTRY[cls.name] = cls
    return cls


@dataclasses.dataclass(frozen=True)
class Spec:
    """A parsed spec: a compressor name, its validated config and the wrapper options."""

    name: str
    config: CompressorConfig
    ef: bool = False

    def __str__(self) -> str:
        return spec_text(self.name, self.config, ["ef=true"] if self.ef else [])


SpecLike = str | tuple[str, Mapping[str, Any]] | Spec


def parse_spec(spec: SpecLike) -> Spec:
    """Parse ``"name:key=value,..."``, ``(name, {key: value})`` or a :class:`Spec` into a :class:`Spec`."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, str):
        name, options = split_spec(spec)
    elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        name, options = spec[0].strip(), dict(spec[1])
    else:
        raise TypeError(f"a compressor spec is a string or a (name, options) pair, got {spec!r}")
    if name not in REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(sorted(REGISTRY))}")
    ef = _convert("ef", options.pop("ef", False), bool)
    return Spec(name, options_from(REGISTRY[name].Config, options, repr(name), also_valid=WRAPPER_OPTIONS), ef)


def options_from(cls: type[Options], options: Mapping[str, Any], owner: str, also_valid: Sequence[str] = ()) -> Options:
    """The options dataclass ``cls`` built from ``options`` (strings, as in specs, or typed values),
    each converted to its field's type. Unknown keys, wrong types and values that ``cls`` refuses
    are ValueErrors naming ``owner`` and the valid options. Compressor configs and experiment task
    options (same ``name:key=value`` syntax) both come through here."""
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - fields)
    if unknown:
        valid = ", ".join([*sorted(fields), *also_valid]) or "none"
        raise ValueError(f"unknown option(s) {unknown} for {owner}; valid options: {valid}")
    hints = typing.get_type_hints(cls)
    values = {key: _convert(key, value, hints[key]) for key, value in options.items()}
    try:
        return cls(**values)
    except ValueError as error:
        raise ValueError(f"invalid options for {owner}: {error}") from None


def make_compressor(spec: SpecLike, *, seed: int = 0, rank: int = 0) -> Compressor:
    """Build the compressor a spec describes, wrapped in error feedback when it says ``ef=true``."""
    parsed = parse_spec(spec)
    compressor = REGISTRY[parsed.name](parsed.config, seed=seed, rank=rank)
    if parsed.ef:
        return ErrorFeedback(compressor)
    return compressor


def split_spec(text: str) -> tuple[str, dict[str, str]]:
    """``"name:key=value,..."`` -> (name, {key: value}), values still strings."""
    name, _, rest = text.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"spec option {item!r} in {text!r} is not of the form key=value")
        if key.strip() in options:
            raise ValueError(f"option {key.strip()!r} given twice in {text!r}")
        options[key.strip()] = value.strip()
    return name.strip(), options


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(key: str, value: Any, hint: Any) -> Any:
    """Convert a spec value to the type the config field declares."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"option {key!r} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        return _convert(key, value, members[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f"option {key!r} must be true or false; got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"option {key!r} must be a number; got {value!r}")
        if isinstance(value, str):
            try:
                value = float(value) if hint is float else int(value, 10)
            except ValueError:
                raise ValueError(
                    f"option {key!r} must be {'an integer' if hint is int else 'a number'}; got {value!r}"
                ) from None
        if hint is int and not isinstance(value, int):
            raise ValueError(f"option {key!r} must be an integer; got {value!r}")
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"option {key!r} must be a finite number; got {value!r}")
        return hint(value)
    if hint is str:
        return str(value)
    raise TypeError(f"option {key!r} has an unsupported type {hint!r}")
