"""Sweep configs: a TOML file, checked completely and expanded into the runs it describes.

::

    [sweep]                      # settings every run shares: any field of TrainConfig
    task = "digits"
    steps = 400
    batch_size = 64

    [grid]                       # axes; every combination is a run
    hooks = ["allreduce", "fp16", "topk:ratio=0.01,ef=true"]
    syncs = ["none"]             # none (the hooks average every step; the default), or local SGD and
                                 # DiLoCo, whose outer gradients travel by each hook: "diloco:every=50"
    ranks = [2]                  # world sizes (default [2])
    networks = ["loopback"]      # gradcomp.netem profiles (default ["loopback"])
    seeds = [0, 1]               # (default [0])
    lr = [0.1, 0.05]             # any other setting, given as a list, is an axis too

    [[tasks]]                    # optional: groups of runs with their own settings and axes
    name = "lm"                  # label in run names (default: task-model)
    task = "charlm"
    lr = 0.003
    hooks = ["allreduce", "powersgd:rank=4,ef=true"]   # replaces [grid]'s hooks for this group

Nothing runs unless the whole file is valid: unknown keys (the valid ones are listed), values of the
wrong type or out of range (each run's TrainConfig is built), hook specs ``hooks.make`` would refuse,
network profiles that do not parse or cannot be built here, and runs that would share a name.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from gradcomp import netem
from gradcomp.experiments.tasks import build_task, parse_task
from gradcomp.experiments.training import runinfo
from gradcomp.experiments.training.config import NO_SYNC, TrainConfig, check_batch, field_names, from_mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

AXES = {"hooks": "hook", "syncs": "sync", "ranks": "ranks", "networks": "network", "seeds": "seed"}
"""Grid keys with a name of their own, and the setting each one sets."""
DEFAULT_AXES: dict[str, list[Any]] = {"syncs": ["none"], "ranks": [2], "networks": ["loopback"], "seeds": [0]}
RUNNER_FIELDS = ("out", "checkpoint", "resume", "overwrite", "stop_at")
"""Settings the sweep runner sets itself (a run's directory is OUT/<run name>)."""
SECTIONS = ("sweep", "grid", "tasks")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a sweep: its name (its directory under the sweep's output) and its settings."""

    name: str
    config: TrainConfig
    label: str


def settings_names() -> list[str]:
    """The TrainConfig fields a sweep config may set ([sweep], [[tasks]], or as [grid] axes)."""
    return [f for f in field_names() if f not in RUNNER_FIELDS and f not in AXES.values()]


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
"""The sweep configs that ship with gradcomp (in the wheel too): ``gradcomp sweep quick`` finds them by name."""


def shipped() -> list[str]:
    """Names of the shipped configs (``quick``, ``full``)."""
    return sorted(name[: -len(".toml")] for name in os.listdir(CONFIGS) if name.endswith(".toml"))


def find_config(name_or_path: str) -> str:
    """The path of a config file, or of the shipped config of that name (a file of that name wins)."""
    if os.path.isfile(name_or_path):
        return name_or_path
    if name_or_path in shipped():
        return os.path.join(CONFIGS, name_or_path + ".toml")
    raise ValueError(f"no sweep config {name_or_path!r}: give a TOML file, or one of {', '.join(shipped())}")


def load(path: str, out: str, unavailable_networks: dict[str, str] | None = None) -> list[Run]:
    """Read, check and expand the sweep config at ``path``; runs go to ``out/<name>``. With a dict as
    ``unavailable_networks``, the runs on networks this machine cannot emulate are left out, and each
    such network's reason is put in it, instead of refusing the whole config."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as error:
        raise ValueError(f"cannot read sweep config {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    return expand(document, out, os.path.dirname(os.path.abspath(path)), path, unavailable_networks)


def expand(
    document: Mapping[str, Any],
    out: str,
    base: str = ".",
    where: str = "sweep config",
    unavailable_networks: dict[str, str] | None = None,
) -> list[Run]:
    """The runs a parsed config describes, every one of them checked. ``base``: where relative
    ``data`` paths start (the config file's directory); ``unavailable_networks``: as for :func:`load`."""
    _known(document, SECTIONS, where, "section")
    shared = _table(document, "sweep", where)
    grid = _table(document, "grid", where)
    entries = document.get("tasks", [{}])
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{where}: [[tasks]] must be tables (one [[tasks]] header per group of runs)")
    settings = settings_names()
    _known(shared, settings, f"{where} [sweep]", "setting", hint=_axis_hint(shared))
    lists = [k for k, v in shared.items() if isinstance(v, list)]
    if lists:
        raise ValueError(f"{where} [sweep]: {', '.join(lists)} given as a list; axes go in [grid]")
    _known(grid, [*AXES, *settings], f"{where} [grid]", "axis")
    runs: list[Run] = []
    for number, entry in enumerate(entries, 1):
        place = f"{where} [[tasks]] #{number}" if "tasks" in document else where
        _known(entry, ["name", *AXES, *settings], place, "key", hint=_axis_hint(entry))
        own_axes = {k: v for k, v in entry.items() if k in AXES or isinstance(v, list)}
        values = {**shared, **{k: v for k, v in entry.items() if k != "name" and k not in own_axes}}
        axes = {**DEFAULT_AXES, **grid, **own_axes}
        runs += _expand_entry(values, axes, entry.get("name"), out, base, place)
    _check_unique(runs, where)
    runinfo.check_out(out)
    for network in dict.fromkeys(run.config.network for run in runs):
        try:
            netem.check(network, {run.config.ranks for run in runs if run.config.network == network})
        except ValueError as error:
            if unavailable_networks is None or not netem.parse(network).emulated:
                raise
            unavailable_networks[network] = str(error)
    runs = [run for run in runs if run.config.network not in (unavailable_networks or {})]
    _check_batches(runs, where)
    return runs


def _expand_entry(
    values: dict[str, Any], axes: dict[str, Any], label: Any, out: str, base: str, where: str
) -> list[Run]:
    if "hooks" not in axes:
        raise ValueError(f"{where}: no hooks to compare: give [grid] hooks = [...]")
    for key, axis in axes.items():
        if not isinstance(axis, list) or not axis:
            raise ValueError(f"{where}: {key} must be a non-empty list, got {axis!r}")
        if key in values:
            raise ValueError(f"{where}: {key} is both a setting and an axis")
    if "data" in values and isinstance(values["data"], str) and not os.path.isabs(values["data"]):
        values["data"] = os.path.join(base, values["data"])
    if label is not None and (not isinstance(label, str) or not SAFE_NAME.fullmatch(label)):
        raise ValueError(
            f"{where}: name must be letters, digits and . _ = + - (it names the runs' directories under --out), "
            f"got {label!r}"
        )
    # seeds outermost, hooks innermost: a sweep cut short has every method for the first seeds
    order: list[str] = [k for k in ("seeds", "networks", "ranks") if k in axes]
    order += [k for k in axes if k not in AXES] + ["syncs", "hooks"]
    runs = []
    for combination in itertools.product(*(axes[k] for k in order)):
        chosen: dict[str, Any] = dict(zip(order, combination, strict=True))
        settings = {**values, **{AXES.get(k, k): v for k, v in chosen.items()}}
        if "data" in chosen and isinstance(chosen["data"], str) and not os.path.isabs(chosen["data"]):
            settings["data"] = os.path.join(base, chosen["data"])
        probe = from_mapping({**settings, "out": "."}, where)  # checks every value
        run_label = label or _default_label(probe)
        parts = [run_label, *(f"{k}={slug(str(chosen[k]))}" for k in order if k not in AXES)]
        effective = probe.effective  # the canonical texts
        parts += [slug(effective.sync)] if effective.sync != NO_SYNC else []
        parts += [slug(effective.hook), f"p{probe.ranks}", slug(probe.network), f"seed{probe.seed}"]
        name = "_".join(parts)
        config = dataclasses.replace(probe, out=os.path.join(out, name), resume="auto")
        runs.append(Run(name, config, run_label))
    return runs


def _default_label(config: TrainConfig) -> str:
    family, _ = parse_task(config.task)
    label = slug(config.task) + "-" + (config.model or family.models[0])
    if config.data:
        label += "-" + slug(os.path.splitext(os.path.basename(config.data))[0])
    return label


def slug(text: str) -> str:
    """A name fit for a directory: ``topk:ratio=0.01,ef=true`` -> ``topk-ratio=0.01-ef=true``."""
    return re.sub(r"[^A-Za-z0-9._=+]+", "-", text.strip()).strip("-") or "x"


SAFE_NAME = re.compile(r"[A-Za-z0-9_=+-][A-Za-z0-9._=+-]*")
"""A [[tasks]] name: one path component, not hidden, never '..' (it names directories under --out)."""
NAME_LIMIT = 255
"""The longest file name most file systems take: a run's name is its directory's."""


def _check_batches(runs: list[Run], where: str) -> None:
    """Every run's batch fits its task's data (each distinct task is built once, here). A task that
    cannot be built (a data file it refuses) is left to fail its runs, which are recorded as failed."""
    tasks: dict[tuple[str, str | None], Any] = {}
    for run in runs:
        config = run.config
        key = (config.task, config.data)
        if key not in tasks:
            try:
                tasks[key] = build_task(config.task, config.data)
            except ValueError:
                tasks[key] = None
        task = tasks[key]
        if task is None:
            continue
        try:
            check_batch(config, task)
        except ValueError as error:
            raise ValueError(f"{where}: run {run.name}: {error}") from None


def _check_unique(runs: list[Run], where: str) -> None:
    seen: dict[str, Run] = {}
    for run in runs:
        if len(run.name.encode()) > NAME_LIMIT:
            raise ValueError(
                f"{where}: the run name {run.name!r} has {len(run.name.encode())} bytes; a directory name takes at "
                f"most {NAME_LIMIT}: give the [[tasks]] group a shorter name, or shorten the hook spec"
            )
        if run.name in seen:
            raise ValueError(
                f"{where}: two runs would be named {run.name!r} (a value repeated in an axis, or [[tasks]] "
                "groups that need distinct names)"
            )
        seen[run.name] = run


def _table(document: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    table = document.get(key, {})
    if not isinstance(table, dict):
        raise ValueError(f"{where}: [{key}] must be a table")
    return table


def _known(table: Mapping[str, Any], valid: list[str] | tuple[str, ...], where: str, what: str, hint: str = "") -> None:
    unknown = sorted(set(table) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown {what}(s) {unknown}{hint}; valid: {', '.join(valid)}")


def _axis_hint(table: Mapping[str, Any]) -> str:
    misplaced = [k for k, v in AXES.items() if v in table]
    if misplaced:
        return f" ({', '.join(AXES[k] for k in misplaced)}: use the axis {', '.join(misplaced)} = [...])"
    return ""
