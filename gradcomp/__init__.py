"""gradcomp: gradient compression and communication optimization for PyTorch data parallelism.

One import name, in layers whose dependencies point one way (``docs/architecture.md``):

- the core: ``gradcomp.compressors`` (and error feedback), ``gradcomp.collectives``,
  ``gradcomp.engine`` (the per-bucket pipeline), emulated networks, launching and benchmarks;
- ``gradcomp.hooks``: DDP communication hooks over the engine;
- ``gradcomp.experiments``: training runs, sweeps and the DDP benchmark (``pip install
  'gradcomp[experiments]'`` for what they need beyond the core).

``import gradcomp`` itself imports neither torch nor a compressor: the names below load on first use,
so that the ``gradcomp`` command answers ``--help`` without paying for torch's import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["REGISTRY", "Aggregation", "Compressor", "ErrorFeedback", "__version__", "make_compressor", "parse_spec"]

_LAZY = {
    "REGISTRY": "gradcomp.compressors",
    "Aggregation": "gradcomp.compressors",
    "Compressor": "gradcomp.compressors",
    "make_compressor": "gradcomp.compressors",
    "parse_spec": "gradcomp.compressors",
    "ErrorFeedback": "gradcomp.compressors.feedback",
}

if TYPE_CHECKING:
    from gradcomp.compressors import REGISTRY, Aggregation, Compressor, make_compressor, parse_spec
    from gradcomp.compressors.feedback import ErrorFeedback


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'gradcomp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value
