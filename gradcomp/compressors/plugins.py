"""Compressors from other distributions: the entry-point group ``gradcomp.compressors``.

A package declares its compressor class (a :class:`~gradcomp.compressors.base.Compressor` subclass
whose ``declare(config)`` returns its :class:`~gradcomp.compressors.capabilities.Capabilities`: at
least the aggregation) under the compressor's ``name`` in its ``pyproject.toml``::

    [project.entry-points."gradcomp.compressors"]
    mysign = "mypackage.compressors:MySign"

Once the package is installed, every process that imports :mod:`gradcomp.compressors` registers it:
hook specs (``"mysign:ef=true"``), ranks started by torchrun or by gradcomp, sweeps, the cost model,
the report and ``gradcomp compressors`` know it with no import by the user. A declaration that does not
load (an import error, not a compressor class, a name other than the class's ``name``, a name
another compressor holds, no capabilities for its default config) is left out with a warning saying
why: one broken package does not stop the others. Costs: a scan of the installed packages' metadata
when gradcomp.compressors is first imported, and each plugin's ``declare`` called once.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from gradcomp.compressors.base import Capabilities, Compressor
from gradcomp.compressors.registry import REGISTRY, register

GROUP = "gradcomp.compressors"
"""The entry-point group that declares compressors."""


def load_entry_points() -> list[str]:
    """Register every compressor the installed distributions declare; returns the names registered."""
    loaded = []
    for point in importlib.metadata.entry_points(group=GROUP):
        where = f"the compressor entry point {point.name} = {point.value!r}"
        try:
            cls = point.load()
        except Exception as error:  # a broken plugin must not stop gradcomp or the other plugins
            warnings.warn(f"{where} does not load, left out: {type(error).__name__}: {error}", stacklevel=2)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Compressor)):
            warnings.warn(f"{where} is not a Compressor subclass, left out", stacklevel=2)
            continue
        if cls.name != point.name:
            warnings.warn(f"{where} names a compressor {cls.name!r}: the names must agree, left out", stacklevel=2)
            continue
        if REGISTRY.get(cls.name, cls) is not cls:
            holder = REGISTRY[cls.name]
            warnings.warn(f"{where}: the name is {holder.__module__}.{holder.__name__}'s, left out", stacklevel=2)
            continue
        problem = _undeclared(cls)
        if problem:
            warnings.warn(f"{where} {problem}, left out", stacklevel=2)
            continue
        register(cls)
        loaded.append(point.name)
    return loaded


def _undeclared(cls: type[Compressor]) -> str | None:
    """Why ``cls`` declares no capabilities for its default config (None: it does). A compressor
    written for gradcomp before the record set ``aggregation`` as a class attribute: it says so."""
    try:
        declared = cls.declare(cls.Config())
    except Exception as error:  # the plugin's own code: whatever it raises, the others load
        legacy = " (class attributes such as aggregation are no longer read)" if hasattr(cls, "aggregation") else ""
        return f"declares no capabilities{legacy}: declare(config) raised {type(error).__name__}: {error}"
    if not isinstance(declared, Capabilities):
        return f"declares no capabilities: declare(config) returned {type(declared).__name__}, not Capabilities"
    return None
