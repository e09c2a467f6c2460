"""What ``gradcomp compressors`` prints: every registered compressor with its options, the options every
spec takes, and what a hook spec takes besides (given by the caller: the compressors know no hook).

A compressor registered by a plugin (``gradcomp.compressors`` entry points) is listed as a built-in one
is, with its class's first docstring line as its summary, or a dash where it has none.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence

from gradcomp.compressors.registry import REGISTRY, WRAPPER_OPTIONS
from gradcomp.options import format_value

INDENT = " " * 18
"""Where an option of a compressor starts: under its summary."""


def summary(cls: type) -> str:
    """The first line of ``cls``'s docstring, ``-`` where it has none (a plugin's class need not)."""
    lines = (cls.__doc__ or "").strip().splitlines()
    return lines[0].strip() if lines else "-"


def type_name(hint: object) -> str:
    """An option's type as the listing shows it: ``float``, ``exact | sampled``."""
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(map(str, typing.get_args(hint)))
    return getattr(hint, "__name__", str(hint))


def compressor_lines() -> list[str]:
    """A line per registered compressor (name, aggregation, summary), then one per option of its config."""
    lines = []
    for name, cls in sorted(REGISTRY.items()):
        hints = typing.get_type_hints(cls.Config)
        aggregation = cls.declare(cls.Config()).aggregation.value
        lines.append(f"{name:10s} {aggregation:6s} {summary(cls)}")
        for f in dataclasses.fields(cls.Config):
            lines.append(f"{INDENT}{f.name}={format_value(f.default)} ({type_name(hints[f.name])})")
    return lines


def text(
    hook_names: Mapping[str, str] | None = None,
    hook_options: Sequence[str] = (),
    sharded_names: Mapping[str, str] | None = None,
) -> str:
    """The whole listing. ``hook_names`` (name -> what it is) and ``hook_options`` (``algo=native
    (native | ring | ...)``) are what a hook spec takes besides a compressor spec, ``sharded_names``
    what a sharded (FSDP2, HSDP) run's spec takes besides; each listed after the compressors where given."""
    lines = compressor_lines()
    lines += [
        "",
        f"Every spec also takes: {', '.join(WRAPPER_OPTIONS)} (error feedback: ef=true, false or ef21; "
        "momentum, nesterov, mask and clip configure it: docs/compressors.md).",
    ]
    if hook_names:
        lines += ["", "A hook spec (gradcomp.hooks.parse checks one) is a compressor spec or one of:"]
        lines += [f"  {name:21s} {what}" for name, what in hook_names.items()]
    if hook_options:
        lines += ["", "with the engine's options (docs/hooks.md):"]
        lines += [f"  {option}" for option in hook_options]
    if sharded_names:
        lines += ["", "A sharded run's spec (FSDP2, HSDP: docs/fsdp.md) also takes:"]
        lines += [f"  {name:21s} {what}" for name, what in sharded_names.items()]
    return "\n".join(lines) + "\n"
