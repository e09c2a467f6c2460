"""The ``name:key=value,...`` syntax and typed options, shared by every spec gradcomp reads.

Compressor specs (``"topk:ratio=0.01"``), hook specs (``"topk:ratio=0.01,algo=ring"``), experiment
task specs (``"signal:samples=50000"``) and the settings of training runs (TOML sweep configs, the
command line) all go through here, so a value means the same wherever it is written: strings are
converted to the type the option declares, typed values (TOML, Python) are checked against it, and
anything else is a ValueError that names the option and what it takes.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

Options = TypeVar("Options")
Parsed = TypeVar("Parsed")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def format_value(value: Any) -> str:
    """A value as a spec writes it (booleans as true/false): what :func:`convert` reads back."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def closest(word: str, valid: Iterable[str]) -> str | None:
    """The valid choice closest to ``word`` (:func:`difflib.get_close_matches`, case aside), None where
    none is close."""
    choices = {choice.lower(): choice for choice in valid}
    close = difflib.get_close_matches(str(word).strip().lower(), list(choices), n=1)
    return choices[close[0]] if close else None


def did_you_mean(word: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'topk'?)`` for the valid choice closest to ``word``, ``""`` where none is close:
    what every "unknown" message of a spec puts right after the word it refuses."""
    match = closest(word, valid)
    return f" (did you mean {match!r}?)" if match else ""


def unknown(what: str, word: str, valid: Sequence[str]) -> str:
    """The one-line message for ``word`` that is no valid ``what``: ``unknown compressor 'topkk' (did you
    mean 'topk'?); valid: allreduce, noop, ...``, every valid choice listed."""
    return f"unknown {what} {word!r}{did_you_mean(word, valid)}; valid: {', '.join(valid) or 'none'}"


def is_option(piece: str) -> bool:
    """Whether ``piece`` is a spec's option (``key=value``) rather than a spec (``name`` or ``name:...``)."""
    return "=" in piece and ":" not in piece.partition("=")[0]


def split_list(text: str, continues: Callable[[str, str], bool] | None = None) -> list[str]:
    """A list of specs as the command line writes it, the one rule of every list option
    (``--hooks``, ``--torch-hooks``, ``--candidates``, ``--specs``, ``--net``): ``;`` always separates;
    ``,`` separates too, unless the piece after it continues the item before it, which by default it
    does when it is an option (``key=value``, no ``name:`` in front): ``"fp16,topk:ratio=0.01,ef=true;
    powersgd"`` is three specs. ``continues(item, piece)`` replaces that test (network profiles: only
    ``delay=`` and ``jitter=`` continue a free-form one). Inside one spec, a list of specs (``auto``'s
    candidates) is written with ``|``, which neither level uses."""
    follows = continues or (lambda _, piece: is_option(piece))
    items: list[str] = []
    for group in text.split(";"):
        starts = True  # a group's first piece always starts an item
        for piece in (p.strip() for p in group.split(",")):
            if not piece:
                continue
            if not starts and follows(items[-1], piece):
                items[-1] += f",{piece}"
            else:
                items.append(piece)
            starts = False
    return items


def parse_naming(text: str, parse: Callable[[str], Parsed]) -> Parsed:
    """``parse(text)``, where a ValueError names ``text`` as it was typed: a command line's list holds
    several specs, and an error deep in one may name only its compressor, or its canonical text."""
    try:
        return parse(text)
    except ValueError as error:
        if text.strip() in str(error):
            raise
        raise ValueError(f"{text.strip()!r}: {error}") from None


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


def split_nesting_spec(text: str, name: str, options: Sequence[str], nesting: Sequence[str]) -> dict[str, str]:
    """The options of ``name:key=value,...`` whose options named in ``nesting`` take specs as values
    (``auto``'s candidates, ``compressed-adamw``'s carriers): a piece after one of them that is not
    one of ``options`` continues its value (a spec's own options, as in ``carrier=topk:ratio=0.01,ef=true``);
    every other piece starts an option of ``options``. Values stay strings. ValueError names what is
    wrong: another name, an unknown option, an option given twice."""
    given, _, rest = text.strip().partition(":")
    if given.strip() != name:
        raise ValueError(f"a {name} spec starts with {name!r}, got {text!r}")
    found: dict[str, str] = {}
    current = None
    for piece in (p.strip() for p in rest.split(",") if p.strip()):
        key, equals, value = piece.partition("=")
        if equals and key.strip() in options:
            current = key.strip()
            if current in found:
                raise ValueError(f"option {current!r} given twice in {text!r}")
            found[current] = value.strip()
        elif current is not None and current in nesting:
            found[current] += "," + piece
        else:
            hint = did_you_mean(key, options)
            raise ValueError(f"unknown {name} option {piece!r}{hint}; valid: {', '.join(options)}")
    return found


def options_from(cls: type[Options], options: Mapping[str, Any], owner: str, also_valid: Sequence[str] = ()) -> Options:
    """The options dataclass ``cls`` built from ``options`` (strings, as in specs, or typed values),
    each converted to its field's type by :func:`convert`. Unknown keys, wrong types and values that
    ``cls`` refuses are ValueErrors naming ``owner`` and the valid options (``also_valid``: options
    the caller takes besides the fields, listed with them)."""
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    wrong = sorted(set(options) - fields)
    if wrong:
        valid = [*sorted(fields), *also_valid]
        raise ValueError(f"unknown option(s) {wrong} for {owner}{_hints(wrong, valid)}; "
                         f"valid options: {', '.join(valid) or 'none'}")  # fmt: skip
    hints = typing.get_type_hints(cls)
    values = {key: convert(key, value, hints[key]) for key, value in options.items()}
    try:
        return cls(**values)
    except ValueError as error:
        raise ValueError(f"invalid options for {owner}: {error}") from None


def _hints(wrong: Sequence[str], valid: Sequence[str]) -> str:
    """`` (did you mean 'ratio'?)`` for one unknown option; for several, each one's closest."""
    if len(wrong) == 1:
        return did_you_mean(wrong[0], valid)
    close = [f"{match!r} for {word!r}" for word in wrong if (match := closest(word, valid))]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def convert(key: str, value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` declares (bool, int, float, str, a Literal of choices, or an
    Optional of one of them). Strings are parsed (``"true"``, ``"0.01"``, ``"none"`` for None);
    typed values must already fit (an int where a float is due is widened; a bool is never a number)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            close = did_you_mean(str(value), [str(c) for c in choices])
            raise ValueError(f"option {key!r} must be one of {', '.join(map(str, choices))}; got {value!r}{close}")
        return value
    if origin in (Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        return convert(key, value, members[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f"option {key!r} must be true or false; got {value!r}")
    if hint in (int, float):
        return _number(key, value, hint)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"option {key!r} must be a string; got {value!r}")
        return value
    raise TypeError(f"option {key!r} has an unsupported type {hint!r}")


def _number(key: str, value: Any, hint: type) -> int | float:
    what = "an integer" if hint is int else "a number"
    if isinstance(value, bool):
        raise ValueError(f"option {key!r} must be {what}; got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value) if hint is float else int(value, 10)
        except ValueError:
            raise ValueError(f"option {key!r} must be {what}; got {value!r}") from None
    if hint is int and not isinstance(value, int):
        raise ValueError(f"option {key!r} must be an integer; got {value!r}")
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"option {key!r} must be a finite number; got {value!r}")
    return int(value) if hint is int else float(value)
