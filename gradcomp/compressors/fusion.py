"""Kernels fused by ``torch.compile``: one element-wise source, C++ on the CPU and Triton on a GPU.

A compressor's eager path is a sequence of operators, each a pass over memory and, on a GPU, a kernel
launch. Where that sequence is the cost, the compressor also writes it as one function of tensors
(element-wise arithmetic and row-wise maps over a part's rows) and runs it through a :class:`Kernel`:
Inductor fuses it into one or two loops (C++ with vector instructions on the CPU, Triton on a GPU).
The eager operators stay as the fallback and compute the same thing, bit for bit (tested), unless a
kernel says otherwise (``sign``'s scales: a sum the fused loop adds in another order, within float32
roundings): where compilation is off or fails, nothing changes but the time.

When it compiles, set by ``GRADCOMP_COMPILE``:

- ``auto`` (the default): where a compiler for the device is found (a C++ compiler on the CPU,
  Triton on a GPU);
- ``1``: always (a failure still falls back, with a warning);
- ``0``: never (the test suite's default: one process compiles in ``tests/test_fusion.py``).

Cost, measured on this project's 2-core machine: a process's first compiled kernel about 6 s
(``torch.compile``'s own start), then each configuration (dtype, row length, rounding) 2-5 s the
first time any process meets it and 0.3-0.6 s once Inductor's disk cache holds it (its folder,
``TORCHINDUCTOR_CACHE_DIR``); each reported once at INFO level on the ``gradcomp`` logger, and paid
when a hook is registered (:func:`precompile`) rather than inside the first backward. A
kernel compiles with the number of rows dynamic and the row length static, so that every bucket's
part, whatever its number of tensors, runs the same compiled code: no recompilation in steady state.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

ENVIRONMENT = "GRADCOMP_COMPILE"
SETTINGS = ("auto", "1", "0")
log = logging.getLogger("gradcomp")


def setting() -> str:
    """``GRADCOMP_COMPILE``'s value: ``auto`` (unset), ``1`` or ``0``."""
    value = os.environ.get(ENVIRONMENT, "auto").strip().lower()
    if value not in SETTINGS:
        raise ValueError(f"{ENVIRONMENT} must be one of {', '.join(SETTINGS)}, got {value!r}")
    return value


def compiler_found(device: torch.device) -> bool:
    """Whether Inductor can build kernels for ``device``: Triton for a GPU, a C++ compiler for the CPU."""
    return _compiler_found(device.type)


