"""An audit of host reads, for tests inside ranks: while :func:`audit` lasts, every way of reading a
tensor's values on the host (``bool``, ``float``, ``int``, ``item``, ``tolist``, ``numpy``,
``nonzero``, a boolean mask, ``equal``) is counted, in every thread of the process, as *gated* when it
goes through :mod:`gradcomp.host` and *ungated* (with where it was made) when it does not. On a GPU
each would wait for the device; on this CPU the audit is how a test sees them."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gradcomp import host

READS: list[tuple[Any, str]] = [
    (torch.Tensor, name)
    for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy", "nonzero")
] + [(torch, "nonzero"), (torch, "masked_select"), (torch, "equal")]
"""Where a value leaves a tensor for the host (``torch.Tensor.__getitem__`` with a boolean mask is
counted apart)."""


@dataclasses.dataclass
class Audit:
    gated: int = 0
    ungated: list[str] = dataclasses.field(default_factory=list)
    """Where each ungated read was made (``file:line in function``)."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def count(self) -> None:
        if host.inside():
            with self.lock:
                self.gated += 1
            return
        frame = traceback.extract_stack(limit=3)[0]  # [the read, counted (or masked), count]
        with self.lock:
            self.ungated.append(f"{frame.filename}:{frame.lineno} in {frame.name}")


@contextlib.contextmanager
def audit() -> Iterator[Audit]:
    """Count host reads until the block ends (then the methods are as they were)."""
    found = Audit()
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, name in READS:
            saved.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, _counted(getattr(owner, name), found))
        getitem = torch.Tensor.__getitem__
        saved.append((torch.Tensor, "__getitem__", vars(torch.Tensor).get("__getitem__")))

        def masked(tensor: torch.Tensor, index: Any) -> Any:
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                found.count()
            return getitem(tensor, index)

        torch.Tensor.__getitem__ = masked  # type: ignore[method-assign,assignment]
        yield found
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _counted(read: Callable[..., Any], found: Audit) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        found.count()
        return read(*args, **kwargs)

    return counted