@functools.cache
def _compiler_found(device_type: str) -> bool:
    if device_type == "cpu":
        return any(shutil.which(name) for name in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))
    return importlib.util.find_spec("triton") is not None


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` run compiled (the module's notes)."""
    choice = setting()
    return choice == "1" or (choice == "auto" and compiler_found(device))


class Kernel:
    """``function`` of tensors (a part's rows and per-row values), compiled where :func:`enabled`;
    the caller keeps the eager operators that compute the same thing, for where it is not.

    The function writes its results into tensors it is given (``out.copy_(...)``): the compiled loop
    writes there directly, so that a step allocates nothing. Its first tensor's device decides.
    Keyword arguments are constants of the configuration (levels, rounding). Each configuration (the
    tensors' dtypes and row lengths, which are None, the constants) compiles once, as a function of
    its own, so that a process with many configurations never meets Dynamo's recompilation limit.
    """

    def __init__(self, function: Callable[..., None], name: str) -> None:
        self.function = function
        self.name = name
        self._compiled: dict[tuple[Any, ...], Callable[..., None] | None] = {}
        """Per configuration, its compiled function, or None where compiling failed."""
        self.compiled_runs = 0
        """How many calls ran compiled (what a test or a benchmark checks it measured)."""

    def may_run(self, device: torch.device) -> bool:
        """Whether :meth:`run` may run on ``device`` (compiling, or observed): whether a caller should
        prepare what only the kernel needs."""
        observed = getattr(_watch, "observer", None) is not None
        return observed or (enabled(device) and _get_current_dispatch_mode() is None)

    def run(self, *tensors: Tensor | None, **constants: Any) -> bool:
        """Run compiled, or say False and write nothing: compilation off, failed before (warned
        once), or a dispatch mode active (an operator count, a profiler's: under one Dynamo compiles
        nothing, and the eager operators are what such a mode is there to see)."""
        observer = getattr(_watch, "observer", None)
        if observer is not None:  # counted as the one kernel it compiles to, wherever it runs
            with _disable_current_modes():
                self.function(*tensors, **constants)
            observer(self, [t for t in tensors if t is not None])
            return True
        device = next(t for t in tensors if t is not None).device
        if not enabled(device) or _get_current_dispatch_mode() is not None:
            return False
        configuration = (device.type, *(None if t is None else (t.dtype, t.shape[1:]) for t in tensors),
                         *sorted(constants.items()))  # fmt: skip
        new = configuration not in self._compiled
        if new:
            self._compiled[configuration] = torch.compile(_fresh(self.function), fullgraph=True)
        compiled = self._compiled[configuration]
        if compiled is None:
            return False
        for tensor in tensors:
            _rows_dynamic(tensor)
        started = time.perf_counter()
        try:
            compiled(*tensors, **constants)
        except Exception as error:  # a compiler missing or failing: the eager operators, from now on
            self._compiled[configuration] = None
            message = str(error).splitlines()[0] if str(error) else ""
            warnings.warn(f"gradcomp: {self.name} could not be compiled, it runs eagerly (same results, slower): "
                          f"{type(error).__name__}: {message}", stacklevel=3)  # fmt: skip
            return False
        self.compiled_runs += 1
        if new:
            log.info("gradcomp: %s compiled in %.1f s for %s (kept in Inductor's cache)", self.name,
                     time.perf_counter() - started, configuration)  # fmt: skip
        return True


def precompile(spec: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> float:
    """Compile now the fused kernels that ``spec``'s compressor runs on gradients of ``dtype`` on
    ``device`` (a round trip of three chunks through a fresh compressor of the spec), so that the
    first training step does not wait for them: ``gradcomp.hooks.register`` does it. Returns the
    seconds it took: 0.0 where nothing compiles (off, no compiler, a compressor without chunks)."""
    from gradcomp.compressors.registry import make_compressor

    device = torch.device(device)
    if not enabled(device):
        return 0.0
    compressor = make_compressor(spec)
    chunk = getattr(compressor.codec, "chunk", None)
    if not isinstance(chunk, int):
        return 0.0
    started = time.perf_counter()
    payload, ctx = compressor.compress(torch.randn(3 * chunk, device=device).to(dtype), key="gradcomp.precompile")
    compressor.decompress(payload, ctx)
    return time.perf_counter() - started


_watch = threading.local()


@contextlib.contextmanager
def observing(observer: Callable[[Kernel, list[Tensor]], None]) -> Iterator[None]:
    """Meanwhile, in this thread, every kernel runs as written outside any dispatch mode (an operator
    count sees none of its operators) and is reported to ``observer`` with its tensors: what a
    device that compiles it launches (one kernel reading and writing each tensor once), for
    :func:`gradcomp.cost.roofline.traffic` to count the fused launches."""
    previous = getattr(_watch, "observer", None)
    _watch.observer = observer
    try:
        yield
    finally:
        _watch.observer = previous


def _fresh(function: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``function`` with a code object of its own: Dynamo keeps compiled code per code
    object, and counts a configuration past the first as a recompilation."""
    code = function.__code__.replace()
    return types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)  # fmt: skip


def _rows_dynamic(tensor: Tensor | None) -> None:
    """The first dimension (rows, or per-row values) dynamic, the others static: one compiled
    kernel for every number of rows, the row length fixed by the configuration."""
    if tensor is None or tensor.dim() == 0:
        return
    torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for dim in range(1, tensor.dim()):
        torch._dynamo.mark_static(tensor, dim)
